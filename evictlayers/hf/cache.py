"""The eviction cache as transformers sees it: one ``SlotStore`` per layer inside a ``Cache``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin, LinearAttentionLayer

from evictlayers.compose import Policy, SlotStore
from evictlayers.compose.cross_layer import CrossLayerBoard
from evictlayers.compose.positions import RotaryTable
from evictlayers.hf.support import ModelSupport


ROLLBACK_REFUSED = (
    "an eviction cache cannot be cropped: evicted tokens are gone, so generation modes that roll the "
    "cache back (assisted/speculative generation, prompt lookup, DoLa) are not supported under el.apply"
)


class EvictionLayer(CacheLayerMixin):
    """A cache layer whose ``update`` only stages the new keys/values.

    The attention function registered by ``evictlayers.apply`` then attends over the slots plus the
    staged tokens, scores and evicts (``SlotStore.step``): evicting inside ``update`` would remove keys
    before the attention that needs them.
    """

    is_compileable = False
    is_croppable = False

    def __init__(
        self, policy: Policy, layer_idx: int = 0, num_layers: int = 1, compile: bool = False,
        rotary: RotaryTable | None = None, window: int | None = None, sliding_layers: frozenset[int] = frozenset(),
        board: CrossLayerBoard | None = None, chunk: int | None = None,
    ):
        """``window``: the layer's sliding window (``SlotStore``), ``None`` for full attention; ``chunk``: the
        attention chunk of a chunked-attention layer (``SlotStore``);
        ``sliding_layers``: the indices of the model's sliding-window layers and ``board`` the ranking board
        of a ``CrossLayer`` policy (``SlotStore``)."""
        super().__init__()
        self.store = SlotStore(
            policy, layer_idx, num_layers, compile=compile, rotary=rotary, window=window, sliding_layers=sliding_layers,
            board=board, chunk=chunk,
        )
        self.is_sliding = window is not None or chunk is not None
        self.staged: tuple[torch.Tensor, torch.Tensor] | None = None
        # what the model's attention call makes of the staged keys, as the attention function found on an
        # eager step (a compiled step cannot compare tensors to find out): how many times it repeats the
        # staged heads (JetMoE: once per expert), or whether it expands a staged latent into per-head keys
        # and values with the module's expand_kv (MLA); None until then
        self.head_tiles: int | None = None
        self.expands_latent: bool | None = None
        # KV sharing: what this step's update returned, by which a reusing layer's attention call recognises the
        # keys it was handed as this layer's (kept only where a layer reuses them)
        self.returned: tuple[torch.Tensor, torch.Tensor] | None = None

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
        self.returned = self.staged if self.store.keeps_attended else None
        return key_states, value_states

    def attend(
        self, query: torch.Tensor, real: torch.Tensor | None, key: torch.Tensor | None = None,
        value: torch.Tensor | None = None, **attention_kwargs,
    ) -> torch.Tensor:
        """Run the staged step through the slot store; returns ``[B, H_q, Q, D_v]``. ``key``/``value``: what the
        store keeps for the staged tokens where it is not what the cache received (an MLA model's per-head
        expansion of its staged latent); by default the staged keys and values."""
        staged_key, staged_value = self.staged
        self.staged = None
        key = staged_key if key is None else key
        value = staged_value if value is None else value
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
        if torch.compiler.is_compiling():
            # evictlayers' mask function builds nothing from these (slots are masked by position) and its
            # attention reads no mask: inside the compiled decode forward, sizes that do not count the steps
            # keep the graph from being specialised on the step (see EvictionCache.get_query_offset)
            return retained + query_length, 0
        return retained + query_length, self.store.seq_len - retained

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch (beam search): every per-row tensor follows its row."""
        self.store.reorder(beam_idx)

    def reset(self) -> None:
        """Forget everything, the ClusterSketch included: the next step starts a new one."""
        self.store.reset()
        self.staged = self.returned = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(ROLLBACK_REFUSED)


