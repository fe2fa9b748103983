"""The evaluation tasks as the Lightning loop runs them: a ``datasets.Dataset`` of examples, a collate
function, how one batch is run under one policy, and how per-example records merge into a score.

Five tasks (:data:`TASKS`):

``passkey``
    a 5-digit key hidden at a controlled depth in filler (:mod:`evictlayers.eval.tasks.passkey`), over
    a grid of lengths x depths; greedy generation; score = accuracy.
``lines``
    LongEval-style line retrieval (:mod:`evictlayers.eval.tasks.lines`); greedy generation;
    score = accuracy.
``perplexity``
    streamed teacher-forced perplexity on long documents (:mod:`evictlayers.eval.tasks.documents`):
    the document goes through the eviction cache ``chunk`` tokens at a time (default 1, i.e. eviction
    active at every step, as H2O Sec. 5.3 Q1 and Scissorhands Table 3); score = perplexity.
``agreement``
    the same stream, compared position by position with the unmodified model's next-token
    distributions on the same text (one teacher-forced pass, full attention): score = top-1
    agreement, also ``kl`` = mean KL(full || evicted) in nats, and the perplexity.
``ruler``
    RULER's synthetic tasks (Hsieh et al. 2024; :mod:`evictlayers.eval.tasks.ruler`), generated
    offline at any length, run query-aware or query-agnostic (:mod:`evictlayers.eval.ruler_run`);
    greedy generation; score = RULER's string-match score, 0-100, averaged over tasks.

Budgets: generation tasks pass the policy as it is (an ``int`` is tokens per head, a ``float`` a
fraction of each prompt). A stream's first forward is one chunk, so a ``float`` budget is turned into
``round(budget * tokens streamed)`` tokens per head before the stream starts.
A generation task's ``prefill_chunk=N`` feeds each prompt ``N`` tokens at a time
(``generate(prefill_chunk_size=N)``), still resolving a ``float`` budget from the whole prompt.

Every run also reports retained KV bytes, the fraction of KV slots kept, tokens/s, and the histogram of
retained original positions (:func:`evictlayers.eval.metrics.position_histogram`).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Sequence

import torch

import evictlayers as el
from evictlayers.eval.metrics import cache_rows, histogram_evenness, merge_histograms, position_histogram
from evictlayers.eval.tasks.documents import document_windows, read_texts
from evictlayers.eval.tasks.lines import lines_prompts, parse_record, score_lines
from evictlayers.eval.tasks.passkey import HAYSTACKS, passkey_grid, score_passkey
from evictlayers.eval.protocol import split_books, split_seed, split_tasks
from evictlayers.eval.compressed import reconstruction_cache
from evictlayers.eval.ruler_run import SETTINGS, generate_query_agnostic, generate_query_aware, summarize_ruler
from evictlayers.eval.tasks.ruler import (
    LEFT_OUT, SINGLE_NEEDLE, Books, check_depths, group_of, postprocess, ruler_samples, sample_score, use_chat,
)
from evictlayers.eval.tasks.ruler import TASKS as RULER_TASKS

__all__ = [
    "TASKS", "AgreementTask", "EvalTask", "LinesTask", "PasskeyTask", "PerplexityTask", "RulerTask", "make_task",
]


class EvalTask:
    """Base class: subclasses define ``rows``, ``run`` and ``summarize``."""

    name = "task"
    score_name = "score"
    higher_is_better = True
    compile = False  # run each policy's decode step compiled (``evictlayers.apply(..., compile=True)``)

    def __init__(self, tokenizer, n_bins: int = 20):
        if n_bins < 1:
            raise ValueError(f"n_bins must be >= 1, got {n_bins}")
        self.tokenizer = tokenizer
        self.n_bins = n_bins
        self._rows: list[dict] | None = None

    # ---- data ----------------------------------------------------------------------------------

    def build_rows(self) -> list[dict]:
        raise NotImplementedError

    def rows(self) -> list[dict]:
        """The examples, each with an ``index`` (its position; used to merge shards)."""
        if self._rows is None:
            self._rows = [{"index": i, **row} for i, row in enumerate(self.build_rows())]
        return self._rows

    def dataset(self):
        """The examples as a ``datasets.Dataset``."""
        import datasets

        return datasets.Dataset.from_list(self.rows())

    def settings(self) -> dict:
        """The task's parameters, for the results file."""
        return {"n_bins": self.n_bins}

    def collate(self, rows: list[dict]) -> dict:
        raise NotImplementedError

    # ---- running -------------------------------------------------------------------------------

    def check_model(self, model) -> None:
        """Raise ``ValueError`` if ``model`` cannot run this task (checked before any example runs)."""

    def prepare(self, model, batch: dict):
        """Work shared by every policy on this batch (e.g. reference logits); ``None`` by default."""
        return None

    def run(self, model, policy: el.Policy, batch: dict, shared) -> list[dict]:
        raise NotImplementedError

    def summarize(self, records: Sequence[dict]) -> dict:
        raise NotImplementedError

    # ---- shared pieces -------------------------------------------------------------------------

    def _memory_records(self, cache, stats: dict, batch_size: int, seconds: float) -> list[dict]:
        histogram = position_histogram(cache, self.n_bins)
        rows = cache_rows(cache)
        return [
            {
                **rows[b],
                "histogram": histogram[b].tolist(),
                "kv_bytes": stats["kv_bytes"] / batch_size,
                # a ClusterSketch's buffers, beside the slots (compare memory with both)
                "sketch_bytes": stats.get("sketch_bytes", 0) / batch_size,
                "seconds": seconds / batch_size,
            }
            for b in range(batch_size)
        ]

    @staticmethod
    def _common_summary(records: Sequence[dict]) -> dict:
        tokens = sum(r["tokens"] for r in records)
        seconds = sum(r["seconds"] for r in records)
        histogram = merge_histograms(r["histogram"] for r in records)
        budgets = [r["budget_tokens"] for r in records]
        return {
            "n": len(records),
            "kv_bytes": sum(r["kv_bytes"] for r in records) / len(records),
            "sketch_bytes": sum(r.get("sketch_bytes", 0) for r in records) / len(records),
            "kept_fraction": sum(r["retained_slots"] for r in records) / sum(r["full_slots"] for r in records),
            "budget_tokens": None if any(b is None for b in budgets) else sum(budgets) / len(budgets),
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
            "histogram": histogram,
            "evenness": histogram_evenness(histogram),
        }


