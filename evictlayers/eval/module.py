"""The Lightning side: a ``LightningModule`` that evaluates a model under several policies in
``test_step``, and the ``Trainer`` that runs it (one process, or sharded with DDP).

Each batch is evaluated under every policy in turn, so one ``Trainer.test`` covers a whole
recipe x budget sweep and every policy sees exactly the same batches. Per-example records are
gathered from all ranks at the end of the epoch, de-duplicated by example index (a
``DistributedSampler`` pads the shards by repeating examples) and summarised once, so the merged
result equals the single-process one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import lightning as L
import torch
from torch.utils.data import DataLoader

from evictlayers import Policy
from evictlayers.eval.suite import EvalTask

__all__ = ["PolicyEvaluator", "merge_records", "run_test"]


def merge_records(shards: list[dict[str, list[dict]]]) -> dict[str, list[dict]]:
    """Merge per-rank ``{label: [record]}``: one record per example index, sorted by index."""
    merged: dict[str, dict[int, dict]] = {}
    for shard in shards:
        for label, records in shard.items():
            by_index = merged.setdefault(label, {})
            for record in records:
                by_index.setdefault(int(record["index"]), record)
    return {label: [by_index[i] for i in sorted(by_index)] for label, by_index in merged.items()}


class PolicyEvaluator(L.LightningModule):
    """Evaluate ``model`` on ``task`` under each of ``policies`` (``{label: Policy}``).

    After ``Trainer.test`` the merged summaries are in ``self.summaries`` (``{label: summary}``) and
    the merged per-example records in ``self.records``; with ``result_path`` rank 0 also writes both
    as JSON there (how the parent process gets them back from DDP workers).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        task: EvalTask,
        policies: Mapping[str, Policy],
        threads: int | None = None,
        result_path: str | os.PathLike | None = None,
    ):
        super().__init__()
        if not policies:
            raise ValueError("PolicyEvaluator needs at least one policy")
        self.model = model
        self.task = task
        self.policies = dict(policies)  # a plain dict: policies hold no parameters
        self.threads = threads
        self.result_path = result_path
        self._records: dict[str, list[dict]] = {}
        self.records: dict[str, list[dict]] = {}
        self.summaries: dict[str, dict] = {}

    def setup(self, stage: str) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)

    def on_test_epoch_start(self) -> None:
        self._records = {label: [] for label in self.policies}

    def test_step(self, batch: dict, batch_idx: int) -> None:
        shared = self.task.prepare(self.model, batch)
        for label, policy in self.policies.items():
            self._records[label].extend(self.task.run(self.model, policy, batch, shared))

    def on_test_epoch_end(self) -> None:
        shards = [self._records]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            shards = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(shards, self._records)
        self.records = merge_records(shards)
        self.summaries = {label: self.task.summarize(records) for label, records in self.records.items()}
        for label, summary in self.summaries.items():
            self.log(f"{label}/{self.task.score_name}", float(summary["score"]), batch_size=summary["n"])
        if self.result_path is not None and self.global_rank == 0:
            with open(self.result_path, "w") as handle:
                json.dump({"summaries": self.summaries, "records": self.records}, handle)


def run_test(
    evaluator: PolicyEvaluator,
    batch_size: int = 1,
    devices: int = 1,
    progress: bool = True,
    seed: int = 0,
) -> tuple[dict[str, dict], dict[str, list[dict]]]:
    """``Trainer(...).test(evaluator)`` on CPU; returns ``(summaries, records)`` merged over ranks.

    ``devices > 1`` shards the examples over that many processes with Lightning's DDP strategy
    (``ddp_fork`` where the platform can fork, else ``ddp_spawn``); the result comes back through a
    JSON file written by rank 0.
    """
    import logging

    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    if devices > 1 and evaluator.threads is None:
        # processes x threads should not exceed the cores: oversubscribed OpenMP threads spin and crawl
        evaluator.threads = max(1, (os.cpu_count() or 1) // devices)
    L.seed_everything(seed, workers=True, verbose=False)
    loader = DataLoader(
        evaluator.task.dataset(), batch_size=batch_size, shuffle=False, collate_fn=evaluator.task.collate
    )
    # Lightning's start-up notices (accelerator, tips, DDP set-up) on every call would drown the results
    chatty = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in chatty]
    for logger in chatty:
        logger.setLevel(logging.WARNING)
    try:
        return _test(evaluator, loader, devices, progress)
    finally:
        for logger, level in zip(chatty, levels, strict=True):
            logger.setLevel(level)


def _test(evaluator: PolicyEvaluator, loader: DataLoader, devices: int, progress: bool):
    import tempfile
    import warnings

    if devices == 1:
        strategy = "auto"
    else:
        import multiprocessing

        strategy = "ddp_fork" if "fork" in multiprocessing.get_all_start_methods() else "ddp_spawn"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=progress,
        use_distributed_sampler=True,
    )
    with tempfile.TemporaryDirectory(prefix="evictlayers-eval-") as tmp:
        evaluator.result_path = os.path.join(tmp, "result.json") if devices > 1 else None
        with warnings.catch_warnings():
            # single-worker loaders and DistributedSampler padding are expected here (see merge_records)
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=".*it is recommended to use `Trainer\\(devices=1.*")
            warnings.filterwarnings("ignore", message=".*DistributedSampler.*")
            warnings.filterwarnings("ignore", message=".*when logging on epoch level in distributed setting.*")
            warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*")
            trainer.test(evaluator, dataloaders=loader, verbose=False)
        if devices == 1:
            return evaluator.summaries, evaluator.records
        with open(evaluator.result_path) as handle:
            data = json.load(handle)
        evaluator.result_path = None
        return data["summaries"], data["records"]
