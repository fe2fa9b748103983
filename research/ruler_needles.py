"""Per-head needle dumps on RULER's needle tasks: which answers a recipe's cache still holds after the
prompt, and which it then finds.

Every ``niah_*`` answer is the value of one needle, "One of the special magic {kind} for {key} is:
{value}.", and occurs once in the prompt (:mod:`evictlayers.eval.tasks.ruler.niah`). For each recipe
and prompt (query-aware: the whole prompt is one prefill, batch 1) the dump counts, per layer and KV
head, the value's tokens and the key's tokens the cache holds once the prompt is in; greedy decoding
then continues from that cache, and each answer is scored as RULER scores it (found in the answer or
not). The summary separates the two ways an answer is lost: its value evicted from some head (the
selection dropped it), or held by every head and still not given (the model, or the context around
the needle that went).

Beside the recipes, the dump reads what the question itself selects: in the unmodified model, the
attention of the prompt's last token (the query whose logits give the answer's first token, and the one
TOVA ranks by) per layer and query head, and whether each answer's value is among the tokens it attends
to most, as many as the budget holds (:func:`question_attention`). A value no head so ranks is one no
score read from that query keeps, whatever the selection does with it.

``python -m research.needles full tova_keydiff_chunked --task ruler --split held_out --lengths 1024 --out DIR``
writes ``needles.json`` and ``needles.md``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

import evictlayers as el
from evictlayers.eval.tasks.ruler import TASKS, ruler_samples, sample_score
from research.passkey_needles import held_key_tokens, prefill_then_greedy

__all__ = [
    "NEEDLE_PATTERN", "dump_ruler_prompt", "markdown", "needle_spans", "profile", "question_attention",
    "question_profile", "run_ruler_needles", "summarize_answers", "summarize_question",
]

# niah.NEEDLE with its key and value captured
NEEDLE_PATTERN = re.compile(r"One of the special magic \w+ for (?P<key>.+?) is: (?P<value>\S+?)\.")


def needle_spans(tokenizer, text: str, ids: Sequence[int], answers: Sequence[str], chat: bool) -> list[dict]:
    """Per answer: ``{"answer", "key", "key_tokens", "value_tokens"}``, the token indices of ``ids`` (the
    prompt's tokens, as :func:`~evictlayers.eval.tasks.ruler.prompt.count_tokens` makes them) that overlap
    the key and the value of the needle whose value is the answer.

    Raises:
        ValueError: the tokenizer does not give ``ids`` for ``text``, or an answer is not the value of
            exactly one needle in the text (a task whose answers are not needle values: vt, cwe, fwe).
    """
    encoded = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)
    if list(encoded["input_ids"]) != list(ids):
        raise ValueError("the tokenizer's offsets do not describe the prompt's tokens (its ids differ)")
    offsets = encoded["offset_mapping"]

    def covering(start: int, end: int) -> list[int]:
        return [i for i, (a, b) in enumerate(offsets) if a < end and b > start]

    needles = list(NEEDLE_PATTERN.finditer(text))
    spans = []
    for answer in answers:
        found = [m for m in needles if m.group("value") == answer]
        if len(found) != 1:
            raise ValueError(f"answer {answer!r} is the value of {len(found)} needles in the prompt, not one: "
                             "needle dumps need RULER's niah_* tasks")
        m = found[0]
        spans.append({"answer": answer, "key": m.group("key"), "key_tokens": covering(*m.span("key")),
                      "value_tokens": covering(*m.span("value"))})
    return spans


def question_attention(model, ids: torch.Tensor, spans: Sequence[dict], top: int) -> list[dict]:
    """Per answer of ``spans`` (:func:`needle_spans`): what the last token of the prompt ``ids`` ``[1, n]``
    attends to in the unmodified model, per layer and query head: ``value_mass`` ``[L][H]``, its attention
    on the value's tokens, and ``value_ranked`` ``[L][H]``, how many of them are among the ``top`` tokens
    it attends to most (attention > 0: the tokens a sliding-window layer does not see are never ranked).

    The prompt but its last token goes through the model's own attention and cache; the last token alone
    through eager attention, which returns its weights (``output_attentions``), so nothing ``n x n`` is
    held. ``model`` must not be patched by :func:`evictlayers.apply`."""
    if top < 1:
        raise ValueError(f"question_attention(top={top}): top must be >= 1 tokens")
    previous = model.config._attn_implementation
    with torch.inference_mode():
        past = model(input_ids=ids[:, :-1], use_cache=True).past_key_values
        model.set_attn_implementation("eager")
        try:
            attentions = model(input_ids=ids[:, -1:], past_key_values=past, output_attentions=True).attentions
        finally:
            model.set_attn_implementation(previous)
    n = ids.shape[1]
    rows, ranked = [], []  # [L] of [H, n]: each head's attention, and the tokens it ranks within its top
    for weights in attentions:
        # a sliding-window layer's cache holds only its newest tokens: its columns are the prompt's last ones
        seen = weights[0, :, -1].float()
        row = seen.new_zeros(seen.shape[0], n)
        row[:, n - seen.shape[-1]:] = seen
        values, indices = row.topk(min(top, n), dim=-1)
        rows.append(row)
        ranked.append(torch.zeros_like(row, dtype=torch.bool).scatter_(-1, indices, values > 0))
    answers = []
    for span in spans:
        value = torch.tensor(span["value_tokens"])
        answers.append({
            "value_mass": [[round(m, 4) for m in row[:, value].sum(-1).tolist()] for row in rows],
            "value_ranked": [r[:, value].sum(-1).tolist() for r in ranked],
        })
    return answers


def dump_ruler_prompt(model, tokenizer, policy: el.Policy, sample, chat: bool,
                      question: Sequence[dict] | None = None) -> dict:
    """One RULER sample under ``policy``: per answer, its key's and value's tokens held per layer and KV
    head after the prompt, and whether the greedy answer (at most the sample's ``max_new_tokens``,
    stopping at the end-of-sequence token) contains it. With ``question`` (:func:`question_attention`'s
    answers for the sample), each answer also says whether some query head ranks its whole value
    (``question_whole``)."""
    spans = needle_spans(tokenizer, sample.text, sample.input_ids, sample.answers, chat)
    generated, held = prefill_then_greedy(
        model, policy, torch.tensor([list(sample.input_ids)]), sample.max_new_tokens,
        lambda cache: [(held_key_tokens(cache, s["key_tokens"]), held_key_tokens(cache, s["value_tokens"])) for s in spans],
        eos=tokenizer.eos_token_id, tokenizer=tokenizer,
    )
    text = tokenizer.decode(generated, skip_special_tokens=True)
    answers = []
    for s, (key_held, value_held) in zip(spans, held):
        answers.append({
            "answer": s["answer"], "key": s["key"], "depth": s["value_tokens"][0] / len(sample.input_ids),
            "key_tokens": len(s["key_tokens"]), "value_tokens": len(s["value_tokens"]),
            "key_held": key_held, "value_held": value_held, "found": bool(sample_score(text, [s["answer"]])),
        })
    if question is not None:
        for answer, q in zip(answers, question, strict=True):
            answer["question_whole"] = _ranked_whole(q["value_ranked"], answer["value_tokens"])
    return {"task": sample.task, "length": sample.length, "sample": sample.index,
            "prompt_tokens": len(sample.input_ids), "generated": text, "answers": answers}


def _ranked_whole(ranked: list[list[int]], tokens: int) -> bool:
    """Some layer's query head ranks all ``tokens`` of the value within its top."""
    return any(c == tokens for layer in ranked for c in layer)


def _whole(held: list[list[int]], tokens: int) -> bool:
    """Every layer's every KV head holds all ``tokens`` of the span."""
    return all(c == tokens for layer in held for c in layer)


def _whole_shares(answers: Sequence[dict], field: str) -> tuple[float | None, list[float]]:
    """Over every (answer, layer, head) count ``[L][H]`` in ``field``: the share that is the answer's whole
    value (``value_tokens``), and that share per layer."""
    pairs = [c == a["value_tokens"] for a in answers for layer in a[field] for c in layer]
    layers = len(answers[0][field]) if answers else 0
    per_layer = []
    for i in range(layers):
        heads = [c == a["value_tokens"] for a in answers for c in a[field][i]]
        per_layer.append(sum(heads) / len(heads))
    return (sum(pairs) / len(pairs) if pairs else None), per_layer


def summarize_answers(records: Sequence[dict]) -> dict:
    """Over every answer of ``records``: how many there are and were found; how many had their value
    (and their key) held whole by every layer and KV head; the share of heads holding the whole value;
    found among the answers held whole and among those evicted somewhere; per layer, the share of
    (answer, head) pairs holding the whole value."""
    answers = [a for r in records for a in r["answers"]]
    whole, cut = [], []
    for a in answers:
        (whole if _whole(a["value_held"], a["value_tokens"]) else cut).append(a)
    share, per_layer = _whole_shares(answers, "value_held")
    return {
        "answers": len(answers),
        "found": sum(a["found"] for a in answers),
        "value_whole": len(whole),
        "key_and_value_whole": sum(_whole(a["key_held"], a["key_tokens"]) for a in whole),
        "value_head_share": share,
        "found_when_whole": (sum(a["found"] for a in whole), len(whole)),
        "found_when_cut": (sum(a["found"] for a in cut), len(cut)),
        # of the answers cut somewhere, those whose whole value some query head of the question ranks
        "cut_question_whole": (sum(a.get("question_whole", False) for a in cut), len(cut)),
        "value_whole_per_layer": per_layer,
    }


def summarize_question(answers: Sequence[dict]) -> dict:
    """Over :func:`question_attention`'s ``answers`` (each with its ``value_tokens`` count): how many
    there are; how many some (layer, query head) ranks whole; the share of (layer, head) pairs ranking
    the whole value; per layer, the share of (answer, head) pairs that do; the mean over answers of the
    largest attention one head gives the value."""
    share, per_layer = _whole_shares(answers, "value_ranked")
    return {
        "answers": len(answers),
        "whole_somewhere": sum(_ranked_whole(a["value_ranked"], a["value_tokens"]) for a in answers),
        "head_share": share,
        "largest_mass": sum(max(m for layer in a["value_mass"] for m in layer) for a in answers) / len(answers)
        if answers else None,
        "whole_per_layer": per_layer,
    }


def run_ruler_needles(model, tokenizer, recipes: Sequence[str], budget: float | int | None, task, command: str = "") -> dict:
    """Dump every recipe (shipped name or YAML path) at ``budget`` over the prompts of ``task`` (a
    :class:`~evictlayers.eval.suite.RulerTask`: its tasks, lengths, samples, split, books and seed; its
    tasks must all be ``niah_*``)."""
    from evictlayers.eval.runner import resolve_recipe

    others = [t for t in task.tasks if TASKS[t].family != "niah"]
    if others:
        raise ValueError(f"needle dumps need tasks whose answers are needle values: {', '.join(others)} are not "
                         "(--ruler-tasks); allowed: niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, "
                         "niah_multiquery")
    samples = [s for length in task.lengths for name in task.tasks
               for s in ruler_samples(tokenizer, name, length, task.samples, task.seed, task.chat, task.books,
                                      task.max_new_tokens)]
    question = []  # per sample, what its last token ranks within the budget (recipe-independent)
    for s in samples:
        spans = needle_spans(tokenizer, s.text, s.input_ids, s.answers, task.chat)
        top = int(el.Policy(budget=budget).resolve_budget(torch.tensor([len(s.input_ids)]))[0])
        answers = question_attention(model, torch.tensor([list(s.input_ids)]), spans, top)
        for answer, span in zip(answers, spans):
            answer.update(answer=span["answer"], value_tokens=len(span["value_tokens"]))
        question.append({"task": s.task, "length": s.length, "sample": s.index, "top": top, "answers": answers})
    records, summary = {}, {}
    for recipe in recipes:
        spec = resolve_recipe(recipe)
        policy = spec.policy if spec.is_full else spec.policy.replace(budget=budget)
        records[spec.name] = [dump_ruler_prompt(model, tokenizer, policy, s, task.chat, q["answers"])
                              for s, q in zip(samples, question)]
        summary[spec.name] = {"all": summarize_answers(records[spec.name])}
        for name in task.tasks:
            summary[spec.name][name] = summarize_answers([r for r in records[spec.name] if r["task"] == name])
    question_summary = {"all": summarize_question([a for q in question for a in q["answers"]])}
    for name in task.tasks:
        question_summary[name] = summarize_question([a for q in question if q["task"] == name for a in q["answers"]])
    return {
        "command": command,
        "settings": {"task": "ruler", "tasks": task.tasks, "lengths": task.lengths, "samples": task.samples,
                     "split": task.split, "seed": task.seed, "chat": task.chat, "budget": budget},
        "summary": summary,
        "question_summary": question_summary,
        "records": records,
        "question": question,
    }


def question_profile(ranked: list[list[int]], tokens: int) -> str:
    """One character per layer: ``#`` some query head ranks all ``tokens`` within its top, ``+`` some rank
    part of them, ``.`` none."""
    return "".join("#" if any(c == tokens for c in layer) else "+" if any(layer) else "." for layer in ranked)


def ranking_layers(shares: list[float]) -> list[int]:
    """The layers whose share of query heads ranking an answer's value whole is at least half the largest
    share (``[]`` when no head ranks one): the ranking layers to try in ``CrossLayer(layers=...)``."""
    top = max(shares, default=0.0)
    return [layer for layer, share in enumerate(shares) if top > 0 and share >= top / 2]


def profile(held: list[list[int]], tokens: int) -> str:
    """One character per layer: ``#`` every KV head holds all ``tokens``, ``+`` some are held, ``.`` none."""
    return "".join("#" if all(c == tokens for c in layer) else "+" if any(layer) else "." for layer in held)


def markdown(payload: dict) -> str:
    """The summary per recipe and task, the per-layer shares, then per prompt and answer what was held."""
    s = payload["settings"]
    split = f", {s['split']} split" if s["split"] else f", seed {s['seed']}"
    lines = [
        f"# RULER needle dump ({', '.join(s['tasks'])}; {s['samples']} prompts per task and length, lengths "
        f"{', '.join(map(str, s['lengths']))}{split}, budget {s['budget']})",
        "",
        "Per recipe and task, over the answers: found in the greedy answer; value held whole by every layer and "
        "KV head after the prompt (and its key too); the share of heads holding the whole value; found among the "
        "answers held whole and among those evicted from some head; of those evicted, the ones whose whole value "
        "some query head of the question ranks within the budget (below). "
        f"Rerun: `{payload['command']}`.",
        "",
        "| recipe | task | found | value whole everywhere | key too | heads with the whole value | found when whole "
        "| found when cut | cut, yet the question ranks it whole |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def ratio(pair):
        return f"{pair[0]}/{pair[1]}" if pair[1] else "-"

    for name, by_task in payload["summary"].items():
        for task, r in by_task.items():
            share = "-" if r["value_head_share"] is None else f"{100 * r['value_head_share']:.0f}%"
            lines.append(
                f"| {name} | {task} | {r['found']}/{r['answers']} | {r['value_whole']}/{r['answers']} "
                f"| {r['key_and_value_whole']}/{r['answers']} | {share} | {ratio(r['found_when_whole'])} "
                f"| {ratio(r['found_when_cut'])} | {ratio(r['cut_question_whole'])} |"
            )
    lines += [
        "", "## What the question's attention selects", "",
        "The unmodified model's attention from the prompt's last token (the query whose logits give the answer's "
        "first token; TOVA's ranking), per layer and query head: an answer's value is ranked when all its tokens "
        f"are among the tokens that head attends to most, as many as the budget ({s['budget']}) holds. Per task: the "
        "answers some head ranks whole; the share of (layer, query head) pairs that do; the largest attention one "
        "head gives the value, averaged over the answers.", "",
        "| task | answers | ranked whole by some head | heads ranking it whole | largest attention on the value |",
        "|---|---|---|---|---|",
    ]
    for task, r in payload["question_summary"].items():
        share = "-" if r["head_share"] is None else f"{100 * r['head_share']:.1f}%"
        mass = "-" if r["largest_mass"] is None else f"{r['largest_mass']:.3f}"
        lines.append(f"| {task} | {r['answers']} | {r['whole_somewhere']}/{r['answers']} | {share} | {mass} |")
    per_layer = payload["question_summary"]["all"]["whole_per_layer"]
    lines += ["", "Share of query heads ranking the whole value, per layer, % (layer 0 first): "
              + " ".join(f"{round(100 * x)}" for x in per_layer)]
    layers = ranking_layers(per_layer)
    lines += ["", "Layers with at least half the largest share (ranking layers to try, on a tuning split only): "
              + (f"`CrossLayer(layers={layers})`" if layers else
                 "none: no query head ranks an answer's whole value, so no score read from the question's last "
                 "token keeps these values whole")]
    lines += ["", "Per prompt and answer, one character per layer (layer 0 first): `#` some query head ranks the whole "
              "value, `+` part of it, `.` none:", ""]
    for q in payload["question"]:
        lines.append(f"- {q['task']} {q['length']} #{q['sample']} (top {q['top']} tokens)")
        lines += [f"  - {a['answer']}: `{question_profile(a['value_ranked'], a['value_tokens'])}`" for a in q["answers"]]
    lines += ["", "## What each recipe holds", "", "Whole-value share per layer, % (layer 0 first):", ""]
    for name, by_task in payload["summary"].items():
        lines.append(f"- `{name}`: " + " ".join(f"{round(100 * x)}" for x in by_task["all"]["value_whole_per_layer"]))
    lines += ["", "Per prompt and answer, one character per layer (layer 0 first) for the value and for the key: `#` "
              "every KV head holds all its tokens, `+` some are held, `.` none; the answer found (+) or not (-):", ""]
    for name, records in payload["records"].items():
        lines += [f"`{name}`:", ""]
        for r in records:
            lines.append(f"- {r['task']} {r['length']} #{r['sample']}: {r['generated'].strip()[:40]!r}")
            for a in r["answers"]:
                lines.append(f"  - {'+' if a['found'] else '-'} {a['answer']} (depth {a['depth']:.2f}, {a['value_tokens']} "
                             f"tokens): value `{profile(a['value_held'], a['value_tokens'])}` key "
                             f"`{profile(a['key_held'], a['key_tokens'])}`")
        lines.append("")
    return "\n".join(lines)
