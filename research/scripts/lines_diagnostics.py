"""Why selectors lose the lines task: two measurements on the embedded model.

    python -m research.scripts.lines_diagnostics tova_keydiff --budget 0.5    # from the repository root; ~3 min on one thread

For the 16 lines prompts of research/reports/results.md (10 lines, seed 0):

- ``held``: after the prompt, the share of each record line's tokens the recipe's cache holds, averaged
  over layers and KV heads: the asked line against the other lines.
- ``oracle``: whether greedy decoding answers when the generated tokens see only part of the prompt
  (the prompt itself is processed with full attention, as a prefill before eviction). This masks
  attention with a 4D mask on the unmodified model: a diagnostic of what a cache would need to hold,
  not an eviction (nothing is freed). Subsets: everything; everything but the instruction; 4 sink
  tokens + the asked line and its two neighbours + the question.
"""

from __future__ import annotations

import argparse

import torch

import evictlayers as el
from evictlayers.eval.tasks.lines import LINE_PATTERN, lines_prompts
from evictlayers.models import load_default
from research.passkey_needles import held_key_tokens

SINKS = 4


def line_tokens(tokenizer, text: str) -> tuple[list[int], list[list[int]]]:
    """The prompt's token ids and, per record line, the indices of the tokens overlapping it."""
    encoded = tokenizer(text, return_offsets_mapping=True)
    spans = [(m.start(), m.end()) for m in LINE_PATTERN.finditer(text)]
    offsets = encoded["offset_mapping"]
    return encoded["input_ids"], [[i for i, (s, e) in enumerate(offsets) if s < b and e > a] for a, b in spans]


def held_shares(model, policy: el.Policy, ids: list[int], lines: list[list[int]]) -> list[float]:
    with torch.inference_mode(), el.apply(model, policy) as run:
        cache = run.new_cache()
        model(input_ids=torch.tensor([ids]), past_key_values=cache)
        shares = []
        for tokens in lines:
            held = held_key_tokens(cache, tokens)  # [layer][kv head] counts
            shares.append(sum(map(sum, held)) / (len(held) * len(held[0]) * len(tokens)))
    return shares


def answers_seeing(model, tokenizer, ids: list[int], visible: list[int], answer: str, steps: int = 7) -> bool:
    """Greedy decoding where generated tokens attend to the ``visible`` prompt tokens and to each other."""
    prompt = len(ids)
    sequence = list(ids)
    sees = torch.zeros(prompt, dtype=torch.bool)
    sees[visible] = True
    with torch.inference_mode():
        for _ in range(steps):
            n = len(sequence)
            allowed = torch.ones(n, n, dtype=torch.bool).tril()
            allowed[prompt:, :prompt] &= sees
            mask = torch.zeros(n, n).masked_fill(~allowed, float("-inf"))
            logits = model(input_ids=torch.tensor([sequence]), attention_mask=mask[None, None]).logits
            sequence.append(int(logits[0, -1].argmax()))
    return tokenizer.decode(sequence[prompt:]).lstrip().startswith(answer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="a shipped recipe name or a YAML path")
    parser.add_argument("--budget", type=float, default=0.5, help="fraction of each prompt (default 0.5)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_default()
    model.set_attn_implementation("eager")  # the oracle's 4D float mask
    policy = el.load_recipe(args.recipe).replace(budget=args.budget)
    subsets = ("all", "no instruction", "asked line +-1")
    print(f"| depth | asked line held ({args.recipe} {args.budget:.0%}) | other lines held | "
          + " | ".join(f"answers seeing {s}" for s in subsets) + " |")
    print("|---|---|---|" + "---|" * len(subsets))
    correct = dict.fromkeys(subsets, 0)
    prompts = lines_prompts(tokenizer, n_prompts=16, n_lines=10, seed=0)
    for prompt in prompts:
        ids, lines = line_tokens(tokenizer, prompt.text)
        shares = held_shares(model, policy, ids, lines)
        others = [s for i, s in enumerate(shares) if i != prompt.line]
        question = list(range(lines[-1][-1] + 1, len(ids)))
        near = sorted({t for tokens in lines[max(0, prompt.line - 1) : prompt.line + 2] for t in tokens})
        visible = {
            "all": list(range(len(ids))),
            "no instruction": list(range(SINKS)) + list(range(lines[0][0], len(ids))),
            "asked line +-1": list(range(SINKS)) + near + question,
        }
        row = []
        for subset in subsets:
            ok = answers_seeing(model, tokenizer, ids, visible[subset], prompt.answer)
            correct[subset] += ok
            row.append("yes" if ok else "no")
        print(f"| {prompt.depth:.3f} | {shares[prompt.line]:.2f} | {sum(others) / len(others):.2f} | "
              + " | ".join(row) + " |", flush=True)
    print("| all | | | " + " | ".join(f"{correct[s]}/{len(prompts)}" for s in subsets) + " |")


if __name__ == "__main__":
    main()
