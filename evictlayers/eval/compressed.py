"""The prompt's cache for a policy that scores by context reconstruction (KVzip: ``Policy.requires_probes``),
which a plain ``generate()`` cannot fill: the evaluation tasks compress the prompt first, as KVzip does."""

from __future__ import annotations

import torch

from evictlayers.hf.cache import EvictionCache


def reconstruction_cache(run, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         prefill_chunk: int | None = None) -> EvictionCache | None:
    """For a policy that needs reconstruction probes, the cache of ``input_ids`` ``[B, T]`` (left-padded, mask
    ``[B, T]``) but its last column, compressed by ``run.compress_context``, so that ``generate()`` on the whole
    prompt feeds that last token and answers from the compressed cache; ``None`` for any other policy (the task
    then runs ``generate()`` as it does)."""
    if not run.policy.requires_probes:
        return None
    return run.compress_context(input_ids[:, :-1], attention_mask[:, :-1], prefill_chunk=prefill_chunk)
