"""Per-layer induction scores, for the ``Induction`` allocation (``compose/allocation.py``).

RazorAttention's probe (Tang et al., 2024): random tokens repeated twice. From the second copy's token
``t`` an induction head attends to the token that followed ``t`` in the first copy; a layer's score is the
largest such attention among its heads, averaged over the copy and the probe's sequences. The probe runs
the unmodified model once with transformers' eager attention (the only implementation that returns the
attention weights), before ``evictlayers.apply`` patches it; no prompt the model will serve is read.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from evictlayers.hf.support import ModelSupport, UnsupportedModelError, attention_implementation
from evictlayers.hf.weights import weights_signature

PROBE_LENGTH = 128  # tokens per copy: the span an induction head must reach back across
PROBE_SEQUENCES = 2
PROBE_SEED = 0

_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def induction_scores(model: nn.Module, support: ModelSupport) -> list[float]:
    """``[num_layers]`` scores in ``[0, 1]``: per layer, the largest induction score among its heads (0 for a
    layer without attention). Measured once per model and set of parameters (a model whose parameters were
    replaced or changed in place afterwards is measured again; ``weights_signature`` says which changes show)."""
    signature = weights_signature(model.modules())
    cached = _MEASURED.get(model)
    if cached is not None and cached[0] == signature:
        return cached[1]
    scores = _measure(model, support)
    _MEASURED[model] = (signature, scores)
    return scores


def _measure(model: nn.Module, support: ModelSupport) -> list[float]:
    vocab = model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(PROBE_SEED)
    # ids from the vocabulary's middle: the first ids are special and byte tokens in most tokenizers
    first = torch.randint(vocab // 8, vocab // 2, (PROBE_SEQUENCES, PROBE_LENGTH), generator=generator)
    device = next(model.parameters()).device
    tokens = torch.cat([first, first], dim=1).to(device)
    # query T + i looks at key i + 1 (i in [0, T - 1)): the token after its first occurrence
    queries = torch.arange(PROBE_LENGTH, 2 * PROBE_LENGTH - 1, device=device)
    keys = queries - PROBE_LENGTH + 1
    scores = [0.0] * support.num_layers

    def record(index: int):
        def hook(module, args, output):
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if not isinstance(weights, torch.Tensor) or weights.dim() != 4:
                raise UnsupportedModelError(
                    f"Induction allocation: {type(module).__name__} (layer {index}) returned no attention weights "
                    "under transformers' eager attention, so its induction score cannot be measured; pass "
                    "Induction(scores=[...]) instead"
                )
            induction = weights[:, :, queries, keys].double().mean(dim=(0, 2))  # [H]
            scores[index] = float(induction.max())

        return hook

    hooks = [layer.module.register_forward_hook(record(layer.index)) for layer in support.attention]
    try:
        with attention_implementation(model, support, "eager"), torch.no_grad():
            model(input_ids=tokens, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return scores
