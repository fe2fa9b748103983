"""The model's own rotary embedding as one ``RotaryTable`` per layer, for ``Policy(positions="rolling")`` and
for scorers that rotate queries to other positions (``ExpectedAttention``: ``Policy.reads_queries``).

Rolling positions need keys un-rotated in the cache and a way to rotate them to any position. Both come
from the model itself: while a rolling policy is applied, ``evictlayers.apply`` gives the model position
0 for every token (its rotary embedding is then the identity, up to the attention factor some rope types
apply), so the attention function receives un-rotated queries and keys; the slot store rotates them to
their ranks with ``cos``/``sin`` that the model's rotary module computes at those ranks (rope scaling,
partial rotary and attention factors included).

Which table a layer needs is not read from names: ``apply`` runs a short probe sequence through the
patched model twice, at its real positions and at position 0, with every attention output set to zero
(so each layer's input is the same in both runs), and keeps for each layer the table that turns the
second run's queries and keys into the first's: the rotary module's table (per layer type
where its ``forward`` takes one: Gemma 3's local and global bases), or the identity (a layer without
rotary positions: SmolLM3's and Llama 4's NoPE layers, EXAONE 4's global layers). A layer no table
reproduces (interleaved rotary, learned absolute positions, a model that ignores ``position_ids``) is
refused, naming it.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import nn

from evictlayers.compose.positions import RotaryTable, rotate
from evictlayers.hf.support import ModelSupport, UnsupportedModelError

PROBE_TOKENS = 7  # an odd count of positions, so a table that ignores them shows
# relative error below which a table reproduces the model's rotation (float32 noise is ~1e-7; a wrong
# table is off by O(1))
_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6}
_LOW_PRECISION_TOLERANCE = 2e-2

Capture = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer_idx -> (query, key) the attention received


def _rotary_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def _identity(rows: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotation by nothing on the first two dims: the table of a layer without rotary positions."""
    return torch.ones(rows, 2, device=device, dtype=dtype), torch.zeros(rows, 2, device=device, dtype=dtype)


IDENTITY = RotaryTable(_identity)


def _module_table(rotary: nn.Module, layer_type: str | None) -> RotaryTable:
    extra = {} if layer_type is None else {"layer_type": layer_type}

    def compute(rows: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.zeros(1, 1, dtype=dtype, device=device)
        positions = torch.arange(rows, device=device)[None]
        with torch.no_grad():
            cos, sin = rotary(probe, position_ids=positions, **extra)
        return cos[0].to(device), sin[0].to(device)

    return RotaryTable(compute)


def _halves_table(table: RotaryTable) -> RotaryTable:
    """``table`` for a model whose rotary module returns one angle per pair (``[N, D/2]``, as GPT-OSS's)
    and applies it to both halves: the same angles written out for the full rotate-half width."""

    def compute(rows: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = table.compute(rows, device, dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    return RotaryTable(compute)


ROLLING = "Policy(positions='rolling')"


def model_rotary_tables(
    model: nn.Module, support: ModelSupport, capture: Callable[[torch.Tensor], Capture], user: str = ROLLING
) -> dict[int, RotaryTable]:
    """``{layer_idx: RotaryTable}`` for every attention layer; refuses the models whose rotation no table reproduces.

    ``capture(position_ids)`` runs the patched model on the probe tokens at ``position_ids`` ``[1, T]``
    without a cache and returns what each attention layer received. ``user``: what needs the tables (rolling
    positions, or a scorer such as ``ExpectedAttention``), named in every refusal.

    Raises:
        UnsupportedModelError: no rotary embedding (learned absolute positions: GPT-2, OPT), several
            rotary modules, or a layer whose rotation no table reproduces (named in the message).
    """
    where = f"{type(model).__name__} (model_type={model.config.model_type!r})"
    rotaries = _rotary_modules(model)
    if not rotaries and user != ROLLING:
        raise UnsupportedModelError(
            f"{user} rotates the model's queries to the positions of future tokens, which needs rotary position "
            f"embeddings (RoPE); {where} has no rotary embedding (learned absolute position embeddings, or none), "
            "so evictlayers cannot serve it with this scorer: use another scorer with this model"
        )
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
            f"{user}: {where} has {len(rotaries)} rotary embeddings ({names}); evictlayers "
            "cannot tell which layer uses which, so it supports one rotary module"
        )
    rotary = rotaries[0]
    device = next(model.parameters()).device
    positions = torch.arange(PROBE_TOKENS, device=device)[None]
    rotated, unrotated = capture(positions), capture(torch.zeros_like(positions))

    typed = "layer_type" in inspect.signature(rotary.forward).parameters
    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
    module_tables: dict[str | None, tuple[RotaryTable, RotaryTable]] = {}
    tables: dict[int, RotaryTable] = {}
    for layer in support.attention:
        if layer.index not in rotated or layer.index not in unrotated:
            raise UnsupportedModelError(
                f"{user}: {where}, layer {layer.index} did not attend during the probe"
            )
        layer_type = layer_types[layer.index] if typed and layer_types is not None else None
        if layer_type not in module_tables:
            own = _module_table(rotary, layer_type)
            module_tables[layer_type] = (own, _halves_table(own))
        for table in (*module_tables[layer_type], IDENTITY):
            if _reproduces(table, unrotated[layer.index], rotated[layer.index]):
                tables[layer.index] = table
                break
        else:
            raise UnsupportedModelError(
                f"{user}: {where}, layer {layer.index} rotates queries and keys in a way "
                "neither the model's rotary table in rotate-half form (x * cos + rotate_half(x) * sin on the first "
                "rotary dims) nor the identity reproduces (interleaved rotary, or positions the model does not take "
                "from position_ids), so evictlayers cannot rotate its queries and keys to other positions"
            )
    if all(table is IDENTITY for table in tables.values()):
        raise UnsupportedModelError(
            f"{user}: {where} gives the same queries and keys at every position_ids, so its positions cannot be "
            "re-assigned through them"
        )
    return tables


def _reproduces(table: RotaryTable, unrotated: tuple[torch.Tensor, torch.Tensor],
                rotated: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether ``table`` at positions ``0..T-1`` turns the position-0 queries and keys into the real ones."""
    query, key = unrotated
    try:
        cos, sin = table.rows(query.shape[2], query.device, torch.float32)
    except (KeyError, ValueError, TypeError, RuntimeError):  # the rotary module has no table for this layer type
        return False
    tolerance = _TOLERANCE.get(query.dtype, _LOW_PRECISION_TOLERANCE)
    for mine, theirs in zip((query, key), rotated, strict=True):
        if cos.shape[-1] > mine.shape[-1]:
            return False
        ours = rotate(mine.float(), cos[: mine.shape[2]], sin[: mine.shape[2]])
        error = (ours - theirs.float()).norm() / theirs.float().norm().clamp(min=1e-12)
        if not bool(error <= tolerance):
            return False
    return True