# ---- generation tasks --------------------------------------------------------------------------


def checked_prefill_chunk(prefill_chunk: int | None) -> int | None:
    """A generation task's ``prefill_chunk``: ``None`` (each prompt in one forward) or the tokens per prompt
    forward (``generate(prefill_chunk_size=N)``), a positive ``int``."""
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk (--prefill-chunk) must be a positive number of tokens, "
                         f"got {prefill_chunk!r}")
    return prefill_chunk


class _GenerationTask(EvalTask):
    score_name = "accuracy"
    higher_is_better = True

    def __init__(self, tokenizer, max_new_tokens: int = 8, n_bins: int = 20, prefill_chunk: int | None = None):
        super().__init__(tokenizer, n_bins)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.max_new_tokens = max_new_tokens
        self.prefill_chunk = checked_prefill_chunk(prefill_chunk)
        if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"  # generation continues every row at the right edge

    def settings(self) -> dict:
        return {**super().settings(), "max_new_tokens": self.max_new_tokens, "prefill_chunk": self.prefill_chunk}

    def collate(self, rows: list[dict]) -> dict:
        encoded = self.tokenizer([r["text"] for r in rows], return_tensors="pt", padding=True)
        meta = [{k: v for k, v in r.items() if k != "text"} for r in rows]
        return {"rows": meta, "input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    def score(self, generated: str, row: dict) -> bool:
        raise NotImplementedError

    def run(self, model, policy: el.Policy, batch: dict, shared) -> list[dict]:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        steps = self.max_new_tokens
        start = time.perf_counter()
        with el.apply(model, policy, compile=self.compile, tokenizer=self.tokenizer) as run:
            cache = reconstruction_cache(run, ids, mask, self.prefill_chunk)  # KVzip compresses the prompt first
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id, prefill_chunk_size=self.prefill_chunk, past_key_values=cache,
            )
            cache, stats = run.cache, run.stats()
        seconds = time.perf_counter() - start
        texts = self.tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
        memory = self._memory_records(cache, stats, ids.shape[0], seconds)
        records = []
        for b, row in enumerate(batch["rows"]):
            prompt_tokens = int(mask[b].sum())
            records.append(
                {
                    **row,
                    **memory[b],
                    "generated": texts[b],
                    "correct": bool(self.score(texts[b], row)),
                    "prompt_tokens": prompt_tokens,
                    "tokens": prompt_tokens + steps,
                }
            )
        return records

    def summarize(self, records: Sequence[dict]) -> dict:
        correct = sum(r["correct"] for r in records)
        by_depth: dict[float, list[bool]] = defaultdict(list)
        for r in records:
            by_depth[round(float(r["depth"]), 3)].append(r["correct"])
        return {
            "score": correct / len(records),
            "correct": correct,
            "by_depth": {str(d): sum(v) / len(v) for d, v in sorted(by_depth.items())},
            "prompt_tokens": sum(r["prompt_tokens"] for r in records) / len(records),
            "prefill_chunk": self.prefill_chunk,
            **self._common_summary(records),
        }


