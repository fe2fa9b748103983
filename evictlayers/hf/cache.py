"""The eviction cache as transformers sees it: one ``SlotStore`` per layer inside a ``Cache``."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from evictlayers.compose import Policy, SlotStore
from evictlayers.compose.positions import RotaryTable


class EvictionLayer(CacheLayerMixin):
    """A cache layer whose ``update`` only stages the new keys/values.

    The attention function registered by ``evictlayers.apply`` then attends over the slots plus the
    staged tokens, scores and evicts (``SlotStore.step``): evicting inside ``update`` would remove keys
    before the attention that needs them.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self, policy: Policy, layer_idx: int = 0, num_layers: int = 1, compile: bool = False,
        rotary: RotaryTable | None = None,
    ):
        super().__init__()
        self.store = SlotStore(policy, layer_idx, num_layers, compile=compile, rotary=rotary)
        self.staged: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.staged is not None:
            raise RuntimeError(
                "evictlayers: a layer received new keys twice without attending in between; the model's "
                "attention did not run through evictlayers (was the model patched with evictlayers.apply?)"
            )
        self.staged = (key_states, value_states)
        return key_states, value_states

    def attend(self, query: torch.Tensor, real: torch.Tensor | None, **attention_kwargs) -> torch.Tensor:
        """Run the staged step through the slot store; returns ``[B, H_q, Q, D_v]``."""
        key, value = self.staged
        self.staged = None
        return self.store.step(query, key, value, real, **attention_kwargs)

    @property
    def keys(self):  # transformers reads .keys for dtype/device and offloading
        return self.store.keys

    @keys.setter
    def keys(self, value):  # CacheLayerMixin.__init__ assigns None
        if value is not None:
            raise AttributeError("EvictionLayer.keys is the slot store's; it cannot be assigned")

    @property
    def values(self):
        return self.store.values

    @values.setter
    def values(self, value):
        if value is not None:
            raise AttributeError("EvictionLayer.values is the slot store's; it cannot be assigned")

    def get_seq_length(self) -> int:
        """Tokens seen (padding columns included), not tokens kept: transformers derives positions from it."""
        return self.store.seq_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        retained = self.store.capacity
        return retained + query_length, self.store.seq_len - retained

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch (beam search): every per-row tensor follows its row."""
        store = self.store
        if store.kv is None:
            return
        index = beam_idx.to(store.pos.device)
        store.kv.index_select_batch(index)
        store.pos = store.pos.index_select(0, index)
        if store.ranks is not None:
            store.ranks = store.ranks.index_select(0, index)
        store.state = {name: t.index_select(0, index) for name, t in store.state.items()}
        store.seen = store.seen.index_select(0, index)
        if store.budget is not None:
            store.budget = store.budget.index_select(0, index)
        if store.sketch is not None:  # the ClusterSketch of each row's evicted tokens follows its row
            for name, tensor in store.sketch.tensors().items():
                setattr(store.sketch, name, tensor.index_select(0, index))
            store.invalidate_coins()

    def reset(self) -> None:
        """Forget everything, the ClusterSketch included: the next step starts a new one."""
        store = self.store
        self.store = SlotStore(
            store.policy, store.layer_idx, store.num_layers, compile=store.compile, rotary=store.rotary
        )
        self.staged = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "an eviction cache cannot be cropped: evicted tokens are gone, so generation modes that roll the "
            "cache back (assisted/speculative generation, prompt lookup, DoLa) are not supported under el.apply"
        )


class EvictionCache(Cache):
    """A ``transformers`` cache whose layers keep only what ``policy`` selects; ``compile=True`` runs each
    layer's decode step as one ``torch.compile(fullgraph=True)`` graph. ``rotary`` is the model's rotary
    table, needed by ``Policy(positions="rolling")`` (``run.new_cache()`` passes it)."""

    def __init__(self, policy: Policy, num_layers: int, compile: bool = False, rotary: RotaryTable | None = None):
        super().__init__(
            layers=[EvictionLayer(policy, i, num_layers, compile=compile, rotary=rotary) for i in range(num_layers)]
        )
        self.policy = policy

    def stats(self) -> dict:
        """``{'kv_bytes', 'state_bytes', 'sketch_bytes', 'layers': [{'retained_tokens', 'seen_tokens',
        'kv_bytes', 'state_bytes', 'sketch_clusters', 'sketch_samples', 'sketch_absorbed',
        'sketch_bytes'}, ...]}``.

        ``retained_tokens`` is the most any head of the layer keeps, ``seen_tokens`` the most real
        tokens any row has fed, ``kv_bytes`` the bytes the layer's key/value slots occupy and
        ``state_bytes`` those of its bookkeeping (slot positions and the policy's per-slot state).
        With a stream-mode ``ClusterSketch``: ``sketch_clusters``, ``sketch_samples`` (key samples of
        the clusters in use plus value samples) and ``sketch_absorbed`` tokens are the most any head
        holds, ``sketch_bytes`` the size of the layer's sketch buffers, fixed whatever the number of
        tokens absorbed (all 0 without a sketch). The totals are sums over layers.
        """
        layers = []
        for layer in self.layers:
            store = layer.store
            started = store.kv is not None
            sketch = store.sketch_stats()
            layers.append(
                {
                    "retained_tokens": int(store.retained().max()) if started else 0,
                    "seen_tokens": int(store.seen.max()) if started else 0,
                    "kv_bytes": store.kv_bytes(),
                    "state_bytes": store.state_bytes(),
                    "sketch_clusters": sketch["clusters"],
                    "sketch_samples": sketch["samples"],
                    "sketch_absorbed": sketch["absorbed"],
                    "sketch_bytes": sketch["bytes"],
                }
            )
        return {
            "kv_bytes": sum(entry["kv_bytes"] for entry in layers),
            "state_bytes": sum(entry["state_bytes"] for entry in layers),
            "sketch_bytes": sum(entry["sketch_bytes"] for entry in layers),
            "layers": layers,
        }
