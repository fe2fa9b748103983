"""One layer's runtime object: fixed rectangular slots, per-head token sets, eviction in place.

One object per attention layer holds the layer's whole state (docs/architecture.md, "The slot store"):
``keys``/``values`` are ``[B, H_kv, C, D]``, ``pos`` is ``[B, H_kv, C]`` (original position, ``-1`` =
empty; slots are unordered, each head holding its own token set), and the policy's state tensors, the
rolling ranks, the tokens seen, the budget and the sketch buffers live here too. The store allocates,
grows, reorders (beam search), evicts and reports its bytes itself; the Hugging Face cache layer only
hands it tensors. It dispatches each step: a multi-token step to ``compose/prefill_step.py``, a
one-token step to ``compose/decode_step.py``, a probe (tokens that attend and score but are never stored,
while ``probing``) to ``compose/probe_step.py``; ``defer`` holds every token until ``evict_deferred``. After
every step (but while deferring) a budgeted store holds at most ``budget`` tokens per head in ``budget + 1``
slots: the spare slot is where the next decoded token lands, so decoding never moves memory (H2O Appendix A).
"""

from __future__ import annotations

import math

import torch

from evictlayers.compose.cross_layer import CrossLayerBoard
from evictlayers.compose.decode_step import compiled_decode_step, decode_in_order, decode_step
from evictlayers.compose.eviction import release_evicted
from evictlayers.compose.policy import Policy
from evictlayers.compose.positions import RotaryTable, slot_ranks
from evictlayers.compose.prefill_step import evict_deferred, prefill_step
from evictlayers.compose.probe_step import probe_step
from evictlayers.compose.step_state import change_per_slot, sentence_starts, token_positions
from evictlayers.core import Component
from evictlayers.core.slots import pad_slots
from evictlayers.modules.cluster_sketch import CoinTable, SketchState

COIN_TABLE_TOKENS = 16  # a decode step's sketch coins are hashed ahead for this many absorbed tokens per head


def growth_slots(capacity: int) -> int:
    """Empty slots a full cache of ``capacity`` slots adds when it runs out: ``2 * sqrt(capacity)``, at least 64.

    A growth copies every slot (read and write, about two passes over the cache), once per ``g`` steps; until
    they fill, each step's attention also reads the empty slots, ``g / 2`` of them on average. Per step that
    is ``2 C / g + g / 2`` slots, least at ``g = 2 sqrt(C)``: 128 slots at 4k tokens (3% of a pass over the
    cache; growing by an eighth, 512 slots, would cost 6.6%, mostly attention over empty slots)."""
    return max(64, 2 * math.isqrt(capacity))


class CompileError(RuntimeError):
    """The decode step of a policy could not be compiled into one graph; names the layer and policy."""


class PolicyError(RuntimeError):
    """A policy component failed inside a step; names the layer and the component (``__cause__`` is the error)."""


def _culprit(error: BaseException) -> str:
    """The innermost policy component (``Component``) on ``error``'s traceback, as ``Name(params)``;
    the slot store itself when no component's code raised."""
    culprit = "the slot store"
    frame = error.__traceback__
    while frame is not None:
        owner = frame.tb_frame.f_locals.get("self")
        if isinstance(owner, Component):
            culprit = f"{type(owner).__name__}({owner.extra_repr()})"
        frame = frame.tb_next
    return culprit


