"""One compiled graph for a whole decode forward, embedding to logits, under ``evictlayers.apply(compile=True)``.

Compiling each layer's decode step alone leaves, at every layer of every step, transformers' eager module
stack around it (norms, projections, rotary embedding, MLP, a few dozen Python calls) and the compiled
graph's own call (dynamo's guards, ~0.4 ms). On a small model they cost about as much as reading the weights.
``CompiledDecodeForward`` stands in for the model's ``forward`` while the patch is active and sends each
one-token forward whose cache decodes in place at every layer (``SlotStore.decodes_in_place``: a budget
or a window bounds the layer, so its buffers never grow, or a full layer keeps its slots in position order
and was given room for the token before the graph runs) through one
``torch.compile(fullgraph=True)`` of the model's own ``forward``: the slot stores' decode steps
(``compose/decode_step.py``) are traced inline, so a step pays the guards and a graph call once.

Everything else takes the model's ``forward`` eagerly, with each layer's decode step compiled as before:
prefill (its shapes change with every prompt), the steps of a full cache out of position order (a padded
prompt or step, or on CUDA: its buffers may grow inside the step) or of one that holds a ClusterSketch, a
hybrid model's recurrent layers (transformers' own code, not evictlayers'), and a storage that does not
compile on CUDA (the store refuses it with ``CompileError``).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from evictlayers.compose.decode_step import raise_recompile_limit
from evictlayers.compose.store import CompileError
from evictlayers.hf.cache import EvictionCache, EvictionLayer


class CompiledDecodeForward:
    """``model.forward`` while ``apply(model, policy, compile=True)`` is active (``EvictionRun`` installs it).

    ``eager`` is the model's own bound ``forward``; ``run`` the ``EvictionRun``, whose forward pre-hook has
    already handed this forward its cache and counted its tokens when this is called."""

    def __init__(self, run, eager: Callable):
        self.run, self.eager = run, eager
        self.compiled: Callable | None = None
        # generate() reads forward's signature to choose what it passes (position_ids, for one): keep the model's
        functools.update_wrapper(self, eager)

    def __call__(self, *args, **kwargs):
        if not self.in_place():
            return self.eager(*args, **kwargs)
        if self.compiled is None:
            raise_recompile_limit()
            self.compiled = torch.compile(
                self.eager, fullgraph=True, dynamic=None, options={"emulate_precision_casts": True}
            )
        stores = [layer.store for layer in self.run.cache.layers]
        self.run.in_compiled_forward = True
        for store in stores:  # in_place read the step's mask
            store.unpadded_step = True
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as error:
            raise CompileError(
                f"evictlayers could not compile the decode forward of {type(self.run.model).__name__} under "
                f"{' '.join(repr(self.run.policy).split())}: something in the model or the policy cannot be traced "
                f"by torch.compile(fullgraph=True) ({error}). Run it with compile=False"
            ) from error
        finally:
            self.run.in_compiled_forward = False
            for store in stores:
                store.unpadded_step = False

    def in_place(self) -> bool:
        """Whether this forward is a one-token step of a cache every layer of which is an evictlayers attention
        layer decoding in place. Grows first, eagerly, each full layer with no free slot left (as its own step
        would: ``SlotStore.make_room``), and reads whether the step's tokens are real where a full layer keeps
        its slots in position order (a padded token ends that order, which the graph cannot branch on)."""
        cache = self.run.cache
        if self.run.step_tokens != 1 or not isinstance(cache, EvictionCache):
            return False
        stores = [layer.store for layer in cache.layers if type(layer) is EvictionLayer]
        if len(stores) != len(cache.layers):
            return False
        for store in stores:
            store.make_room()
        if not all(store.decodes_in_place() for store in stores):
            return False
        in_order = next((store for store in stores if store.filled is not None), None)
        real = None if in_order is None else self.run.real_tokens(in_order.seq_len, 1)
        return real is None or bool(real.all())