class PasskeyTask(_GenerationTask):
    """Passkey retrieval over a grid of prompt lengths x key depths."""

    name = "passkey"

    def __init__(
        self,
        tokenizer,
        lengths: Sequence[int] = (1000,),
        depths: Sequence[float] | int = 8,
        per_cell: int = 1,
        seed: int = 0,
        max_new_tokens: int = 8,
        n_bins: int = 20,
        haystack: str = "filler",
        chat: bool = False,
        data=None,
        prefill_chunk: int | None = None,
    ):
        super().__init__(tokenizer, max_new_tokens, n_bins, prefill_chunk)
        if haystack not in HAYSTACKS:
            raise ValueError(f"passkey haystack={haystack!r}: expected one of {HAYSTACKS}")
        if data is not None and haystack != "prose":
            raise ValueError("passkey data (--data-dir) is the prose haystack's books: it needs haystack='prose'")
        self.haystack, self.chat = haystack, chat
        # the books are read here so that a missing data directory fails before any model runs
        self.texts = read_texts(data) if haystack == "prose" else None
        self.sources = [name for name, _ in self.texts] if self.texts else []
        if isinstance(depths, int):
            if depths < 1:
                raise ValueError(f"depths must be >= 1 (a number of evenly spaced depths) or a list, got {depths}")
            depths = [0.5] if depths == 1 else [i / (depths - 1) for i in range(depths)]
        self.lengths = [int(n) for n in lengths]
        self.depths = [float(d) for d in depths]
        if not self.lengths or not self.depths:
            raise ValueError("passkey needs at least one length and one depth")
        bad = [d for d in self.depths if not 0.0 <= d <= 1.0]
        if bad:
            raise ValueError(f"passkey depths must be fractions in [0, 1], got {bad}")
        self.per_cell, self.seed = per_cell, seed

    def settings(self) -> dict:
        return {**super().settings(), "lengths": self.lengths, "depths": self.depths, "per_cell": self.per_cell,
                "seed": self.seed, "haystack": self.haystack, "chat": self.chat, "sources": self.sources}

    def build_rows(self) -> list[dict]:
        grid = passkey_grid(self.tokenizer, self.lengths, self.depths, per_cell=self.per_cell, seed=self.seed,
                            chat=self.chat, haystack=self.haystack, texts=self.texts)
        return [
            {"text": p.text, "answer": p.answer, "depth": p.depth, "length": length, "n_tokens": p.n_tokens}
            for (length, _), prompts in grid.items()
            for p in prompts
        ]

    def score(self, generated: str, row: dict) -> bool:
        return score_passkey(generated, row["answer"])

    def summarize(self, records: Sequence[dict]) -> dict:
        by_length: dict[int, list[bool]] = defaultdict(list)
        for r in records:
            by_length[int(r["length"])].append(r["correct"])
        return {
            **super().summarize(records),
            "by_length": {str(n): sum(v) / len(v) for n, v in sorted(by_length.items())},
        }