class SlotStore:
    """Keys, values, positions and policy state of one attention layer for one batch of sequences."""

    def __init__(
        self, policy: Policy, layer_idx: int = 0, num_layers: int = 1, compile: bool = False,
        rotary: RotaryTable | None = None, window: int | None = None, sliding_layers: frozenset[int] = frozenset(),
        board: CrossLayerBoard | None = None, chunk: int | None = None,
    ):
        """``rotary``: the model's rotary table, which ``Policy(positions="rolling")`` needs (its keys are
        held un-rotated and rotated to their rank at every step; ``compose/positions.py``), and so does a policy
        whose scorer reads the queries' positions (``Policy.reads_queries``: ``ExpectedAttention``), whose
        queries and keys stay at their own positions.

        ``window``: the layer's sliding window, ``None`` for full attention. A query sees itself and the
        ``window - 1`` tokens before it, so a sliding layer never needs more than ``window - 1`` held tokens:
        whatever the policy, it holds at most that many (``full`` included, as transformers' own sliding
        cache does), the policy's budget binds where it is smaller, and a token that slid out of the window
        is the first to be evicted.

        ``sliding_layers``: the indices of the model's sliding-window layers, for an allocation that weighs
        layers by kind (``ByLayerKind``).

        ``chunk``: the attention chunk of a chunked-attention layer (Llama 4): a query at position ``q`` sees the
        tokens at positions ``p <= q`` with ``p // chunk == q // chunk`` only. Before each step the layer lets go
        of every token of an earlier chunk than the next token's (no later query can see one; per-head state
        forgets them as it does evicted tokens), a multi-token step is split where a row starts a new chunk, and
        the layer holds at most ``chunk - 1`` tokens, whatever the policy, as a sliding layer holds ``window - 1``:
        within a chunk, visibility is the plain causal rule, so every kernel serves it unchanged.

        ``board``: the ``CrossLayerBoard`` every layer of the model shares, for a policy holding ``CrossLayer``
        (``EvictionCache`` makes it): a ranking layer publishes its last query row there, and a layer that
        ranks by it waits for the last ranking layer at a multi-token step."""
        if rotary is not None and not isinstance(rotary, RotaryTable):
            raise TypeError(f"SlotStore(rotary={rotary!r}): expected a RotaryTable or None")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 2):
            raise ValueError(f"SlotStore(window={window!r}) in layer {layer_idx}: expected an int >= 2 or None")
        self.window = window
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 2):
            raise ValueError(f"SlotStore(chunk={chunk!r}) in layer {layer_idx}: expected an int >= 2 or None")
        if chunk is not None and window is not None:
            raise ValueError(f"SlotStore in layer {layer_idx}: a layer has a sliding window or an attention chunk, not both")
        self.chunk = chunk
        # which rule bounds the layer: "budget" (the policy's), "window" (the sliding window), None (neither)
        self.bound: str | None = None
        self.policy = policy
        self.layer_idx, self.num_layers = layer_idx, num_layers
        self.sliding_layers = frozenset(sliding_layers)
        self.compile = compile
        self.rotary = rotary
        if board is not None and not isinstance(board, CrossLayerBoard):
            raise TypeError(f"SlotStore(board={board!r}): expected a CrossLayerBoard or None")
        self.board = board
        self.ranking_layer = board is not None and layer_idx in board.layers
        if self.ranking_layer and policy.rows_needed < 1:
            raise ValueError(
                f"layer {layer_idx} is a CrossLayer ranking layer, so its policy must read the last query row; "
                f"{policy!r} reads none (give this layer's policy the CrossLayer selector too)"
            )
        self.most = 1  # the largest drop amount of any row, fixed with the budget at the first step
        self.kv = None  # the policy storage's slots (DenseSlots, QuantizedSlots), None until the first step
        self.pos: torch.Tensor | None = None
        # positions="rolling": each slot's rank among its head's held tokens ([B, H_kv, C] int64),
        # computed after a multi-token step and kept up to date by the decode step
        self.ranks: torch.Tensor | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.seen: torch.Tensor | None = None  # [B] real tokens per row
        # with a SentenceScores refinement: [B] the position of each row's last sentence end so far (-1: none
        # yet); None for a policy that does not rank sentences, so the steps need not ask the policy again
        self.last_sentence_end: torch.Tensor | None = None
        self.budget: torch.Tensor | None = None  # [B] tokens per head, None = unbounded
        # the real tokens of each row's whole prompt, where the caller knows them before the first step (a
        # prompt fed in chunks: ``EvictionCache.declare_prompt``): an int (every row) or [B]; None = unknown, and
        # a float budget is then a fraction of the first step's real tokens
        self.prompt_len: int | torch.Tensor | None = None
        # whether a declared prompt is still being fed: until each row has fed its prompt_len real tokens every
        # step is a chunk of it (a one-token chunk included: prefill_step, never a decode step); a host flag, so
        # a decode step reads no tensor to know
        self.in_prompt = False
        self.seq_len = 0  # columns fed so far, padding included (what transformers calls tokens seen)
        # ClusterSketch: the evicted tokens of every (row, KV head), fixed-size buffers
        self.sketch: SketchState | None = None
        self._coins: CoinTable | None = None  # the sketch's coins for the next decode steps
        self._coin_room = 0  # decode steps the coin table still covers
        # a full cache of unpadded rows, where nothing scores: slots [0, filled) hold every row's tokens in
        # position order at every head and later slots are empty (None: not such a cache, or no longer)
        self.filled: int | None = None
        # set by the compiled decode forward around a step whose tokens it read as all real (a graph cannot
        # read the mask): such a step keeps the in-order path without the host read (``_decode``)
        self.unpadded_step = False
        # KV sharing: whether a later layer attends over what this one attends over (``EvictionCache`` sets it),
        # and then, from each step until that layer has read it, ``(keys [B, H_kv, N, D], values [B, H_kv, N, D_v],
        # pos [B, H_kv, N], query_pos [B, Q])``: the slots and tokens this step attended over, before eviction
        self.keeps_attended = False
        self.attended: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # deferred eviction (``defer``): every step's tokens are held until ``evict_deferred``, which keeps each head's
        # best ``budget`` (the sliding window the held steps attended with is kept for it)
        self.deferred = False
        self.deferred_window: int | None = None
        # probe steps (``probing``, set by ``EvictionCache.probing``): a step's tokens attend and feed the scorers but
        # are never stored (``compose/probe_step.py``)
        self.probing = False

    # ---- sizes ---------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return 0 if self.pos is None else self.pos.shape[2]

    @property
    def keys(self) -> torch.Tensor | None:
        """``[B, H_kv, C, D]`` keys as stored, dequantised for a quantised storage (un-rotated under
        ``positions="rolling"``: attention rotates them to their ranks)."""
        return None if self.kv is None else self.kv.dense()[0]

    @property
    def values(self) -> torch.Tensor | None:
        """``[B, H_kv, C, D_v]`` values as attention reads them."""
        return None if self.kv is None else self.kv.dense()[1]

    def retained(self) -> torch.Tensor:
        """``[B, H_kv]`` int64 tokens held per head."""
        return (self.pos >= 0).sum(-1)

    def kv_bytes(self) -> int:
        """Bytes of the key and value slots as stored (codes, scales and zero points for a quantised storage)."""
        return 0 if self.kv is None else self.kv.nbytes()

    def state_bytes(self) -> int:
        """Bytes of the bookkeeping beside the keys and values: slot positions (and ranks, rolling) and
        policy state."""
        if self.pos is None:
            return 0
        ranks = 0 if self.ranks is None else self.ranks.nbytes
        return self.pos.nbytes + ranks + sum(t.nbytes for t in self.state.values())

    def sketch_stats(self) -> dict[str, int]:
        """What the layer's ClusterSketch holds: ``clusters``, ``samples`` (key samples of the clusters
        in use plus held value samples) and ``absorbed`` tokens, each the most of any (row, head), and
        ``bytes``, the size of its buffers (fixed at allocation) and of its coin table (fixed once
        decoding starts). All 0 without a sketch."""
        if self.sketch is None:
            return {"clusters": 0, "samples": 0, "absorbed": 0, "bytes": 0}
        stats = self.policy.sketch.stats(self.sketch)
        return {
            "clusters": int(stats["clusters_in_use"].max()),
            "samples": int((stats["key_samples_held"] + stats["value_samples_held"]).max()),
            "absorbed": int(stats["absorbed"].max()),
            # the salt is a 0-d tensor the store adds beside the sketch's buffers (one graph for every layer)
            "bytes": int(stats["bytes"]) + self.sketch.salt.nbytes
            + (self._coins.nbytes() if self._coins is not None else 0),
        }

    def stats(self) -> dict:
        """This layer's entry of ``EvictionCache.stats()`` (which documents the keys)."""
        started = self.kv is not None
        sketch = self.sketch_stats()
        return {
            "kind": "sliding" if self.window is not None else "chunked" if self.chunk is not None else "attention",
            "bound": self.bound if started else None,
            "retained_tokens": int(self.retained().max()) if started else 0,
            "seen_tokens": int(self.seen.max()) if started else 0,
            "kv_bytes": self.kv_bytes(),
            "state_bytes": self.state_bytes(),
            "sketch_clusters": sketch["clusters"],
            "sketch_samples": sketch["samples"],
            "sketch_absorbed": sketch["absorbed"],
            "sketch_bytes": sketch["bytes"],
        }

    # ---- whole-store changes -------------------------------------------------------------------

    def reorder(self, index: torch.Tensor) -> None:
        """Reorder (or repeat) the batch in place, row ``i`` becoming row ``index[i]`` (beam search): every
        per-row tensor follows its row, the sketch of each row's evicted tokens included."""
        if self.kv is None:
            return
        index = index.to(self.pos.device)
        self.kv.index_select_batch(index)
        self.pos = self.pos.index_select(0, index)
        if self.ranks is not None:
            self.ranks = self.ranks.index_select(0, index)
        self.state = {name: t.index_select(0, index) for name, t in self.state.items()}
        self.seen = self.seen.index_select(0, index)
        if self.last_sentence_end is not None:
            self.last_sentence_end = self.last_sentence_end.index_select(0, index)
        if self.budget is not None:
            self.budget = self.budget.index_select(0, index)
        if self.sketch is not None:
            self.sketch = self.sketch.index_select_batch(index)
            self.invalidate_coins()

    def reset(self) -> None:
        """Forget every token, the sketch included: the next step starts the layer afresh."""
        keeps_attended = self.keeps_attended
        self.__init__(
            self.policy, self.layer_idx, self.num_layers, compile=self.compile, rotary=self.rotary, window=self.window,
            sliding_layers=self.sliding_layers, board=self.board, chunk=self.chunk,
        )
        self.keeps_attended = keeps_attended
        if self.board is not None:
            self.board.reset()

    # ---- one step ------------------------------------------------------------------------------

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, real: torch.Tensor | None = None,
             **attention_kwargs) -> torch.Tensor:
        """``_step`` (below), with a failure inside the policy naming this layer and the component that
        raised: a ``ValueError``/``TypeError`` (bad input or configuration) keeps its type and gets a
        note; anything else (a bug, bad state, a kernel error) becomes a ``PolicyError`` from it."""
        try:
            if self.probing:
                return self._probe(query, key, value, real, **attention_kwargs)
            if self.chunk is not None:
                return self._chunked_step(query, key, value, real, **attention_kwargs)
            return self._step(query, key, value, real, **attention_kwargs)
        except CompileError:
            raise
        except (ValueError, TypeError) as error:
            if hasattr(error, "add_note"):
                error.add_note(f"(in layer {self.layer_idx}, {_culprit(error)})")
            raise
        except Exception as error:
            raise PolicyError(
                f"layer {self.layer_idx}: {_culprit(error)} failed ({type(error).__name__}: {error}); policy: "
                f"{' '.join(repr(self.policy).split())}"
            ) from error

    def _step(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        real: torch.Tensor | None = None,
        *,
        scaling: float,
        softcap: float | None = None,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        sentence_ends: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Insert the step's tokens, attend over the slots, score, evict over-budget slots: the first step
        fixes the budget and allocates the sketch, then a one-token step goes to ``_decode`` and any other
        (a prompt, a chunk of one, the first step whatever its length) to ``prefill_step``.

        The budget is resolved at the first step from each row's prompt length: the declared ``prompt_len``
        where the caller gave one (a prompt fed in chunks), else the first step's real tokens. With a
        declared prompt every step until each row has fed it is a chunk of it, one token long or not
        (``prefill_step`` keeps exactly the budget, as one step over the whole prompt does; a decode step
        would drop ``drop`` at once), and a step that feeds a row past it raises ``ValueError``.

        Args:
            query: ``[B, H_q, Q, D]``; key/value: ``[B, H_kv, Q, D]`` for the ``Q`` new tokens.
            real: ``[B, Q]`` bool, ``False`` for padding tokens (never stored); ``None`` = all real.
            sinks: ``[H_q]`` learned attention-sink logits (``kernels/attention_sinks.py``), or ``None``.
                The scorers see each key's probability without the sink's share.
            sentence_ends: ``[B, Q]`` bool, ``True`` for a token whose text ends a sentence or a line; needed
                (and read) only when a selector ranks sentences (``Policy.reads_sentences``).

        Returns:
            ``[B, H_q, Q, D_v]`` attention output (zero for padding queries).
        """
        batch, _, q_len, _ = key.shape
        if self.policy.positions == "rolling" and self.rotary is None:
            raise ValueError(
                "Policy(positions='rolling') rotates keys to their rank in the cache, so the slot store needs "
                "the model's rotary table: create the cache with run.new_cache() under evictlayers.apply "
                "(or pass SlotStore(rotary=RotaryTable(...)))"
            )
        if self.policy.reads_queries and self.rotary is None:
            raise ValueError(
                "the policy's scorer reads the queries' rotary positions (ExpectedAttention), so the slot store "
                "needs the model's rotary table: create the cache with run.new_cache() under evictlayers.apply (or "
                "pass SlotStore(rotary=RotaryTable(...)))"
            )
        if real is None:
            real = torch.ones(batch, q_len, dtype=torch.bool, device=key.device)
        if sliding_window is not None and self.window is not None and sliding_window != self.window:
            raise ValueError(
                f"layer {self.layer_idx}: the attention call passed sliding_window={sliding_window}, but the "
                f"model's cache layer has a window of {self.window} tokens"
            )
        first = self.seen is None
        if first and self.policy.requires_probes and self.policy.budget is not None and not self.deferred:
            raise ValueError(
                "the policy scores tokens by probes (ContextReconstruction: KVzip's context reconstruction), so a "
                "bounded cache must reconstruct its context before anything is evicted: compress the context with "
                "cache = run.compress_context(context_ids, attention_mask), then generate from that cache "
                "(model.generate(question_ids, attention_mask=<context and question mask>, past_key_values=cache)); "
                "plain generate() or a forward on a fresh cache would rank tokens nothing scored. Policy: "
                f"{' '.join(repr(self.policy).split())}"
            )
        if first:
            self.seen = torch.zeros(batch, dtype=torch.long, device=key.device)
            prompt = real.sum(1)
            if self.prompt_len is not None:  # a declared prompt: the budget is a fraction of all of it
                self.prompt_len = self._declared_prompt(batch, key.device)
                prompt = self.prompt_len
            # the mask follows the call's sliding_window; the cap, the cache layer's window (transformers
            # sizes its own sliding cache layers by it even where a model's mask does not slide)
            self.budget = self._layer_budget(prompt, self.window or sliding_window or self.chunk)
            self._allocate_sketch(key, value, sliding_window)
            if self.policy.reads_sentences:
                self.last_sentence_end = torch.full_like(self.seen, -1)
        elif self.seen.shape[0] != batch:
            raise ValueError(f"this cache holds {self.seen.shape[0]} sequences but the step has batch size {batch}")
        if sinks is not None and self.sketch is not None:
            raise ValueError(
                "a ClusterSketch cannot be merged with learned attention sinks (the model passes "
                "s_aux/sinks): use a policy without the sketch for this model"
            )
        sentence_start = None
        if self.last_sentence_end is not None:  # a policy that ranks sentences; any other pays nothing here
            sentence_start, last_end = sentence_starts(
                token_positions(self.seen, real), sentence_ends, self.last_sentence_end
            )
            self.last_sentence_end.copy_(last_end)  # in place: a captured decode graph writes only its buffers
        if q_len == 1 and self.kv is not None and not self.in_prompt:
            if self.deferred:
                raise ValueError(
                    f"layer {self.layer_idx} defers eviction until its probes have run (SlotStore.defer): a one-token "
                    "step cannot be decoded before evict_deferred() (EvictionCache.evict_deferred)"
                )
            return self._decode(
                query, key, value, real, scaling=scaling, softcap=softcap, sliding_window=sliding_window, sinks=sinks,
                sentence_start=sentence_start,
            )
        in_prompt = self.prompt_len is not None and (first or self.in_prompt)
        if in_prompt:
            fed = self.seen + real.sum(1)
            over = fed > self.prompt_len
            if bool(over.any()):
                row = int(over.nonzero()[0])
                raise ValueError(
                    f"row {row} has fed {int(fed[row])} real prompt tokens by this step, but the cache was told its "
                    f"prompt has {int(self.prompt_len[row])}: declare the whole prompt's real tokens per row "
                    "(attention_mask.sum(1)), not its columns or a chunk's"
                )
        out = prefill_step(
            self, query, key, value, real, scaling=scaling, softcap=softcap, sliding_window=sliding_window,
            sinks=sinks, sentence_start=sentence_start,
        )
        if in_prompt:  # one host read per chunk of a declared prompt; none once it is fed
            self.in_prompt = bool((self.seen < self.prompt_len).any())
        return out

    def _chunked_step(self, query, key, value, real, *, sentence_ends=None, **attention_kwargs) -> torch.Tensor:
        """``_step`` on a chunked-attention layer (``chunk``, see ``__init__``): the tokens of earlier chunks
        leave before each part of the step, and a multi-token step runs in parts that start where any row
        starts a new chunk (one host read of the step's positions; a one-token step reads nothing)."""
        batch, _, q_len, _ = key.shape
        if real is None:
            real = torch.ones(batch, q_len, dtype=torch.bool, device=key.device)
        cuts = [0, q_len]
        if q_len > 1:
            seen = self.seen if self.seen is not None else torch.zeros(batch, dtype=torch.long, device=key.device)
            starts = ((token_positions(seen, real) % self.chunk == 0) & real).any(0)
            cuts = sorted({0, q_len, *starts.nonzero()[:, 0].tolist()})
        outs = []
        for start, stop in zip(cuts, cuts[1:]):
            self._forget_earlier_chunks()
            part = slice(start, stop)
            outs.append(self._step(
                query[:, :, part], key[:, :, part], value[:, :, part], real[:, part],
                sentence_ends=None if sentence_ends is None else sentence_ends[:, part], **attention_kwargs,
            ))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 2)

    def _forget_earlier_chunks(self) -> None:
        """Free, in place, every held slot of an earlier chunk than the row's next token's, as an eviction frees
        it (``release_evicted``: per-head state forgets its key); fixed shapes, so a compiled step traces it."""
        if self.pos is None:
            return
        stale = (self.pos >= 0) & (self.pos // self.chunk < (self.seen // self.chunk)[:, None, None])
        slots = torch.arange(self.capacity, device=self.pos.device).expand_as(self.pos)
        keys = self.kv.dense()[0] if self.policy.head_state_specs else None
        release_evicted(self.policy, self.pos, self.state, slots, stale, keys)
        if self.ranks is not None:
            self.ranks.copy_(slot_ranks(self.pos))

    # ---- probes and deferred eviction -----------------------------------------------------------

    def defer(self) -> None:
        """Hold every token of the coming steps, evicting nothing, until ``evict_deferred``; before the first step.
        The budget is still resolved at the first step (from the declared prompt, as usual), and the scorers
        observe each held step as usual (``Observation.deferred`` set), so probes can score the held tokens
        before anything goes (KVzip's context, ``EvictionRun.compress_context``). A one-token step is refused
        while deferred (the decode step needs the spare slot a selection leaves)."""
        if self.seen is not None:
            raise ValueError(f"layer {self.layer_idx}: defer eviction before the store's first step")
        if self.board is not None:
            raise ValueError(
                f"layer {self.layer_idx}: a CrossLayer policy holds its steps on the cache's board until its ranking "
                "layers have run; it cannot defer eviction beyond that"
            )
        self.deferred = True

    def evict_deferred(self) -> None:
        """End a deferral (``defer``): each head keeps its best ``budget`` of what it holds, by the rule a
        multi-token step keeps them (``compose/prefill_step.py``'s ``_keep_best``), compacted into ``budget + 1``
        slots. A store that saw no step only stops deferring."""
        if not self.deferred:
            raise ValueError(f"layer {self.layer_idx}: evict_deferred() without a deferral (SlotStore.defer)")
        self.deferred = False
        if self.kv is not None:
            evict_deferred(self)

    def add_room(self, extra: int) -> None:
        """Raise each row's budget by ``extra`` tokens per head and give the slots room for them, after the prompt
        (``EvictionRun.compress_context(room=...)``): what arrives next fills the room before anything held is
        evicted. A layer bound by its sliding window (or without a budget) is left as it is: no later query sees
        more than its window."""
        if self.budget is None or self.bound == "window" or extra == 0:
            return
        self._grow(extra)
        self.budget = self.budget + extra

    def _why_no_probe(self) -> str | None:
        """Why this store cannot run a probe step now, ``None`` when it can."""
        policy = self.policy
        if not policy.observes_probes:
            return (
                f"{' '.join(repr(policy).split())} has a selector that does not observe probes (a probe is for "
                "scorers that declare observes_probes, ContextReconstruction), or no selector"
            )
        if policy.sketch is not None:
            return "a ClusterSketch merges absorbed tokens, which a probe's attention over the exact slots leaves out"
        if policy.positions == "rolling":
            return "rolling positions re-rank the held keys at every step; a probe needs positions='absolute'"
        if self.chunk is not None:
            return "a chunked-attention layer lets go of earlier chunks at each step, which a probe must not do"
        if self.kv is None:
            return "the store holds nothing yet: feed the context first"
        if self.in_prompt:
            return "the declared prompt is still being fed: probe after its last chunk"
        return None

    def _probe(
        self, query, key, value, real, *, scaling: float, softcap: float | None = None,
        sliding_window: int | None = None, sinks: torch.Tensor | None = None, sentence_ends=None,
    ) -> torch.Tensor:
        """A probe step (``probing``): ``compose/probe_step.py``. Nothing of the store changes but the scorers'
        per-slot state of the held slots; ``sentence_ends`` are not read (a probe inserts no token)."""
        why = self._why_no_probe()
        if why is not None:
            raise ValueError(f"layer {self.layer_idx} cannot run a probe step: {why}")
        batch, _, q_len, _ = key.shape
        if self.seen.shape[0] != batch:
            raise ValueError(f"this cache holds {self.seen.shape[0]} sequences but the probe has batch size {batch}")
        if sliding_window is not None and self.window is not None and sliding_window != self.window:
            raise ValueError(
                f"layer {self.layer_idx}: the attention call passed sliding_window={sliding_window}, but the "
                f"model's cache layer has a window of {self.window} tokens"
            )
        if real is None:
            real = torch.ones(batch, q_len, dtype=torch.bool, device=key.device)
        return probe_step(self, query, key, value, real, scaling=scaling, softcap=softcap,
                          sliding_window=sliding_window, sinks=sinks)

    def _declared_prompt(self, batch: int, device: torch.device) -> torch.Tensor:
        """``prompt_len`` as ``[B]`` int64 on ``device``, checked against the first step's batch."""
        declared = self.prompt_len
        if isinstance(declared, int):
            return torch.full((batch,), declared, dtype=torch.long, device=device)
        if declared.shape != (batch,):
            raise ValueError(
                f"the cache was told the prompt lengths of {declared.shape[0]} rows, but its first step has batch "
                f"size {batch}"
            )
        return declared.to(device=device, dtype=torch.long)

    def _layer_budget(self, prompt_len: torch.Tensor, sliding_window: int | None) -> torch.Tensor | None:
        """``[B]`` tokens per head: the policy's budget, capped at ``sliding_window - 1`` on a sliding
        layer (the most any later query can see); records which of the two binds in ``bound``."""
        budget = self.policy.resolve_budget(prompt_len, self.layer_idx, self.num_layers, self.sliding_layers)
        self.bound = None if budget is None else "budget"
        if sliding_window is None:
            return budget
        cap = torch.full_like(prompt_len, max(sliding_window - 1, 1))
        if budget is None or bool((budget > cap).any()):
            self.bound = "window"
            budget = cap if budget is None else torch.minimum(budget, cap)
        return budget

    def decodes_in_place(self) -> bool:
        """Whether the next one-token step writes into the slot buffers as they are, through ops that may be
        compiled on this device, so that a whole model's decode forward can be one compiled graph
        (``hf/compiled_forward.py``). The buffers exist (a first step allocated them) and have a free slot for
        the token (``make_room`` grows a full layer first): a budget or window bounds the layer (its buffers
        never grow), or an unbounded layer attends over all its slots, empty ones masked (``decode_step``), or
        keeps its slots in position order (``decode_in_order``, on CPU). Not with a ClusterSketch: its coin
        table is remade every few steps (``_step_coins``), a branch that would compile the whole model twice
        more."""
        if self.kv is None or self.sketch is not None or self.keeps_attended or self.probing or self.deferred:
            return False
        if self.filled is not None:  # the in-order path runs on CPU only (``prefill_step``'s ``_in_order``)
            return self.filled < self.capacity
        return self.pos.device.type != "cuda" or self.kv.compiles_on_cuda

    def make_room(self) -> None:
        """Give an unbounded (full) store that has no free slot left after the next token a few more
        (``growth_slots`` says how many): only such a store can run out (it holds at most ``seq_len`` tokens).
        Runs before a step, outside any compiled graph: a compiled forward calls it eagerly, so the graph sees
        buffers that do not grow. The slot it keeps free: a step that filled the last one would attend over
        the whole buffer, not a slice of it, which a compiled graph specialises on (a graph more per growth)."""
        if self.budget is None and self.kv is not None and self.seq_len + 2 > self.capacity:
            self._grow(growth_slots(self.capacity))

    def _decode(self, query, key, value, real, **attention_kwargs) -> torch.Tensor:
        """One token per row into the fixed slot buffers (``decode_step``, compiled when asked;
        ``decode_in_order`` for a cache kept in position order)."""
        if not torch.compiler.is_compiling():  # the compiled forward made room before its graph
            self.make_room()
        in_order = self.filled is not None and (self.unpadded_step or bool(real.all()))
        # what else ``prefill_step`` asks to keep the order (``_in_order``) cannot change after the first
        # step: only padding can end the order here
        if in_order:
            out = decode_in_order(self, query, key, value, **attention_kwargs)
            self.count_step()
            return out
        self.filled = None
        if self.compile and key.is_cuda and not self.kv.compiles_on_cuda:
            raise CompileError(
                f"evictlayers does not compile the decode step of layer {self.layer_idx} on CUDA with "
                f"{self.policy.storage!r}: inductor's build of it gives other logits than the same step run "
                "eagerly. Run it with compile=False (the Triton kernels still attend from the codes)"
            )
        # inside a compiled whole forward the step is traced inline with the rest of the model; a step that keeps
        # what it attended over for a KV-sharing layer assigns it to the store, which runs eagerly
        compiled = self.compile and not self.keeps_attended and not torch.compiler.is_compiling()
        step = compiled_decode_step() if compiled else decode_step
        table = query_table = None
        if self.policy.positions == "rolling":  # ranks stay below the capacity
            table = self.rotary.rows(self.capacity, key.device, key.dtype)
        if self.policy.reads_queries:  # one cached table: every step hands the graph the same tensors
            query_table = self.rotary.rows(max(self.policy.rotary_rows, 2), key.device, torch.float32)
        try:
            out = step(
                self, query, key, value, real, **attention_kwargs, rotary=table, coins=self._step_coins(),
                query_rotary=query_table,
            )
        except torch._dynamo.exc.TorchDynamoException as error:
            raise CompileError(
                f"evictlayers could not compile the decode step of layer {self.layer_idx} under {self.policy!r}: "
                f"a component needs something torch.compile(fullgraph=True) cannot trace ({error}). Run it "
                "with compile=False, or make the component's per-step code fixed-shape"
            ) from error
        self.count_step()
        return out

    def count_step(self) -> None:
        """One more column seen. Inside the compiled decode forward it is counted after the graph
        (``CompiledDecodeForward``): a count read inside would be a constant of the graph, traced again next step."""
        if not torch.compiler.is_compiling():
            self.seq_len += 1

    # ---- the ClusterSketch of evicted tokens ----------------------------------------------------

    def _allocate_sketch(self, key: torch.Tensor, value: torch.Tensor, sliding_window: int | None) -> None:
        """One sketch per layer, at the first step, when the policy has a ClusterSketch and
        the layer can evict. A sliding-window or chunked layer gets none: the sketch keeps no positions, so it
        could not forget the tokens that slide out of the window or leave with their chunk; its evicted tokens are
        dropped as usual."""
        sketch = self.policy.sketch
        if sketch is None or self.budget is None or sliding_window is not None or self.chunk is not None:
            return
        batch, heads, _, head_dim = key.shape
        self.sketch = sketch.allocate(batch, heads, head_dim, value.shape[-1], key.dtype, key.device, self.layer_idx)
        # a 0-d tensor, not an int: torch.compile would specialise on each layer's int and recompile
        self.sketch.salt = torch.tensor(self.sketch.salt, dtype=torch.int64, device=key.device)

    def _step_coins(self) -> CoinTable | None:
        """The coin table of the next decode step: a step absorbs at most ``most`` tokens per head, so a
        table of ``max(16, most)`` tokens is remade (eagerly, outside any compiled graph, from device
        counters: no host sync) once the steps since the last one could have used it up."""
        if self.sketch is None:
            return None
        if self._coins is None or self._coin_room < self.most:
            width = max(COIN_TABLE_TOKENS, self.most)
            self._coins = self.policy.sketch.coin_table(self.sketch, width)
            self._coin_room = width
        self._coin_room -= self.most
        return self._coins

    def invalidate_coins(self) -> None:
        """Drop the coin table (the sketch was changed outside a decode step: prefill, beam reorder)."""
        self._coins, self._coin_room = None, 0

    # ---- slot bookkeeping ----------------------------------------------------------------------

    def _grow(self, extra: int) -> None:
        self.kv.grow(extra)
        self.pos = pad_slots(self.pos, extra, -1)
        if self.ranks is not None:
            self.ranks = pad_slots(self.ranks, extra, 0)
        self.state = change_per_slot(self.state, self.policy.state_specs, lambda t: pad_slots(t, extra, 0.0))
