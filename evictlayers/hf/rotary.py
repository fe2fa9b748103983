"""The model's own rotary embedding as a ``RotaryTable``, for ``Policy(positions="rolling")``.

Rolling positions need keys un-rotated in the cache and a way to rotate them to any position. Both come
from the model itself: while a rolling policy is applied, ``evictlayers.apply`` gives the model position
0 for every token (its rotary embedding is then the identity, up to the attention factor some rope types
apply), so the attention function receives un-rotated queries and keys; the slot store rotates them to
their ranks with ``cos``/``sin`` that the model's rotary module computes at those ranks (rope scaling,
partial rotary and attention factors included). The rotate-half form (``compose/positions.rotate``) is
checked against the model's own ``apply_rotary_pos_emb`` once, when the policy is applied.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from evictlayers.compose.positions import RotaryTable, rotate
from evictlayers.hf.families import UnsupportedModelError

_PROBE_POSITIONS = 37  # an odd count of positions, so a table that ignores them shows


def _rotary_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def _head_dim(module: nn.Module, config) -> int:
    for name in ("head_dim", "head_size"):
        if isinstance(getattr(module, name, None), int):
            return getattr(module, name)
    return config.hidden_size // config.num_attention_heads


def model_rotary_table(model: nn.Module, attention: list[nn.Module]) -> RotaryTable:
    """A ``RotaryTable`` computed by ``model``'s rotary module; refuses models rolling cannot serve.

    Raises:
        UnsupportedModelError: the model has no rotary embedding (learned absolute positions: GPT-2, OPT),
            several (per-layer rotary modules: which layer uses which is not known here), or a rotary form
            other than rotate-half.
    """
    config = model.config
    rotaries = _rotary_modules(model)
    where = f"{type(model).__name__} (model_type={config.model_type!r})"
    if not rotaries:
        raise UnsupportedModelError(
            f"Policy(positions='rolling') re-assigns positions by rotating keys to their rank in the cache, which "
            f"needs rotary position embeddings (RoPE); {where} adds learned absolute position embeddings to its "
            "inputs, so a position past its context cannot be re-assigned inside the cache. Use "
            "positions='absolute' with this model"
        )
    if len(rotaries) > 1:
        names = ", ".join(sorted({type(m).__name__ for m in rotaries}))
        raise UnsupportedModelError(
            f"Policy(positions='rolling'): {where} has {len(rotaries)} rotary embeddings ({names}), one per kind of "
            "layer; evictlayers cannot tell which layer uses which, so it supports rolling with one rotary module"
        )
    rotary = rotaries[0]

    def compute(rows: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.zeros(1, 1, dtype=dtype, device=device)
        positions = torch.arange(rows, device=device)[None]
        with torch.no_grad():
            cos, sin = rotary(probe, position_ids=positions)
        return cos[0].to(device), sin[0].to(device)

    table = RotaryTable(compute)
    _check_form(model, attention[0], table, where)
    return table


def _check_form(model: nn.Module, module: nn.Module, table: RotaryTable, where: str) -> None:
    """The model's ``apply_rotary_pos_emb`` must equal ``rotate`` (rotate-half on the first R dims)."""
    cls = getattr(module, "_evictlayers_original_class", type(module))
    apply_rotary = getattr(sys.modules[cls.__module__], "apply_rotary_pos_emb", None)
    if apply_rotary is None:
        raise UnsupportedModelError(
            f"Policy(positions='rolling'): {where} has no apply_rotary_pos_emb in {cls.__module__}, so evictlayers "
            "cannot check how it rotates keys"
        )
    dim = _head_dim(module, model.config)
    cos, sin = table.compute(_PROBE_POSITIONS, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(0)
    query, key = torch.randn(2, 1, 1, _PROBE_POSITIONS, dim, generator=generator)
    expected_query, expected_key = apply_rotary(query, key, cos[None], sin[None])
    ours = rotate(torch.cat([query, key]), cos, sin)
    if not torch.allclose(ours, torch.cat([expected_query, expected_key]), rtol=1e-5, atol=1e-5):
        raise UnsupportedModelError(
            f"Policy(positions='rolling'): {where} rotates keys in a form other than rotate-half "
            "(x * cos + rotate_half(x) * sin on the first rotary dims), which is the one evictlayers re-rotates"
        )