class LinesTask(_GenerationTask):
    """LongEval-style line retrieval (ClusterGen Table 2)."""

    name = "lines"

    def __init__(
        self,
        tokenizer,
        n_prompts: int = 16,
        n_lines: int = 20,
        seed: int = 0,
        max_new_tokens: int = 8,
        n_bins: int = 20,
        prefill_chunk: int | None = None,
    ):
        super().__init__(tokenizer, max_new_tokens, n_bins, prefill_chunk)
        self.n_prompts, self.n_lines, self.seed = n_prompts, n_lines, seed
        lines_prompts(tokenizer, n_prompts=1, n_lines=n_lines)  # validate the sizes now

    def settings(self) -> dict:
        return {**super().settings(), "n_prompts": self.n_prompts, "n_lines": self.n_lines, "seed": self.seed}

    def build_rows(self) -> list[dict]:
        prompts = lines_prompts(self.tokenizer, n_prompts=self.n_prompts, n_lines=self.n_lines, seed=self.seed)
        return [
            {"text": p.text, "answer": p.answer, "name": p.name, "line": p.line, "n_lines": p.n_lines,
             "depth": p.depth, "n_tokens": p.n_tokens, "record_values": sorted(set(parse_record(p.text).values()))}
            for p in prompts
        ]

    def score(self, generated: str, row: dict) -> bool:
        return score_lines(generated, row["answer"])

    def summarize(self, records: Sequence[dict]) -> dict:
        """Adds ``in_record``: the share of answers whose first number is the value of *some* line of
        the record (right or wrong line): a 135M model often picks the wrong line, but an answer that
        is no record value at all means the numbers did not survive."""
        hits = sum(any(score_lines(r["generated"], v) for v in r["record_values"]) for r in records)
        return {**super().summarize(records), "in_record": hits / len(records)}


# ---- streamed tasks ----------------------------------------------------------------------------


