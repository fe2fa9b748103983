"""KVzip's score (Kim et al. 2025, arXiv:2505.23416): the attention a cached token gets while the model
reconstructs the context from the cache."""

from __future__ import annotations

import torch

from evictlayers.scoring.accumulator import ScoreAccumulator
from evictlayers.scoring.view import Observation, SlotView


class ContextReconstruction(ScoreAccumulator):
    """``S_{l,h}[i] = max_{g, t} A_{l,h}[g, t, i]``: the most attention any query head ``g`` of KV head ``h``'s
    GQA group gives context token ``i`` at any reconstruction query ``t``, where the reconstruction is the
    repeat prompt followed by the context itself, teacher-forced over the context's cache.

    KVzip (Sec. 3) asks for a compressed cache ``KV_c'`` that answers any query as the full ``KV_c`` does
    (Eq. 1), and proxies it by what the model needs to reconstruct the context ``c`` from the cache: the input
    ``"Repeat the previous context exactly." + c`` (``n_in = n_prompt + n_c`` tokens) runs over ``KV_c``, each
    layer ``l`` and KV head ``h`` computes ``A_{l,h} = Softmax(Q_{l,h} [K_c; K_in]^T)`` (``G x n_in x
    (n_c + n_in)``: the context's keys and, causally, the input's own), and a context pair's score is the
    maximum above over the group and the queries; the lowest-scored pairs are evicted and the reconstruction's
    own keys and values discarded, so one compressed cache serves every later question. Long contexts are
    reconstructed in chunks of ``m`` tokens (the authors' code: ``m = 2000``), each chunk after its own repeat
    prompt; the chunk after the first is prompted "Repeat the part of the previous context exactly, starting
    with " and the previous chunk's last 8 tokens.

    Here the reconstruction is a probe of the slot store (``Observation.probe``, ``SlotStore.probing``): its
    tokens attend and are never stored. The state is a running maximum over every probe row, each row reduced
    over the GQA group by its maximum (the kernels' ``gqa_reduce``, so the policy must say
    ``Policy(gqa_reduce="max")``, checked when the policy is built). ``EvictionRun.compress_context`` runs the
    whole procedure: the context prefilled with eviction deferred (``SlotStore.defer``), the probes, then each
    head keeps its ``budget`` best (``SlotStore.evict_deferred``). A token arriving while eviction is deferred
    (the context) starts at 0, so the probes alone score it.

    A token that arrives at a step that may evict (a question after the compressed context, a generated token)
    scores 1, at least what any context token can get (a probability), and ties go oldest first: while the
    budget binds, the lowest-scored context tokens leave first, one per token written, and the question and
    answer stay whole. KVzip itself appends the question and answer to the pruned cache, unbounded, and drops
    them afterwards; under the slot store's budget this is the nearest (as ``CrossLayer`` ranks generated
    tokens).

    Deviations from KVzip:

    - per-head uniform budgets (every KV head of a layer keeps ``budget`` tokens; the layers' split is the
      policy's allocation), where KVzip's default is one global top-k over every layer and head (non-uniform;
      its ``uniform`` level is this one): the slot store is a rectangle (docs/architecture.md, "Not built:
      Ada-KV's head-adaptive budgets");
    - chunks: each chunk's probe attends over the whole context cache and the probe's own tokens, its
      probabilities normalised over all of them, and it scores every context token (the maximum over chunks);
      the authors' code normalises each chunk's scoring softmax over the system prompt, that chunk's context
      tokens and the probe's own tokens only, and scores each token by its own chunk. With one chunk (a context
      of at most ``m`` tokens) both are the formula above exactly;
    - the authors never evict the chat template's system prompt before the context; the shipped recipe keeps 4
      attention sinks instead (``SinkTokens``; the caller's context may or may not start with a system prompt);
    - the probabilities are float32 from the model's logits (the authors' softmax runs in the model's dtype).

    Without probes the score means nothing: a policy holding it refuses a budgeted cache whose first step does
    not defer eviction (``requires_probes``), so plain ``generate()`` raises ``ValueError`` naming
    ``run.compress_context``.
    """

    reads_mass = False  # the probe rows only
    observes_probes = True
    requires_probes = True
    needs_gqa_reduce = "max"
    state_specs = {"reconstruction": ()}

    ARRIVED = 1.0  # a token arriving at a step that may evict: no context token can score more

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        score = state["reconstruction"]
        if observation.probe:
            if observation.rows.shape[2]:  # padding rows are zero: they lower no maximum of probabilities
                torch.maximum(score, observation.rows.amax(2).to(score.dtype), out=score)
            return
        if not observation.deferred:  # a deferred token keeps the 0 of a new slot until the probes score it
            score.scatter_(2, observation.inserted, self.ARRIVED)

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        return state["reconstruction"]
