"""Whether a model's parameters are still the ones something was built from, without reading their values."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


def weights_signature(modules: Iterable[nn.Module]) -> tuple[tuple[int, int, int | None], ...]:
    """Per parameter of each module (its own, not its children's; ``model.modules()`` for a whole model): its
    identity, its storage's address and its in-place update count. Equal signatures mean no parameter was
    replaced, re-pointed (``.data = ...``) or written in place since (``load_state_dict`` writes in place),
    with two exceptions that keep no count: a write through ``.data`` (``p.data.copy_(...)``), and a write
    to an inference tensor (made under ``torch.inference_mode``). A caller that reads it every step passes
    a list of the modules made once: ``model.modules()`` walks the tree anew, several times as long."""
    return tuple(
        (id(p), p.data_ptr(), _version(p)) for module in modules for p in module._parameters.values() if p is not None
    )


def _version(parameter: torch.Tensor) -> int | None:
    """The in-place update count; ``None`` for an inference tensor, which keeps none and can only change
    inside inference mode."""
    return None if parameter.is_inference() else parameter._version