class PerplexityTask(EvalTask):
    """Streamed teacher-forced perplexity on token windows of long documents."""

    name = "perplexity"
    score_name = "perplexity"
    higher_is_better = False
    agreement = False

    def __init__(
        self,
        tokenizer,
        data=None,
        n_docs: int = 4,
        doc_tokens: int = 1025,
        start: float = 0.1,
        chunk: int = 1,
        split: str | None = None,
        n_bins: int = 20,
    ):
        super().__init__(tokenizer, n_bins)
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1 token, got {chunk}")
        self.texts = read_texts(data)  # fails early, with the directory, when the data is missing
        if split is not None:  # the protocol's books (evictlayers.eval.protocol)
            self.texts = split_books(self.texts, split)
        self.split = split
        self.n_docs, self.doc_tokens, self.start, self.chunk = n_docs, doc_tokens, start, chunk

    def settings(self) -> dict:
        return {
            **super().settings(), "sources": [name for name, _ in self.texts], "n_docs": self.n_docs,
            "doc_tokens": self.doc_tokens, "start": self.start, "chunk": self.chunk, "split": self.split,
        }

    def build_rows(self) -> list[dict]:
        return document_windows(self.tokenizer, self.texts, self.n_docs, self.doc_tokens, self.start)

    def collate(self, rows: list[dict]) -> dict:
        meta = [{k: v for k, v in r.items() if k != "input_ids"} for r in rows]
        return {"rows": meta, "input_ids": torch.tensor([r["input_ids"] for r in rows], dtype=torch.long)}

    @staticmethod
    def stream_policy(policy: el.Policy, tokens: int) -> el.Policy:
        """``policy`` with a ``float`` budget turned into ``round(budget * tokens)`` tokens per head, lifted to the
        policy's ``min_budget`` as a prompt's fraction would be."""
        if not isinstance(policy.budget, float):
            return policy
        return policy.replace(budget=max(policy.min_budget, math.floor(policy.budget * tokens + 0.5)))

    def prepare(self, model, batch: dict):
        if not self.agreement:
            return None
        ids = batch["input_ids"]
        # the reference: the unmodified model (no evictlayers.apply), one teacher-forced pass
        return torch.log_softmax(model(input_ids=ids[:, :-1], use_cache=False).logits.float(), dim=-1)

    def run(self, model, policy: el.Policy, batch: dict, shared) -> list[dict]:
        ids = batch["input_ids"]
        batch_size, length = ids.shape
        n = length - 1  # tokens streamed; each predicts the next one
        policy = self.stream_policy(policy, n)
        nll = torch.zeros(batch_size, dtype=torch.float64)
        kl = torch.zeros(batch_size, dtype=torch.float64)
        agree = torch.zeros(batch_size, dtype=torch.long)
        start = time.perf_counter()
        with el.apply(model, policy, compile=self.compile, tokenizer=self.tokenizer) as run:
            cache = run.new_cache()
            for s in range(0, n, self.chunk):
                e = min(s + self.chunk, n)
                mask = torch.ones(batch_size, e, dtype=torch.long, device=ids.device)
                logits = model(input_ids=ids[:, s:e], attention_mask=mask, past_key_values=cache).logits
                logp = torch.log_softmax(logits.float(), dim=-1)
                nll -= logp.gather(-1, ids[:, s + 1 : e + 1, None]).squeeze(-1).double().sum(1).cpu()
                if shared is not None:
                    ref = shared[:, s:e]
                    kl += (ref.exp() * (ref - logp)).sum(-1).double().sum(1).cpu()
                    agree += (ref.argmax(-1) == logp.argmax(-1)).sum(1).cpu()
            stats = run.stats()
        seconds = time.perf_counter() - start
        memory = self._memory_records(cache, stats, batch_size, seconds)
        records = []
        for b, row in enumerate(batch["rows"]):
            record = {**row, **memory[b], "nll": float(nll[b]), "tokens": n, "perplexity": math.exp(nll[b] / n)}
            if shared is not None:
                record.update(kl=float(kl[b]), agree=int(agree[b]))
            records.append(record)
        return records

    def summarize(self, records: Sequence[dict]) -> dict:
        tokens = sum(r["tokens"] for r in records)
        perplexity = math.exp(sum(r["nll"] for r in records) / tokens)
        summary = {
            "score": perplexity,
            "perplexity": perplexity,
            "per_document": {f"{r['source']}#{r['window']}": r["perplexity"] for r in records},
            **self._common_summary(records),
        }
        if self.agreement:
            summary.update(
                score=sum(r["agree"] for r in records) / tokens,
                top1=sum(r["agree"] for r in records) / tokens,
                kl=sum(r["kl"] for r in records) / tokens,
            )
        return summary


class AgreementTask(PerplexityTask):
    """The perplexity stream compared with the unmodified model: top-1 agreement and KL divergence."""

    name = "agreement"
    score_name = "top-1 agreement"
    higher_is_better = True
    agreement = True


# ---- RULER ----------------------------------------------------------------------------------------