class EvictionHybridLayer(LinearAttentionLayer, EvictionLayer):
    """A hybrid cache layer (recurrent state and attention keys in one layer, as transformers'
    ``LinearAttentionAndFullAttentionLayer``): the recurrent part is transformers' own, carried untouched;
    the attention part is an ``EvictionLayer``."""

    is_compileable = False

    def __init__(
        self, policy: Policy, layer_idx: int = 0, num_layers: int = 1, compile: bool = False,
        rotary: RotaryTable | None = None, window: int | None = None, number_of_states: int = 1,
        sliding_layers: frozenset[int] = frozenset(), board: CrossLayerBoard | None = None,
    ):
        EvictionLayer.__init__(self, policy, layer_idx, num_layers, compile=compile, rotary=rotary, window=window,
                               sliding_layers=sliding_layers, board=board)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # the attention part is initialised by update(key, value), the recurrent part by keyword state updates
        if len(args) == 2 and not kwargs:
            EvictionLayer.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        EvictionLayer.reorder_cache(self, beam_idx)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        EvictionLayer.reset(self)

    def crop(self, tokens_to_remove: int) -> None:
        EvictionLayer.crop(self, tokens_to_remove)

    def get_max_length(self) -> int:
        return -1


class EvictionCache(Cache):
    """A ``transformers`` cache whose attention layers keep only what ``policy`` selects; ``compile=True``
    runs each layer's decode step as one ``torch.compile(fullgraph=True)`` graph. ``rotary`` is the model's
    rotary table, or one per layer index, needed by ``Policy(positions="rolling")`` (``run.new_cache()``
    passes them).

    ``support`` (what ``model_support`` found in the model; ``run.new_cache()`` passes it) gives each
    sliding-window layer its window (and ``policy.for_layer``'s policy: its ``sliding_modules`` when it has
    them) and keeps the model's own cache layer where a layer holds recurrent state (hybrid models) or
    nothing; without it, every layer is a full-attention eviction layer."""

    def __init__(
        self, policy: Policy, num_layers: int, compile: bool = False,
        rotary: RotaryTable | dict[int, RotaryTable] | None = None, support: ModelSupport | None = None,
        prompt_len: int | torch.Tensor | None = None,
    ):
        """``prompt_len``: the real tokens of each row's whole prompt, for a prompt fed in chunks
        (``declare_prompt``); ``None``: not known."""
        if support is not None and support.num_layers != num_layers:
            raise ValueError(f"EvictionCache: num_layers={num_layers} but the model has {support.num_layers} layers")
        layers = []
        sliding = frozenset() if support is None else frozenset(
            layer.index for layer in support.attention if layer.window is not None
        )
        board = self._board(policy, num_layers, support)
        for index in range(num_layers):
            if support is not None and index in support.carried:
                kind, kwargs = support.carried[index]
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))
            else:
                table = rotary.get(index) if isinstance(rotary, dict) else rotary
                window = support.window(index) if support is not None else None
                states = support.recurrent_states(index) if support is not None else None
                layer_policy = policy.for_layer(sliding=window is not None)
                if states is None:
                    layers.append(
                        EvictionLayer(layer_policy, index, num_layers, compile=compile, rotary=table, window=window,
                                      sliding_layers=sliding, board=board, chunk=support and support.chunk(index))
                    )
                else:
                    layers.append(EvictionHybridLayer(
                        layer_policy, index, num_layers, compile=compile, rotary=table, window=window,
                        number_of_states=states, sliding_layers=sliding, board=board,
                    ))
        super().__init__(layers=layers)
        # KV sharing: the layers whose steps a later layer attends over keep what they attended over, and the
        # reusing layers (whose own cache layer holds nothing) are reported as such
        self.reusing = {} if support is None else {layer.index: layer.source for layer in support.reusing}
        for source in set(self.reusing.values()):
            self.layers[source].store.keeps_attended = True
        self.policy = policy
        # whether a one-token forward has run on this cache after its prompt (set by evictlayers.apply's hook):
        # a multi-token forward after it continues the cache, one before it is a chunk of the prompt
        self.decoded = False
        if prompt_len is not None:
            self.declare_prompt(prompt_len)

    def declare_prompt(self, prompt_len: int | torch.Tensor) -> None:
        """Tell the cache, before its first forward, how many real tokens each row's whole prompt has (an
        ``int`` for every row, or ``[B]``, e.g. ``attention_mask.sum(1)``), so that a prompt fed in chunks
        resolves a ``float`` budget from all of it at the first chunk, every layer as one forward of the whole
        prompt would. Until each row has fed that many real tokens every forward is a chunk of the prompt (a
        one-token chunk too); feeding a row past it in the prompt raises ``ValueError``. ``generate()`` and
        ``run.prefill`` declare it themselves."""
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, torch.Tensor)):
            raise TypeError(
                f"prompt_len={prompt_len!r}: expected an int (real tokens of every row's prompt) or a 1-D integer "
                "tensor of one length per row (attention_mask.sum(1))"
            )
        if isinstance(prompt_len, torch.Tensor):
            if prompt_len.dim() != 1 or prompt_len.is_floating_point() or prompt_len.dtype == torch.bool:
                raise ValueError(
                    f"prompt_len: expected a 1-D integer tensor of one length per row, got {prompt_len.dtype} of shape "
                    f"{tuple(prompt_len.shape)}"
                )
            if bool((prompt_len < 0).any()):
                raise ValueError(f"prompt_len: lengths must be >= 0, got {prompt_len.tolist()}")
            prompt_len = prompt_len.detach().long().clone()
        elif prompt_len < 1:
            raise ValueError(f"prompt_len={prompt_len}: a prompt has at least one token")
        if self.get_seq_length() > 0:
            raise ValueError(
                f"this cache already holds {self.get_seq_length()} tokens: declare the prompt's length before its "
                "first forward (run.new_cache(prompt_len=...))"
            )
        for layer in self.layers:
            if isinstance(layer, EvictionLayer):
                layer.store.prompt_len = prompt_len

    def reset(self) -> None:
        """Forget every token and the declared prompt: the next forward starts a new prompt."""
        super().reset()
        self.decoded = False

    def _stores(self) -> list[SlotStore]:
        return [layer.store for layer in self.layers if isinstance(layer, EvictionLayer)]

    def defer_eviction(self) -> None:
        """Before the first forward: every layer holds every token it is fed, evicting nothing, until
        ``evict_deferred`` (``SlotStore.defer``), so that probes can score the whole context first
        (``EvictionRun.compress_context``). Budgets are resolved from the prompt as usual."""
        if self.get_seq_length() > 0:
            raise ValueError(
                f"this cache already holds {self.get_seq_length()} tokens: defer eviction before its first forward"
            )
        for store in self._stores():
            store.defer()

    def evict_deferred(self) -> None:
        """End the deferral: each layer's heads keep their best ``budget`` tokens (``SlotStore.evict_deferred``)."""
        for store in self._stores():
            store.evict_deferred()

    def add_room(self, extra: int) -> None:
        """Every budgeted layer keeps ``extra`` more tokens per head from now on (``SlotStore.add_room``)."""
        for store in self._stores():
            store.add_room(extra)

    @contextlib.contextmanager
    def probing(self) -> Iterator[EvictionCache]:
        """Within the block every forward on this cache is a probe (``compose/probe_step.py``): its tokens attend
        over what each layer holds and, causally, each other, at the positions after the tokens seen, and feed the
        scorers (``Observation.probe``), but nothing is stored: slots, positions, per-head state, the tokens seen
        and ``get_seq_length()`` stay as they were (the scorers' per-slot state of the held slots aside). A
        forward's ``attention_mask`` then covers the tokens seen and the probe's (as for any continuation), and a
        padded probe row should pass ``position_ids`` (``seen`` onwards per row). Refused, by the first layer that
        runs a probe, for a policy whose scorers do not observe probes, a ClusterSketch, rolling positions,
        chunked-attention layers, an empty cache and a prompt still being fed; a model whose other layers hold
        recurrent state would update it, which ``EvictionRun.compress_context`` refuses."""
        stores = self._stores()
        for store in stores:
            store.probing = True
        try:
            yield self
        finally:
            for store in stores:
                store.probing = False

    @property
    def prompt_declared(self) -> bool:
        """Whether the cache was told its prompt's length (``declare_prompt``)."""
        return any(layer.store.prompt_len is not None for layer in self.layers if isinstance(layer, EvictionLayer))

    @property
    def in_prompt(self) -> bool:
        """Whether a declared prompt is still being fed (its next forward is a chunk of it)."""
        return any(layer.store.in_prompt for layer in self.layers if isinstance(layer, EvictionLayer))

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """The tokens seen, which transformers' mask builders read; 0 inside the compiled decode forward, where
        only evictlayers' mask function (which builds nothing from it) reads it and a count that grows every
        step would be a constant of the graph, compiled again at the next step."""
        return 0 if torch.compiler.is_compiling() else super().get_query_offset(layer_idx)

    @staticmethod
    def _board(policy: Policy, num_layers: int, support: ModelSupport | None) -> CrossLayerBoard | None:
        """The ranking board a ``CrossLayer`` policy's layers share; its ranking layers must attend through
        evictlayers (not a hybrid model's recurrent or attention-free layers)."""
        scorers = [p.cross_layer for p in policy.layer_policies if p.cross_layer is not None]
        if not scorers:
            return None
        scorer = scorers[0]  # every one names the same layers (Policy checks)
        layers = scorer.resolve(num_layers)
        carried = sorted(set(layers) & set(support.carried)) if support is not None else []
        if carried:
            raise ValueError(
                f"CrossLayer(layers={scorer.layers}): layers {carried} of this model hold recurrent state or no "
                "attention cache, so they cannot rank tokens; pick attention layers (those not in "
                f"{sorted(support.carried)})"
            )
        return CrossLayerBoard(layers)

    def stats(self) -> dict:
        """``{'kv_bytes', 'state_bytes', 'sketch_bytes', 'layers': [{'kind', 'bound', 'retained_tokens',
        'seen_tokens', 'kv_bytes', 'state_bytes', 'sketch_clusters', 'sketch_samples', 'sketch_absorbed',
        'sketch_bytes'}, ...]}``.

        ``kind`` is ``"attention"``, ``"sliding"`` (a sliding-window attention layer), ``"chunked"`` (a
        chunked-attention layer), ``"shared"`` (a KV-sharing layer, which attends over another layer's tokens
        and holds none: its counts are 0) or ``"carried"`` (a
        recurrent or attention-free layer of a hybrid model, whose own cache layer is kept untouched: its
        counts are 0). ``bound`` says which rule bounds the layer: ``"budget"`` (the policy's),
        ``"window"`` (its sliding window or attention chunk, where smaller than the budget) or ``None`` (neither: the cache
        grows). ``retained_tokens`` is the most any head of the layer keeps, ``seen_tokens`` the most real
        tokens any row has fed, ``kv_bytes`` the bytes the layer's key/value slots occupy and
        ``state_bytes`` those of its bookkeeping (slot positions and the policy's per-slot state).
        With a ``ClusterSketch``: ``sketch_clusters``, ``sketch_samples`` (key samples of
        the clusters in use plus value samples) and ``sketch_absorbed`` tokens are the most any head
        holds, ``sketch_bytes`` the size of the layer's sketch buffers, fixed whatever the number of
        tokens absorbed (all 0 without a sketch). The totals are sums over layers.
        """
        layers = []
        for index, layer in enumerate(self.layers):
            if not isinstance(layer, EvictionLayer):
                kind = "shared" if index in self.reusing else "carried"
                layers.append({"kind": kind, "bound": None, **dict.fromkeys(_COUNTS, 0)})
                continue
            layers.append(layer.store.stats())
        return {
            "kv_bytes": sum(entry["kv_bytes"] for entry in layers),
            "state_bytes": sum(entry["state_bytes"] for entry in layers),
            "sketch_bytes": sum(entry["sketch_bytes"] for entry in layers),
            "layers": layers,
        }


_COUNTS = (
    "retained_tokens", "seen_tokens", "kv_bytes", "state_bytes", "sketch_clusters", "sketch_samples",
    "sketch_absorbed", "sketch_bytes",
)
