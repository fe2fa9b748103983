"""Expected Attention (Devoto, Jeblick and Jégou, 2025, arXiv:2510.00636; NVIDIA kvpress's
``ExpectedAttentionPress``): score each key by the attention the next queries are expected to pay it."""

from __future__ import annotations

import math

import torch

from evictlayers.compose.positions import rotate
from evictlayers.core.slots import along_slots
from evictlayers.scoring.accumulator import ScoreAccumulator
from evictlayers.scoring.key_diff import inserted_keys
from evictlayers.scoring.view import Observation, SlotView

# per-slot state: each query head's expected log-attention for the slot's key, and the key's value norm
LOGIT, VALUE_NORM = "expected_logit", "value_norm"
# per-head state: the query statistics, in the frame of the row's next position (see the class docstring)
COUNT, MEAN, M2 = "query_count", "query_mean", "query_m2"
SLOT_BLOCK = 1024  # a multi-token step scores the slots in blocks of this many (the quadratic form's scratch)


def _turn_both(matrix: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``M R^T`` then ``R (M R^T)``: a ``[..., D, D]`` second moment carried by the rotation ``R`` of its vectors."""
    rows = rotate(matrix, cos, sin)  # every row r -> R r, i.e. M R^T
    return rotate(rows.transpose(-1, -2), cos, sin).transpose(-1, -2)


def _check_int(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"ExpectedAttention({name}={value!r}): {name} must be an int >= {least}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"ExpectedAttention({name}={value!r}): {name} must be True or False")
    return value


class ExpectedAttention(ScoreAccumulator):
    """``s_j = (mean_g softmax_j(l_{g,j}) + epsilon) * ||v_j||_2``, with the expected log-attention of query
    head ``g`` for key ``k_j`` (post-RoPE, at its own position):

        ``l_{g,j} = scaling * mu_g^T R_bar^T k_j + scaling^2 / 2 * k_j^T R_bar Sigma_g R_bar^T k_j``

    Expected Attention models the next queries of each query head as Gaussian, ``q ~ N(mu_g, Sigma_g)`` before
    RoPE, and RoPE over the next ``T = n_future_positions`` positions by its average ``R_bar = mean_{t=0}^{T-1}
    R(t0 + t)`` (``t0`` the next position); for a Gaussian ``E[exp(s q^T k)] = exp(s mu^T k + s^2 k^T Sigma
    k / 2)`` (its moment-generating function), so with ``mu_f = R_bar mu`` and ``Sigma_f = R_bar Sigma R_bar^T``
    the expected unnormalised attention of key ``k`` is ``exp(mu_f^T k / sqrt(d) + k^T Sigma_f k / (2 d))``:
    the paper's closed form, as kvpress's ``ExpectedAttentionPress`` writes it ("E(A) = exp(K @ mean.T /
    sqrt(d) + 1/2 K @ cov @ K.T / d)", then "(scores + epsilon) * ||V||_2"). As in kvpress the expectation is
    normalised over the keys (a softmax of ``l``), averaged over the query heads of the GQA group, and
    multiplied by the value norm; ``mu``/``Sigma`` are the mean and (biased) covariance of the queries from
    position ``n_sink`` on (kvpress skips the first ``n_sink`` hidden states as outliers), and the first
    ``n_sink`` tokens are kept: excluded from the normalisation and scored above every other slot of their
    head (kvpress pads them with the maximum score plus one). Defaults are kvpress's: ``n_future_positions
    =512``, ``n_sink=4``, ``use_covariance=True`` (``False``: the mean term only), ``use_vnorm=True``
    (``False``: the normalised expectation alone), ``epsilon=0``.

    How it is computed here (equal in exact arithmetic to the formula above, with no absolute position):

    - the scorer reads the queries the attention function receives (post-RoPE, ``q_p = R(p) q``;
      ``Observation.queries``) and the layer's rotary table as rotations (``Observation.rotary``). The
      statistics are held in the frame of the row's next position ``t0``: each query counts as
      ``R(t0 - p) q_p = R(t0) q``, so the held mean is ``R(t0) mu`` and the second moment ``R(t0) Sigma
      R(t0)^T``. Then ``R_bar = R(t0) A`` with ``A = mean_{t<T} R(t)`` (table rows ``0..T-1``), and since
      rotations commute, ``mu_f^T k = (R(t0) mu)^T (A^T k)`` and ``k^T Sigma_f k = (A^T k)^T (R(t0) Sigma
      R(t0)^T) (A^T k)``: only offsets within a step and ``A`` are read, never a position's own row, so the
      table stays small and the decode step's shapes fixed. A step of ``n`` real tokens turns the held
      statistics by ``R(n)`` and merges its own queries in (Chan et al.'s pairwise update of the mean and
      the sum of centred outer products); a padding token counts nowhere.
    - The model's attention ``scaling`` replaces ``1 / sqrt(d)`` (equal for most models; Gemma's
      ``query_pre_attn_scalar`` differs, and the expectation is of the model's own logits). Soft-capping is
      not modelled.
    - The queries' rotary attention factor (YaRN, LongRoPE) is kept: the model's future queries carry it
      too, while kvpress's pre-RoPE projections do not.

    Deviations, for a cache bounded while generating (kvpress compresses the prompt once):

    - Statistics run over the whole sequence: every query from position ``n_sink`` on, the generated ones
      joining the prompt's (kvpress's decoding press instead rescores every 512 steps from the last 256
      generated hidden states). No window of recent queries is kept: it would need a ring of queries per
      head, the queries' covariance being state enough.
    - A multi-token step (a prompt, or a chunk of one) scores every held slot with the statistics so far,
      kvpress's compression. A generated token's key is scored once, on arrival, with the statistics that
      include its own query and the ``T`` positions after it; held slots keep their ``l``. The
      normalisation, the group mean and the value norm apply at every ranking, over the slots the head
      holds then. Rescoring every slot at every step would cost ``d`` times attention's ``q . k`` (the
      quadratic form); the stored ``l`` cost nothing to rank.
    - The group mean is used whatever ``Policy(gqa_reduce=...)`` says (kvpress's mean; this scorer reads no
      attention mass).
    - ``||v||`` is taken when the value arrives, at full precision under ``QuantizedKV``.
    - kvpress's leaderboard entry wraps the press in AdaKV's head-adaptive budgets with ``epsilon=1e-2``;
      per-head budgets are not built here (docs/architecture.md), so each head keeps its own ``budget``.

    State: per slot, ``l`` for each query head of the group and ``||v||``; per (row, KV head), the query count,
    mean (``[G, D]``) and second moment (``[G, D, D]``, with ``use_covariance``), float32: ``G D (D + 1) + 1``
    floats per KV head and row (a 64-wide head with a group of 3: as many bytes as 195 tokens' bfloat16 keys
    and values), reported in ``run.stats()``'s ``state_bytes``. It needs the model's rotary table, which
    ``evictlayers.apply`` measures at apply time (``hf/rotary.py``; a model whose rotation no table reproduces
    is refused), and cannot be combined with ``positions="rolling"``.
    """

    param_names = ("n_future_positions", "n_sink", "use_covariance", "use_vnorm", "epsilon")
    reads_mass = False  # queries, keys and values only
    reads_keys = True  # the arriving keys (a multi-token step: every held key)
    reads_values = True  # the arriving values' norms
    reads_queries = True

    def __init__(
        self, n_future_positions: int = 512, n_sink: int = 4, use_covariance: bool = True, use_vnorm: bool = True,
        epsilon: float = 0.0,
    ):
        super().__init__()
        self.n_future_positions = _check_int("n_future_positions", n_future_positions, 1)
        self.n_sink = _check_int("n_sink", n_sink, 0)
        self.use_covariance = _check_bool("use_covariance", use_covariance)
        self.use_vnorm = _check_bool("use_vnorm", use_vnorm)
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0 <= epsilon < math.inf:
            raise ValueError(f"ExpectedAttention(epsilon={epsilon!r}): epsilon must be a finite number >= 0")
        self.epsilon = float(epsilon)

    @property
    def rotary_rows(self) -> int:  # type: ignore[override]
        return self.n_future_positions  # A averages rows 0..T-1

    @property
    def state_specs(self) -> dict[str, tuple]:  # type: ignore[override]
        return {LOGIT: ("group",), **({VALUE_NORM: ()} if self.use_vnorm else {})}

    @property
    def head_state_specs(self) -> dict[str, tuple]:  # type: ignore[override]
        moments = {M2: ("group", "head_dim", "head_dim")} if self.use_covariance else {}
        return {COUNT: (), MEAN: ("group", "head_dim"), **moments}

    # ---- update: fold the step's queries in, score the keys ---------------------------------------

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        if observation.queries is None or observation.query_pos is None or observation.rotary is None:
            raise ValueError(
                "ExpectedAttention reads the step's queries and the layer's rotary table: its Observation needs "
                "`queries`, `query_pos` and `rotary` (the slot store gives them to a policy that reads queries)"
            )
        cos, sin = observation.rotary
        batch, kv_heads, q_heads = view.pos.shape[0], view.pos.shape[1], observation.queries.shape[1]
        _, _, q_len, dim = observation.queries.shape
        queries = observation.queries.float().view(batch, kv_heads, q_heads // kv_heads, q_len, dim)
        self._fold(state, queries, observation.query_pos, view.seen, cos, sin)
        scaling = observation.scaling if observation.scaling is not None else dim ** -0.5
        index = observation.inserted
        rows = torch.arange(batch, device=index.device)[:, None, None].expand_as(index)
        heads = torch.arange(kv_heads, device=index.device)[None, :, None].expand_as(index)
        if index.shape[-1] == 1:  # a one-token step: its key is scored on arrival, held slots keep theirs
            keys, _ = inserted_keys(observation, view, "ExpectedAttention")
            # index_put_ writes in place under torch.compile (a functionalised scatter_ copies the buffer)
            state[LOGIT].index_put_((rows, heads, index), self._logits(state, keys, cos, sin, scaling))
        else:  # a multi-token step: every held slot again, with the statistics so far
            if view.keys is None:
                raise ValueError("ExpectedAttention scores keys: its SlotView needs `keys` (the slot store gives them)")
            for start in range(0, view.keys.shape[2], SLOT_BLOCK):
                block = view.keys[:, :, start : start + SLOT_BLOCK].float()
                state[LOGIT][:, :, start : start + SLOT_BLOCK] = self._logits(state, block, cos, sin, scaling)
        if self.use_vnorm:
            if observation.values is None:
                raise ValueError("ExpectedAttention weighs by ||v||: its Observation needs `values`")
            values = observation.values.gather(2, along_slots(index, observation.values))
            state[VALUE_NORM].index_put_((rows, heads, index), values.float().norm(dim=-1))

    def _fold(
        self, state: dict[str, torch.Tensor], queries: torch.Tensor, query_pos: torch.Tensor, seen: torch.Tensor,
        cos: torch.Tensor, sin: torch.Tensor,
    ) -> None:
        """Merge the step's queries ``[B, H_kv, G, Q, D]`` at ``query_pos`` ``[B, Q]`` into the statistics, in
        place, all in the frame of the next position ``seen`` ``[B]``."""
        last = cos.shape[0] - 1
        advance = (query_pos >= 0).sum(1).clamp(max=last)  # [B] real tokens: the frame moves by as many positions
        turn = cos[advance][:, None, None], sin[advance][:, None, None]  # [B, 1, 1, R]
        mean = rotate(state[MEAN], *turn)
        counted = query_pos >= self.n_sink  # [B, Q]; padding (-1) never counts
        offset = (seen[:, None] - query_pos).clamp(0, last)  # [B, Q]: R(t0 - p) q_p = R(t0) q
        framed = rotate(queries, cos[offset][:, None, None], sin[offset][:, None, None])
        mask = counted[:, None, None, :, None]
        framed = torch.where(mask, framed, 0.0)  # a padding query may hold anything
        step_count = counted.sum(1).to(framed.dtype)[:, None]  # [B, 1]
        step_mean = framed.sum(3) / step_count.clamp(min=1)[..., None, None]  # [B, H, G, D]
        held = state[COUNT]  # [B, H]
        total = held + step_count
        delta = step_mean - mean
        share = (step_count / total.clamp(min=1))[..., None, None]
        if self.use_covariance:
            m2 = _turn_both(state[M2], turn[0][..., None, :], turn[1][..., None, :])
            if queries.shape[3] > 1:  # one query is its own mean: no spread of its own
                centred = torch.where(mask, framed - step_mean[..., None, :], 0.0)
                m2 = m2 + centred.transpose(-1, -2) @ centred
            cross = (held * step_count / total.clamp(min=1))[..., None, None, None]
            state[M2].copy_(m2 + delta[..., :, None] * delta[..., None, :] * cross)
        state[MEAN].copy_(mean + delta * share)
        state[COUNT].copy_(total)

    def _logits(
        self, state: dict[str, torch.Tensor], keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """``[B, H_kv, n, G]`` expected log-attention of each query head of the group for ``keys``
        ``[B, H_kv, n, D]`` (post-RoPE), over the next ``n_future_positions`` positions."""
        future = self.n_future_positions
        unturned = rotate(keys, cos[:future].mean(0), -sin[:future].mean(0))  # A^T k
        logit = scaling * torch.einsum("bhnd,bhgd->bhng", unturned, state[MEAN])
        if self.use_covariance:
            covariance = state[M2] / state[COUNT].clamp(min=1)[..., None, None, None]  # biased, as kvpress
            spread = torch.einsum("bhgde,bhne->bhngd", covariance, unturned)
            logit = logit + 0.5 * scaling**2 * (spread * unturned[:, :, :, None]).sum(-1)
        return logit

    # ---- score: normalise over the held slots, the group's mean, the value norm --------------------

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        logit = state[LOGIT]  # [B, H, N, G]
        counted = view.valid & (view.pos >= self.n_sink)
        if view.stale is not None:
            counted = counted & ~view.stale
        masked = logit.masked_fill(~counted[..., None], -math.inf)
        top = masked.amax(2, keepdim=True)
        top = torch.where(torch.isfinite(top), top, 0.0)  # a head with nothing to normalise over
        weight = torch.exp(masked - top)
        score = (weight / weight.sum(2, keepdim=True).clamp(min=torch.finfo(weight.dtype).tiny)).mean(-1)
        if self.use_vnorm:
            score = (score + self.epsilon) * state[VALUE_NORM]
        if self.n_sink:  # the first tokens stay, above every other slot of their head (kvpress: max + 1)
            sinks = view.valid & (view.pos < self.n_sink)
            score = torch.where(sinks, score.amax(-1, keepdim=True) + 1.0, score)
        return score
