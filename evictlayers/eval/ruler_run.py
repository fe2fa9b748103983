"""Running RULER prompts under a policy in kvpress's two settings, and RULER's summary of the answers.

``query_aware``: the whole prompt (context, question, answer prefix) is one prefill, so the policy
chooses what to keep having seen the question; then greedy decoding (``model.generate``).

``query_agnostic``: the context alone is prefilled first, so the cache is compressed without the
question (a document compressed once, then asked); then the question, the end of the chat template
and the answer prefix go through the same eviction cache as one more chunk, and greedy decoding
continues (``model.generate`` from the filled cache). A fractional budget is then a fraction of the
context (the first forward), as kvpress's compression ratio applies to the context; the cache stays
bounded while the question and the answer go in.

``prefill_chunk=N`` feeds the prompt (query-agnostic: the context, then the question) ``N`` tokens per
forward, so that it holds at most ``budget + N`` tokens per head; a fractional budget stays a fraction of
the whole prompt (context).

With a full cache both settings compute the same attention over the same tokens, so they produce the
unmodified model's greedy tokens.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence

import torch

import evictlayers as el
from evictlayers.eval.compressed import reconstruction_cache
from evictlayers.eval.tasks.ruler import GROUPS, TASKS, group_of
from evictlayers.eval.tasks.ruler.scoring import METRICS

__all__ = ["SETTINGS", "generate_query_agnostic", "generate_query_aware", "summarize_ruler"]

SETTINGS = ("query_aware", "query_agnostic")


def _left_pad(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[b, width - len(row) :] = 1
    return ids, mask


def generate_query_aware(model, policy: el.Policy, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         pad_token_id: int, compile: bool = False, tokenizer=None, prefill_chunk: int | None = None):
    """Greedy continuations of left-padded ``prompts`` under ``policy``, each prompt one prefill, in forwards
    of ``prefill_chunk`` tokens where given (``tokenizer``: for a policy that ranks sentences, see
    ``evictlayers.apply``).

    Returns ``(new token ids per row [B, <= max_new_tokens], cache, stats, seconds)``.
    """
    ids, mask = _left_pad(prompts, pad_token_id)
    start = time.perf_counter()
    with torch.inference_mode(), el.apply(model, policy, compile=compile, tokenizer=tokenizer) as run:
        cache = reconstruction_cache(run, ids, mask, prefill_chunk)  # KVzip compresses the prompt first
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad_token_id, prefill_chunk_size=prefill_chunk, past_key_values=cache)
        cache, stats = run.cache, run.stats()
    return out[:, ids.shape[1] :], cache, stats, time.perf_counter() - start


def generate_query_agnostic(model, policy: el.Policy, prompt: Sequence[int], n_context: int, max_new_tokens: int,
                            pad_token_id: int, compile: bool = False, tokenizer=None,
                            prefill_chunk: int | None = None):
    """Greedy continuation of one prompt whose first ``n_context`` tokens are prefilled (and compressed)
    before the rest is seen, both parts in forwards of ``prefill_chunk`` tokens where given. Returns
    ``(new token ids [1, <= max_new_tokens], cache, stats, seconds)``."""
    if not 0 < n_context < len(prompt):
        raise ValueError(f"n_context must split the prompt (0 < n_context < {len(prompt)}), got {n_context}")
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    start = time.perf_counter()
    with torch.inference_mode(), el.apply(model, policy, compile=compile, tokenizer=tokenizer) as run:
        context, context_mask = ids[:, :n_context], torch.ones(1, n_context, dtype=torch.long)
        if policy.requires_probes:  # KVzip: the context compressed by reconstructing it
            cache = run.compress_context(context, context_mask, prefill_chunk=prefill_chunk)
        else:
            cache = run.new_cache()
            if prefill_chunk is None:
                model(input_ids=context, attention_mask=context_mask, past_key_values=cache, use_cache=True)
            else:
                run.prefill(context, context_mask, chunk=prefill_chunk, cache=cache)
        # generate() feeds only the tokens the cache has not seen: the question, then the answer
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id,
                             prefill_chunk_size=prefill_chunk)
        stats = run.stats()
    return out[:, ids.shape[1] :], cache, stats, time.perf_counter() - start


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _needle_map(records: Sequence[dict], order: dict) -> dict:
    cells: dict[tuple[str, int, int, str], list[dict]] = defaultdict(list)
    for r in records:
        cells[(r["setting"], int(r["depth"]), int(r["length"]), r["task"])].append(r)
    out: dict[str, dict[str, dict[str, dict]]] = {}
    for (setting, depth, length, task), rs in sorted(cells.items(), key=lambda kv: (order[kv[0][0]], *kv[0][1:3],
                                                                                       order[kv[0][3]])):
        metric = METRICS[TASKS[task].metric]
        cell = out.setdefault(setting, {}).setdefault(str(depth), {}).setdefault(str(length), {"n": 0, "by_task": {}})
        cell["by_task"][task] = metric([r["generated"] for r in rs], [r["answers"] for r in rs])
        cell["n"] += len(rs)
    for by_depth in out.values():
        for by_length in by_depth.values():
            for length, cell in by_length.items():
                by_length[length] = {"score": _mean(cell["by_task"].values()), **cell}
    return out


def summarize_ruler(records: Sequence[dict]) -> dict:
    """RULER's scores from per-sample records (``setting``, ``length``, ``task``, ``generated``, ``answers``).

    ``scores[setting][length][task]`` is RULER's task score (``string_match_all`` over the samples,
    0-100); ``by_task``, ``by_group`` (RULER's categories) and ``by_setting`` average those cells, and
    ``score`` averages all of them (RULER's average, over the synthetic tasks).

    Where the records have a needle ``depth`` (``--ruler-depths``), also ``needle_map[setting][depth][length]``
    (string keys): ``{"score", "n", "by_task"}``, the task scores of that depth and length (each RULER's
    score over the cell's prompts) and their mean, and how many prompts the cell holds.
    """
    cells: dict[tuple[str, int, str], list[dict]] = defaultdict(list)
    for r in records:
        cells[(r["setting"], int(r["length"]), r["task"])].append(r)
    scores: dict[str, dict[str, dict[str, float]]] = {}
    order = {name: i for i, name in enumerate([*SETTINGS, *TASKS])}
    for (setting, length, task), rs in sorted(cells.items(), key=lambda kv: (order[kv[0][0]], kv[0][1], order[kv[0][2]])):
        metric = METRICS[TASKS[task].metric]
        score = metric([r["generated"] for r in rs], [r["answers"] for r in rs])
        scores.setdefault(setting, {}).setdefault(str(length), {})[task] = score
    flat = [(s, length, t, v) for s, by_len in scores.items() for length, by_task in by_len.items()
            for t, v in by_task.items()]
    needle = {}
    if any(r.get("depth") is not None for r in records):
        needle = {"needle_map": _needle_map([r for r in records if r.get("depth") is not None], order)}
    return {
        **needle,
        "score": _mean(v for *_, v in flat),
        "scores": scores,
        "by_setting": {s: _mean(v for s2, _, _, v in flat if s2 == s) for s in scores},
        "by_task": {t: _mean(v for _, _, t2, v in flat if t2 == t) for t in TASKS if any(f[2] == t for f in flat)},
        "by_group": {g: _mean(v for _, _, t, v in flat if group_of(t) == g) for g in GROUPS
                     if any(group_of(f[2]) == g for f in flat)},
        "by_length": {length: _mean(v for _, l2, _, v in flat if l2 == length)
                      for length in sorted({f[1] for f in flat}, key=int)},
    }
