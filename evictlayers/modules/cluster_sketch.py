"""ClusterGen (Algorithm 1 of "ClusterGen: token generation in sublinear time and memory with
clustering KV cache", shared/seeds/004) on fixed-size buffers: a sketch that absorbs the tokens the
slot store evicts instead of forgetting them. (The greedy k-center selector of its Sec. 4 is
``modules/kcenter_selector.py``.)

Per (batch row, KV head) the sketch holds

- ``D`` (UpdateSoftmaxNormalizer, lines 11-21): at most ``M`` clusters, each a representative key
  ``x_i`` (the first key assigned to it), a count ``n_i`` and ``t`` uniform reservoir samples ``S_i``
  of its keys; a key joins the nearest representative if it lies within ``delta`` of it, otherwise it
  opens a new cluster holding ``t`` copies of itself;
- ``M`` (UpdateMatrixProduct, lines 23-27): ``s`` i.i.d. samples of ``(k, v)`` drawn with
  probability proportional to ``||v||^2`` by reservoir sampling, and ``mu = sum ||v||^2`` (line 6);

and QueryStreamAttn (lines 28-30) estimates ``exp(K q)^T V`` by
``z = sum_{(k,v) in M} mu / (s ||v||^2) exp(<q,k>) v`` and the partition function by
``tau = sum_i n_i / t sum_{k in S_i} exp(<q,k>)``. Here the sketch only holds the evicted tokens;
the retained slots are attended exactly and both parts are merged through numerators and normalisers
(``sketch_terms`` + ``merge_with_exact``): the exact attention's sums are added to the sketch's ``z``
and ``tau``, both scaled by one common maximum, so the kernels that attend over the slots need not know
the sketch exists (docs/architecture.md, "ClusterGen in the step").

Deviations from the paper, each for the fixed shapes a compiled decode step needs:

1. Bounded cluster count. Algorithm 1 opens a cluster whenever a key is farther than ``delta`` from
   every representative, so ``D`` grows with the number of clusters the stream needs. The buffers hold
   at most ``max_clusters``; once all are in use, such a key joins its *nearest* cluster (its count
   and reservoir are updated as in lines 13-17) and ``SketchState.overflow`` counts it. While the keys
   are ``(max_clusters, delta)``-clusterable this never happens (Theorem 2.4's memory argument, lines
   304-310); when it does, that cluster's samples span more than ``2 delta`` and the ``e^{2 delta r}``
   factor of Theorem 2.4 no longer bounds its spread.
2. Randomness. The coins of lines 16 and 25 come from a counter-based hash of (seed, layer, KV head,
   token index in the head's absorbed stream, coin index), not from a ``torch.Generator``
   (``modules/sketch_coins.py`` says why). Each absorbed token uses ``t + s`` coins: ``t`` for its
   cluster's reservoir, ``s`` for ``M``.
3. Logits. The paper writes ``exp(<q, k>)``; the model's logits are ``scaling * <q, k>``, so the
   sketch uses those and Theorem 2.4's ``r`` is ``scaling * ||q||``.
4. Ties. Distances that differ by less than a relative ``TIE_TOLERANCE`` (1e-4) count as equal and go
   to the lowest index (the nearest cluster of line 11; ``core/ties.py`` says why).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from evictlayers.core import Component
from evictlayers.core.ties import first_near_min
from evictlayers.modules.sketch_coins import _MASK32, CoinTable, layer_salt, sketch_uniforms


@dataclass
class SketchState:
    """Fixed-size sketch buffers of one layer, allocated once by ``ClusterSketch.allocate``.

    Per (batch row ``B``, KV head ``H``); ``M`` = max clusters, ``t`` = samples per cluster,
    ``s`` = value samples, ``D``/``D_v`` = key/value head dims. Nothing here grows with the stream.

    Attributes:
        representatives: ``[B, H, M, D]`` ``x_i``, the first key of each cluster (Alg. 1 line 20).
        counts: ``[B, H, M]`` int64 ``n_i``, keys assigned to each cluster (0 = not in use).
        active: ``[B, H, M]`` bool, cluster in use.
        cluster_samples: ``[B, H, M, t, D]`` ``S_i``, uniform reservoir samples of each cluster's keys.
        pair_keys: ``[B, H, s, D]`` keys of ``M``'s samples (Alg. 1 line 25).
        pair_values: ``[B, H, s, D_v]`` values of ``M``'s samples.
        pair_weights: ``[B, H, s]`` float64 ``||v||^2`` of each sample; 0 = the paper's ``null``.
        mu: ``[B, H]`` float64 ``sum ||v||^2`` over the absorbed stream (line 6); float64 because it
            sums the whole stream and every coin of line 25 divides by it.
        absorbed: ``[B, H]`` int64 tokens absorbed, the counter the coins are keyed by.
        overflow: ``[B, H]`` int64 tokens that joined their nearest cluster although farther than
            ``delta`` from it, because all ``M`` clusters were in use (deviation 1 of the module).
        salt: 32-bit word the coins of this layer start from (seed and layer).
    """

    representatives: torch.Tensor
    counts: torch.Tensor
    active: torch.Tensor
    cluster_samples: torch.Tensor
    pair_keys: torch.Tensor
    pair_values: torch.Tensor
    pair_weights: torch.Tensor
    mu: torch.Tensor
    absorbed: torch.Tensor
    overflow: torch.Tensor
    salt: int

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer by field name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "salt"}

    def index_select_batch(self, index: torch.Tensor) -> SketchState:
        """The sketch with its rows reordered (or repeated): row ``i`` becomes row ``index[i]``."""
        return replace(self, **{name: t.index_select(0, index) for name, t in self.tensors().items()})


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ClusterSketch({name}={value!r}): {name} must be an int >= 1")
    return value


class ClusterSketch(Component):
    """ClusterGen's stream sketch (Algorithm 1): what happens to an evicted token. Instead of being
    forgotten, each token eviction frees is absorbed into fixed-size per-head buffers, and attention is
    the exact slots merged with the sketch. It is no selector: the policy's protections and selectors
    say which tokens stay exact (ClusterGen keeps the most recent ones). ClusterGen's k-center selection
    (Sec. 4) is ``KCenterSelector``.

    Args:
        radius: ``delta`` of Algorithm 1 line 12, a Euclidean distance in the (post-RoPE) key space: a
            key joins a cluster whose representative is within ``radius``.
        samples_per_cluster: ``t``, uniform key samples kept per cluster (Theorem 2.4:
            ``t = Omega(eps^-2 e^{2 delta r} log n)``).
        value_samples: ``s``, ``||v||^2``-weighted ``(k, v)`` samples per head
            (Theorem 2.4: ``s = Omega(eps^-2 d)``).
        max_clusters: ``M``, the most clusters a head holds (deviation 1 of the module docstring).
        seed: int in ``[0, 2**32)``, keys every coin (with the layer index given to ``allocate``).
    """

    param_names = ("radius", "samples_per_cluster", "value_samples", "max_clusters", "seed")

    def __init__(
        self,
        radius: float,
        samples_per_cluster: int = 8,
        value_samples: int = 64,
        max_clusters: int = 64,
        seed: int = 0,
    ):
        super().__init__()
        if isinstance(radius, str):
            raise TypeError(
                f"ClusterSketch({radius!r}): ClusterSketch is the stream sketch only and takes no mode; greedy "
                "k-center selection (ClusterGen Sec. 4) is KCenterSelector(centres=...)"
            )
        if isinstance(radius, bool) or not isinstance(radius, (int, float)) or not 0 < radius < float("inf"):
            raise ValueError(f"ClusterSketch(radius={radius!r}): radius must be a finite number > 0 (delta)")
        _check_positive_int("samples_per_cluster", samples_per_cluster)
        _check_positive_int("value_samples", value_samples)
        _check_positive_int("max_clusters", max_clusters)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MASK32:
            raise ValueError(f"ClusterSketch(seed={seed!r}): seed must be an int in [0, 2**32)")
        self.radius = radius
        self.samples_per_cluster = samples_per_cluster
        self.value_samples = value_samples
        self.max_clusters = max_clusters
        self.seed = seed

    def allocate(
        self,
        batch: int,
        heads: int,
        head_dim: int,
        value_dim: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        layer: int = 0,
    ) -> SketchState:
        """Empty sketch buffers for ``heads`` KV heads of ``batch`` rows; keys and values are held in
        ``dtype`` (the cache dtype). ``layer`` enters the coins so that layers sample independently."""
        t, s, m = self.samples_per_cluster, self.value_samples, self.max_clusters
        bh = (batch, heads)

        def zeros(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return SketchState(
            representatives=zeros(*bh, m, head_dim),
            counts=zeros(*bh, m, dtype=torch.int64),
            active=zeros(*bh, m, dtype=torch.bool),
            cluster_samples=zeros(*bh, m, t, head_dim),
            pair_keys=zeros(*bh, s, head_dim),
            pair_values=zeros(*bh, s, value_dim),
            pair_weights=zeros(*bh, s, dtype=torch.float64),
            mu=zeros(*bh, dtype=torch.float64),
            absorbed=zeros(*bh, dtype=torch.int64),
            overflow=zeros(*bh, dtype=torch.int64),
            salt=layer_salt(self.seed, layer),
        )

    def coin_table(self, state: SketchState, width: int) -> CoinTable:
        """The coins of the next ``width`` tokens every head of ``state`` absorbs (see ``CoinTable``)."""
        counters = state.absorbed[..., None] + torch.arange(width, device=state.absorbed.device)
        uniforms = sketch_uniforms(state.salt, counters, self.samples_per_cluster + self.value_samples)
        return CoinTable(uniforms=uniforms, base=state.absorbed.clone())

    def absorb(
        self,
        state: SketchState,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        coins: CoinTable | None = None,
    ) -> None:
        """Feed evicted tokens to the sketch, in order, in place (Algorithm 1 lines 4-6).

        Args:
            state: the layer's sketch.
            keys: ``[B, H, K, D]`` keys of the evicted tokens (post-RoPE, as the slots held them).
            values: ``[B, H, K, D_v]`` their values.
            mask: ``[B, H, K]`` bool, ``False`` = not a token (nothing evicted there, padding): skipped,
                and it consumes no coins.
            coins: a ``CoinTable`` covering the counters this call reaches, or ``None`` to hash them.

        Every op has a fixed shape and there is no host synchronisation, so this traces into a
        compiled decode step; the loop over ``K`` unrolls (``K`` is 1 while decoding).
        """
        batch, heads, m, head_dim = state.representatives.shape
        value_dim = state.pair_values.shape[-1]
        count = keys.shape[2] if keys.dim() == 4 else -1
        expected = {
            "keys": (keys, (batch, heads, count, head_dim)),
            "values": (values, (batch, heads, count, value_dim)),
            "mask": (mask, (batch, heads, count)),
        }
        for name, (tensor, shape) in expected.items():
            if tuple(tensor.shape) != shape:
                raise ValueError(f"absorb: {name} has shape {tuple(tensor.shape)}, expected {shape} for this sketch")
        if mask.dtype != torch.bool:
            raise ValueError(f"absorb: mask must be bool, got {mask.dtype}")
        for i in range(count):
            self._absorb_one(state, keys[:, :, i], values[:, :, i], mask[:, :, i], coins)

    def _absorb_one(
        self, state: SketchState, key: torch.Tensor, value: torch.Tensor, real: torch.Tensor, table: CoinTable | None
    ) -> None:
        """One token per head: ``key [B, H, D]``, ``value [B, H, D_v]``, ``real [B, H]``."""
        t, s = self.samples_per_cluster, self.value_samples
        batch, heads, _, head_dim = state.representatives.shape
        # scatter_ needs the buffers' dtype; ||v||^2 is then that of the value as the sketch holds it
        key, value = key.to(state.representatives.dtype), value.to(state.pair_values.dtype)
        if table is None:
            coins = sketch_uniforms(state.salt, state.absorbed, t + s)  # [B, H, t + s]
        else:
            coins = table.draw(state.absorbed)

        # UpdateSoftmaxNormalizer (lines 11-21): nearest representative, within delta or a new cluster.
        dist2 = (state.representatives.float() - key.float()[:, :, None]).square().sum(-1)
        dist2 = dist2.masked_fill(~state.active, float("inf"))  # [B, H, M]
        nearest = first_near_min(dist2)  # deviation 4: near-ties go to the lowest index
        within = dist2.gather(-1, nearest[..., None]).squeeze(-1) <= self.radius**2
        full = state.active.all(-1)
        opens = real & ~within & ~full
        state.overflow.add_(real & ~within & full)
        # clusters are never released, so the first free one is the next in creation order
        target = torch.where(opens, (~state.active).long().argmax(-1), nearest)[..., None]  # [B, H, 1]

        count = state.counts.gather(-1, target) + real[..., None]  # n_{i*} after line 13 / 20
        state.counts.scatter_(-1, target, count)
        state.active.scatter_(-1, target, state.active.gather(-1, target) | opens[..., None])
        rep_index = target[..., None].expand(batch, heads, 1, head_dim)
        rep = torch.where(opens[..., None, None], key[:, :, None], state.representatives.gather(2, rep_index))
        state.representatives.scatter_(2, rep_index, rep)
        # Line 16: replace each sample with probability 1 / n_{i*}. A new cluster has n = 1, so all t
        # entries become the key: line 19's t copies, with no separate branch.
        replace = real[..., None] & (coins[..., :t] < 1.0 / count.clamp(min=1).double())  # [B, H, t]
        sample_index = target[..., None, None].expand(batch, heads, 1, t, head_dim)
        samples = state.cluster_samples.gather(2, sample_index)
        samples = torch.where(replace[:, :, None, :, None], key[:, :, None, None, :], samples)
        state.cluster_samples.scatter_(2, sample_index, samples)

        # UpdateMatrixProduct (lines 23-27) with the mu before this token, then line 6.
        weight = value.float().square().sum(-1).double()  # [B, H]
        total = state.mu + weight
        # all-zero values so far: nothing to sample (p = 0/0); null entries keep weight 0
        keep_prob = torch.where(total > 0, weight / total, 0.0)
        take = real[..., None] & (coins[..., t:] < keep_prob[..., None])  # [B, H, s]
        state.pair_keys.copy_(torch.where(take[..., None], key[:, :, None], state.pair_keys))
        state.pair_values.copy_(torch.where(take[..., None], value[:, :, None], state.pair_values))
        state.pair_weights.copy_(torch.where(take, weight[..., None], state.pair_weights))
        state.mu.add_(torch.where(real, weight, 0.0))
        state.absorbed.add_(real)

    def sketch_terms(
        self,
        state: SketchState,
        query: torch.Tensor,
        scaling: float,
        group_size: int = 1,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sketched sums of QueryStreamAttn (Algorithm 1 lines 28-29), scaled for log-sum-exp merging.

        Args:
            state: the layer's sketch.
            query: ``[B, H_q, D]`` post-RoPE query, ``H_q = H * group_size`` (GQA: the query heads of a
                group share their KV head's sketch).
            scaling: logit scale; the sketch's logits are ``scaling * <q, k>`` like the exact slots'.
            group_size: query heads per KV head.
            softcap: Gemma2-style ``tanh(x / c) * c`` on the scaled logits, as the exact slots apply it:
                both estimators of Algorithm 1 are sums of ``f(<q, k>)`` over sampled keys, so they stay
                estimators of the capped sums when ``f`` is the capped exponential.

        Returns:
            ``(numerator [B, H_q, D_v], normaliser [B, H_q], log_scale [B, H_q])``, float32, with
            ``z = numerator * exp(log_scale)`` (line 28) and ``tau = normaliser * exp(log_scale)``
            (line 29). ``log_scale`` is the largest exponent of either sum, so neither overflows; an
            empty sketch gives ``(0, 0, -inf)``. ``z / tau`` is Algorithm 1's output (line 30).
        """
        batch, heads, m, t, head_dim = state.cluster_samples.shape
        if query.dim() != 3 or tuple(query.shape) != (batch, heads * group_size, head_dim):
            raise ValueError(
                f"sketch_terms: query has shape {tuple(query.shape)}, expected "
                f"{(batch, heads * group_size, head_dim)} (group_size={group_size} query heads per KV head)"
            )
        q = query.float().view(batch, heads, group_size, head_dim)
        # line 29: log(n_i / t) + scaling <q, k> for every sample of every cluster in use
        cluster_logits = _capped(torch.einsum("bhgd,bhmtd->bhgmt", q, state.cluster_samples.float()) * scaling, softcap)
        cluster_log_weight = torch.where(state.active, (state.counts.float() / t).log(), float("-inf"))
        cluster_exps = cluster_logits + cluster_log_weight[:, :, None, :, None]
        # line 28: log(mu / (s ||v||^2)) + scaling <q, k> for every non-null sample of M
        held = state.pair_weights > 0
        pair_log_weight = (state.mu[..., None] / (self.value_samples * state.pair_weights)).log().float()
        pair_log_weight = torch.where(held, pair_log_weight, float("-inf"))
        pair_logits = _capped(torch.einsum("bhgd,bhsd->bhgs", q, state.pair_keys.float()) * scaling, softcap)
        pair_exps = pair_logits + pair_log_weight[:, :, None]

        log_scale = torch.maximum(cluster_exps.flatten(-2).amax(-1), pair_exps.amax(-1))  # [B, H, G]
        # an empty sketch has log_scale = -inf; shift by 0 there so exp(-inf - shift) stays 0, not NaN
        shift = torch.where(torch.isfinite(log_scale), log_scale, 0.0)
        normaliser = (cluster_exps - shift[..., None, None]).exp().flatten(-2).sum(-1)
        numerator = torch.einsum("bhgs,bhsv->bhgv", (pair_exps - shift[..., None]).exp(), state.pair_values.float())
        q_heads = heads * group_size
        return (
            numerator.reshape(batch, q_heads, -1),
            normaliser.reshape(batch, q_heads),
            log_scale.reshape(batch, q_heads),
        )

    def stats(self, state: SketchState) -> dict[str, torch.Tensor | int]:
        """What the sketch holds: ``clusters_in_use``, ``key_samples_held`` (``t`` per cluster in use),
        ``value_samples_held`` (non-null entries of ``M``), ``absorbed`` and ``overflow`` tokens, each
        ``[B, H]`` int64, and ``bytes``: the size of every buffer, fixed at allocation."""
        clusters = state.active.sum(-1)
        return {
            "clusters_in_use": clusters,
            "key_samples_held": clusters * self.samples_per_cluster,
            "value_samples_held": (state.pair_weights > 0).sum(-1),
            "absorbed": state.absorbed.clone(),
            "overflow": state.overflow.clone(),
            "bytes": sum(x.numel() * x.element_size() for x in state.tensors().values()),
        }


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def merge_with_exact(
    exact_out: torch.Tensor,
    exact_lse: torch.Tensor,
    numerator: torch.Tensor,
    normaliser: torch.Tensor,
    log_scale: torch.Tensor,
) -> torch.Tensor:
    """Attention over the exact slots plus the sketch of the evicted tokens, in one log-sum-exp-safe step.

    Args:
        exact_out: ``[B, H_q, D_v]`` softmax attention over the retained slots.
        exact_lse: ``[B, H_q]`` log-sum-exp of those slots' scaled logits (``-inf`` if none is visible).
        numerator, normaliser, log_scale: ``ClusterSketch.sketch_terms`` for the same query.

    With ``den_exact = exp(exact_lse)``, ``num_exact = exact_out * den_exact`` and ``c = max(exact_lse,
    log_scale)``, the result is
    ``(num_exact e^{-c} + numerator e^{log_scale - c}) / (den_exact e^{-c} + normaliser e^{log_scale - c})``:
    the exact sums plus Algorithm 1's ``z`` and ``tau`` (an empty sketch returns ``exact_out``; a query
    that sees nothing at all returns zeros). Returned in ``exact_out``'s dtype.
    """
    top = torch.maximum(exact_lse.float(), log_scale)
    top = torch.where(torch.isfinite(top), top, 0.0)
    exact_weight = (exact_lse.float() - top).exp()  # den_exact / e^c
    sketch_weight = (log_scale - top).exp()
    # an empty exact part may carry a NaN or garbage output; its weight is 0, so drop it explicitly
    exact_part = torch.where(exact_weight[..., None] > 0, exact_out.float() * exact_weight[..., None], 0.0)
    num = exact_part + numerator * sketch_weight[..., None]
    den = exact_weight + normaliser * sketch_weight
    out = torch.where(den[..., None] > 0, num / den.clamp(min=torch.finfo(den.dtype).tiny)[..., None], 0.0)
    return out.to(exact_out.dtype)