class RulerTask(EvalTask):
    """RULER's synthetic tasks (Hsieh et al. 2024) over ``lengths``, ``samples`` prompts per task and
    length, in one or both of kvpress's settings (``query_aware``, ``query_agnostic``; see
    :mod:`evictlayers.eval.ruler_run`). RULER's QA tasks are left out (their datasets cannot be
    downloaded here); see :mod:`evictlayers.eval.tasks.ruler` for the other deviations.

    Args:
        tasks: RULER task names (default: all eleven synthetic tasks).
        lengths: context lengths in tokens, generation included, as RULER counts them.
        samples: prompts per task and length.
        setting: ``query_aware``, ``query_agnostic``, or a list of both.
        template: ``auto`` (the tokenizer's chat template where it has one), ``chat`` or ``base``.
        seed: the prompts' seed (default 0); a split fixes its own.
        split: ``tuning`` or ``held_out`` (:mod:`evictlayers.eval.protocol`): the split's own books, seed
            and tasks (default: all its tasks; a task outside its families is an error); ``None``: every
            book, ``seed``.
        max_new_tokens: tokens generated per prompt (default: RULER's per task: 128 for NIAH, 30 for
            vt, 120 for cwe, 50 for fwe), also reserved out of the length.
        data: the books for essay haystacks and word lists (default: the PG-19 sample).
        prefill_chunk: feed each prompt (query-agnostic: the context, then the question) through the model
            this many tokens at a time; ``None``: one forward.
        depths: needle depths in percent (0..100) for the single-needle tasks: ``samples`` prompts per
            task, length and depth, the needle at that depth (:func:`~evictlayers.eval.tasks.ruler.ruler_samples`),
            each record with its ``depth`` (the needle heat map, :mod:`evictlayers.eval.needle_map`); the
            tasks default to the (split's) single-needle ones. ``None``: RULER's drawn depths.
    """

    name = "ruler"
    score_name = "RULER score"
    higher_is_better = True

    def __init__(
        self,
        tokenizer,
        tasks: Sequence[str] | None = None,
        lengths: Sequence[int] = (4096,),
        samples: int = 10,
        setting: str | Sequence[str] = "query_aware",
        template: str = "auto",
        seed: int | None = None,
        max_new_tokens: int | None = None,
        data=None,
        split: str | None = None,
        n_bins: int = 20,
        prefill_chunk: int | None = None,
        depths: Sequence[int] | None = None,
    ):
        super().__init__(tokenizer, n_bins)
        self.prefill_chunk = checked_prefill_chunk(prefill_chunk)
        self.tasks = list(RULER_TASKS) if tasks is None else list(dict.fromkeys(tasks))
        unknown = [t for t in self.tasks if t not in RULER_TASKS]
        if unknown or not self.tasks:
            left = [t for t in unknown if t in LEFT_OUT]
            why = f" ({', '.join(left)}: left out, their datasets cannot be downloaded)" if left else ""
            raise ValueError(f"unknown RULER task(s) {unknown}{why} (--ruler-tasks); allowed: {', '.join(RULER_TASKS)}")
        if split is not None:
            seed = split_seed(split, seed)
            self.tasks = split_tasks(split, None if tasks is None else self.tasks)
        self.depths = None if depths is None else check_depths(depths, None if tasks is None else self.tasks)
        if self.depths is not None and tasks is None:
            self.tasks = [t for t in self.tasks if t in SINGLE_NEEDLE]
        self.setting = [setting] if isinstance(setting, str) else list(dict.fromkeys(setting))
        bad = [s for s in self.setting if s not in SETTINGS]
        if bad or not self.setting:
            raise ValueError(f"ruler setting {bad} (--ruler-setting): allowed: {', '.join(SETTINGS)}")
        self.lengths = [int(n) for n in lengths]
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"ruler lengths (--lengths) must be positive token counts, got {self.lengths}")
        if samples < 1:
            raise ValueError(f"ruler samples (--ruler-samples) must be >= 1, got {samples}")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.template, self.chat = template, use_chat(tokenizer, template)
        self.samples, self.seed, self.max_new_tokens, self.split = samples, seed or 0, max_new_tokens, split
        # the books are read here so that a missing data directory fails before any model runs
        texts = read_texts(data) if data is not None or any(RULER_TASKS[t].needs_books for t in self.tasks) else None
        if texts and split is not None:
            texts = split_books(texts, split)
        self.books = Books(texts) if texts else None
        self.sources = [name for name, _ in texts] if texts else []
        if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
            tokenizer.pad_token = tokenizer.eos_token

    def settings(self) -> dict:
        return {**super().settings(), "tasks": self.tasks, "lengths": self.lengths, "samples": self.samples,
                "setting": self.setting, "template": self.template, "chat": self.chat, "seed": self.seed,
                "max_new_tokens": self.max_new_tokens, "sources": self.sources, "split": self.split,
                "prefill_chunk": self.prefill_chunk, **({"depths": self.depths} if self.depths is not None else {})}

    def check_model(self, model) -> None:
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        limit = getattr(config, "max_position_embeddings", None)
        too_long = [n for n in self.lengths if limit is not None and n > limit]
        if too_long:
            raise ValueError(f"ruler lengths {too_long} (--lengths) exceed what the model holds "
                             f"(max_position_embeddings = {limit}); allowed: lengths <= {limit}")

    def build_rows(self) -> list[dict]:
        prompts = [p for length in self.lengths for task in self.tasks for depth in (self.depths or [None])
                   for p in ruler_samples(self.tokenizer, task, length, self.samples, self.seed, self.chat,
                                          self.books, self.max_new_tokens, depth)]
        return [
            {"task": p.task, "group": group_of(p.task), "length": p.length, "sample": p.index, "setting": setting,
             "input_ids": list(p.input_ids), "n_context": p.n_context, "answers": list(p.answers),
             "max_new_tokens": p.max_new_tokens, "n_tokens": p.n_tokens, "haystack": p.haystack,
             **({"depth": p.depth} if p.depth is not None else {})}
            for setting in self.setting for p in prompts
        ]

    def collate(self, rows: list[dict]) -> dict:
        return {"rows": rows}  # padded per setting in run(): the query-agnostic rows run one at a time

    def run(self, model, policy: el.Policy, batch: dict, shared) -> list[dict]:
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        rows = batch["rows"]
        aware = [r for r in rows if r["setting"] == "query_aware"]
        # one batch per generation length (tasks generate different amounts), one run per agnostic row
        groups = [[r for r in aware if r["max_new_tokens"] == n] for n in dict.fromkeys(r["max_new_tokens"] for r in aware)]
        groups += [[r] for r in rows if r["setting"] == "query_agnostic"]
        records = []
        for group in groups:
            steps = group[0]["max_new_tokens"]
            if group[0]["setting"] == "query_aware":
                new, cache, stats, seconds = generate_query_aware(
                    model, policy, [r["input_ids"] for r in group], steps, pad, self.compile, self.tokenizer,
                    self.prefill_chunk)
            else:
                new, cache, stats, seconds = generate_query_agnostic(
                    model, policy, group[0]["input_ids"], group[0]["n_context"], steps, pad, self.compile,
                    self.tokenizer, self.prefill_chunk)
            memory = self._memory_records(cache, stats, len(group), seconds)
            for b, row in enumerate(group):
                tokens = new[b].tolist()
                if eos in tokens:  # what follows a row's end of sequence is padding
                    tokens = tokens[: tokens.index(eos) + 1]
                text = postprocess(self.tokenizer.decode(tokens, skip_special_tokens=True))
                meta = {k: v for k, v in row.items() if k != "input_ids"}
                records.append({**meta, **memory[b], "generated": text, "score": sample_score(text, row["answers"]),
                                "prompt_tokens": row["n_tokens"], "tokens": row["n_tokens"] + len(tokens)})
        return records

    def summarize(self, records: Sequence[dict]) -> dict:
        memory = {}
        for setting in self.setting:
            common = self._common_summary([r for r in records if r["setting"] == setting])
            memory[setting] = {k: common[k] for k in ("kept_fraction", "kv_bytes", "tokens_per_s", "budget_tokens")}
        return {**summarize_ruler(records), "prompt_tokens": sum(r["prompt_tokens"] for r in records) / len(records),
                "prefill_chunk": self.prefill_chunk, "memory_by_setting": memory, **self._common_summary(records)}


TASKS: dict[str, type[EvalTask]] = {
    t.name: t for t in (PasskeyTask, LinesTask, PerplexityTask, AgreementTask, RulerTask)
}


def make_task(name: str, tokenizer, **options) -> EvalTask:
    """The task called ``name`` with its options; unknown names and options fail with what is allowed."""
    cls = TASKS.get(name)
    if cls is None:
        raise ValueError(f"unknown task {name!r}; available tasks: {', '.join(TASKS)}")
    import inspect

    allowed = [p for p in inspect.signature(cls).parameters if p != "tokenizer"]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"task {name!r} has no option(s) {unknown}; its options: {', '.join(allowed)}")
    return cls(tokenizer, **options)
