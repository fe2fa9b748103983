"""Per-head needle dumps: which layers and KV heads still hold the passkey after the prompt.

For each recipe and passkey prompt, the prompt is prefilled under the recipe (batch 1), and every
layer's slot store is read: for each KV head, how many of the key's tokens (the digits of the pass
key in the prompt) it still holds. Greedy decoding then continues from that cache to say whether the
model found the key. The summary puts the two together: a recipe that loses the key in every head
cannot answer; one that keeps it in most heads and still fails loses something else (the sentence
around the key, the question's context).

``python -m research.needles tova_keydiff h2o full --haystack prose --chat-format --budget 0.2 --out DIR``
writes ``needles.json`` and ``needles.md`` (see ``research/reports/results.md``, retrieval section).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

import evictlayers as el


def key_token_indices(tokenizer, text: str, answer: str) -> list[int]:
    """Indices of the tokens of ``text`` that overlap the first occurrence of ``answer`` (the key
    sentence comes before the question, which does not repeat the key)."""
    start = text.find(answer)
    if start < 0:
        raise ValueError(f"the pass key {answer!r} does not occur in the prompt")
    end = start + len(answer)
    offsets = tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
    found = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
    if not found:
        raise ValueError(f"no token of the prompt overlaps the pass key {answer!r} (characters {start}..{end})")
    return found


def held_key_tokens(cache, key_tokens: Sequence[int]) -> list[list[int]]:
    """``[layer][kv_head]``: how many of ``key_tokens`` (original positions) each head holds (row 0)."""
    wanted = torch.tensor(list(key_tokens))
    counts = []
    for layer in cache.layers:
        pos = layer.store.pos[0].cpu()  # [H, C]
        counts.append([int(torch.isin(wanted, head[head >= 0]).sum()) for head in pos])
    return counts


def prefill_then_greedy(model, policy: el.Policy, ids: torch.Tensor, max_new_tokens: int, after_prefill,
                        eos: int | None = None, tokenizer=None):
    """``(generated token ids, after_prefill(cache))``: prefill ``ids`` ``[1, n]`` under ``policy``, read the
    cache with ``after_prefill`` before any token is generated, then decode greedily from it (at most
    ``max_new_tokens``, stopping after ``eos`` if given)."""
    generated = []
    with torch.inference_mode(), el.apply(model, policy, tokenizer=tokenizer) as run:
        cache = run.new_cache()
        logits = model(input_ids=ids, past_key_values=cache).logits
        read = after_prefill(cache)
        length = ids.shape[1]
        for _ in range(max_new_tokens):
            token = logits[:, -1:].argmax(-1)
            generated.append(int(token))
            if int(token) == eos:
                break
            length += 1
            mask = torch.ones(1, length, dtype=torch.long)
            logits = model(input_ids=token, attention_mask=mask, past_key_values=cache).logits
    return generated, read


def dump_prompt(model, tokenizer, policy: el.Policy, row: dict, max_new_tokens: int = 8) -> dict:
    """One prompt under ``policy``: key tokens held per layer and head after the prompt, and the answer."""
    from evictlayers.eval.tasks.passkey import score_passkey

    key_tokens = key_token_indices(tokenizer, row["text"], row["answer"])
    ids = tokenizer(row["text"], return_tensors="pt")["input_ids"]
    generated, held = prefill_then_greedy(model, policy, ids, max_new_tokens,
                                          lambda cache: held_key_tokens(cache, key_tokens), tokenizer=tokenizer)
    text = tokenizer.decode(generated, skip_special_tokens=True)
    return {
        "depth": row["depth"], "answer": row["answer"], "generated": text,
        "correct": bool(score_passkey(text, row["answer"])), "key_tokens": len(key_tokens),
        "prompt_tokens": int(ids.shape[1]), "held": held,
    }


def summarize(records: list[dict]) -> dict:
    """Over the prompts: accuracy; the share of (layer, head) pairs that hold the whole key, part of it
    or none; per layer, the share of heads holding the whole key; and the whole-key share on the
    prompts answered right vs wrong."""

    def whole_share(record: dict) -> float:
        heads = [c for layer in record["held"] for c in layer]
        return sum(c == record["key_tokens"] for c in heads) / len(heads)

    pairs = [(c, r["key_tokens"]) for r in records for layer in r["held"] for c in layer]
    layers = len(records[0]["held"])
    per_layer = []
    for i in range(layers):
        heads = [(c, r["key_tokens"]) for r in records for c in r["held"][i]]
        per_layer.append(sum(c == k for c, k in heads) / len(heads))
    right = [whole_share(r) for r in records if r["correct"]]
    wrong = [whole_share(r) for r in records if not r["correct"]]
    return {
        "correct": sum(r["correct"] for r in records),
        "n": len(records),
        "whole": sum(c == k for c, k in pairs) / len(pairs),
        "partial": sum(0 < c < k for c, k in pairs) / len(pairs),
        "none": sum(c == 0 for c, k in pairs) / len(pairs),
        "whole_per_layer": per_layer,
        "whole_when_right": sum(right) / len(right) if right else None,
        "whole_when_wrong": sum(wrong) / len(wrong) if wrong else None,
    }


def summary_lines(payload: dict, heading: str = "#") -> list[str]:
    """The summary table and the per-layer whole-key shares of a dump, as markdown lines."""
    s = payload["settings"]
    lines = [
        f"{heading} Per-head needle dump ({s['haystack']} haystack{', chat format' if s['chat'] else ''}, "
        f"{s['n_prompts']} prompts of ~{s['length']} tokens, budget {s['budget']})",
        "",
        "Share of (layer, KV head) pairs holding all of the pass key's tokens after the prompt, part of them, "
        "or none; the whole-key share on prompts answered right and wrong. Rerun: "
        f"`{payload['command']}`.",
        "",
        "| recipe | passkey | whole key | part | none | whole, when right | whole, when wrong |",
        "|---|---|---|---|---|---|---|",
    ]

    def share(x):
        return "-" if x is None else f"{100 * x:.0f}%"

    for name, r in payload["summary"].items():
        lines.append(
            f"| {name} | {r['correct']}/{r['n']} | {share(r['whole'])} | {share(r['partial'])} | {share(r['none'])} "
            f"| {share(r['whole_when_right'])} | {share(r['whole_when_wrong'])} |"
        )
    lines += ["", "Whole-key share per layer, % (layer 0 first):", ""]
    for name, r in payload["summary"].items():
        lines.append(f"- `{name}`: " + " ".join(f"{round(100 * x)}" for x in r["whole_per_layer"]))
    return lines + [""]


def markdown(payload: dict) -> str:
    """The summary, then per prompt the key tokens held per layer."""
    lines = summary_lines(payload)
    lines += ["Per prompt: key tokens held per layer (sum over KV heads, out of key tokens x heads), answer "
              "right (+) or wrong (-):", ""]
    for name, records in payload["records"].items():
        lines += [f"`{name}`:", ""]
        for r in records:
            heads = len(r["held"][0])
            profile = " ".join(str(sum(layer)) for layer in r["held"])
            lines.append(
                f"- depth {r['depth']:.2f} {'+' if r['correct'] else '-'} ({r['generated'].strip()[:12]!r}, "
                f"key {r['answer']}, {r['key_tokens']} tokens x {heads} heads = {r['key_tokens'] * heads}): {profile}"
            )
        lines.append("")
    return "\n".join(lines)


def run_needles(
    model, tokenizer, recipes: Sequence[str], budget: float | int | None, *, haystack: str = "prose",
    chat: bool = True, length: int = 1000, depths: int = 8, seed: int = 0, data=None, command: str = "",
) -> dict:
    """Dump every recipe (shipped name or YAML path) at ``budget`` over the passkey prompts."""
    from evictlayers.eval.runner import resolve_recipe
    from evictlayers.eval.suite import PasskeyTask

    task = PasskeyTask(tokenizer, lengths=[length], depths=depths, seed=seed, haystack=haystack, chat=chat, data=data)
    rows = task.build_rows()
    records, summary = {}, {}
    for recipe in recipes:
        spec = resolve_recipe(recipe)
        policy = spec.policy if spec.is_full else spec.policy.replace(budget=budget)
        records[spec.name] = [dump_prompt(model, tokenizer, policy, row) for row in rows]
        summary[spec.name] = summarize(records[spec.name])
    return {
        "command": command,
        "settings": {"haystack": haystack, "chat": chat, "length": length, "n_prompts": len(rows),
                     "budget": budget, "seed": seed},
        "summary": summary,
        "records": records,
    }


def write(payload: dict, out: Path, render=markdown) -> list[Path]:
    """``needles.json`` and ``needles.md`` (``render(payload)``: this module's or the RULER dump's markdown)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "needles.json", out / "needles.md"]
    paths[0].write_text(json.dumps(payload, indent=1))
    paths[1].write_text(render(payload))
    return paths
