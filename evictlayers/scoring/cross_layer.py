"""Cross-layer ranking: every layer ranks its tokens by what a few chosen layers' last query attends to."""

from __future__ import annotations

import torch

from evictlayers.scoring.accumulator import ScoreAccumulator
from evictlayers.scoring.view import Observation, SlotView


class CrossLayer(ScoreAccumulator):
    """``s_j = max_{l in layers} max_h a^{(l, h)}_{n, j}``: the largest attention the last query of a
    multi-token step (the prompt's last token, which asks the question) gives token ``j`` in any KV head
    of the ranking ``layers``; every layer of the model ranks its own copy of token ``j`` by it.

    Why: a needle dump (``python -m research.needles --task ruler``, a research command of the repository)
    finds that SmolLM2-135M reads an answer in a few late layers, yet answers only when the value is held
    whole in many layers: each layer ranking by its own attention keeps the value in too few of them. A
    ranking shared by every layer keeps the same spans everywhere. Beside it in the policy, a layer's own
    selector (a share of the slots) keeps what only that layer needs.

    Related work: GemFilter (Shi et al. 2024, arXiv:2409.17422, Algorithm 1) selects the prompt's top
    tokens by one filter layer's last-query attention, summed over its heads, and runs the whole model
    again on them. Deviations: no second pass (each layer keeps its own keys and values of the chosen
    tokens), several ranking layers and heads combined by their maximum (a token one retrieval head reads
    is not outvoted), and the ranking layers are chosen on a tuning split rather than early in the model.

    ``layers``: the ranking layers' indices (negative ones count from the end, as Python's do). Which layers
    read a model's answers is the model's own: ``python -m research.needles full --task ruler --split tuning``
    prints, per layer, the share of query heads whose last-query attention ranks an answer's value whole, and the
    layers with at least half the largest share (SmolLM2-135M: layers 21 and 22; RazorAttention's induction
    layers, 17, 18 and 23, rank far worse there, docs/benchmarks.md). A layer before the last of them cannot
    evict until they have run, so at a multi-token step it holds its whole step (as transformers' own cache
    does) until then: the prefill's peak memory is the full cache of those layers. The slot store fills the
    score at each multi-token step (``SlotView.cross_layer``).

    A token that arrives at a one-token step (a generated token) scores 1, the most attention a query can
    give one token, so while generating a layer gives up its lowest-ranked prompt tokens before any of the
    text it is writing, as GemFilter generates with every generated token held: a list the model is writing
    out (several values, several keys' answers) stays whole. In a stream fed one token at a time every token
    scores 1, and the oldest unprotected one goes first (what a recent window keeps).
    """

    param_names = ("layers",)
    reads_mass = False  # the last query row only
    rows_needed = 1
    state_specs = {"cross_layer": ()}

    def __init__(self, layers: list[int] | tuple[int, ...]):
        super().__init__()
        bad = not isinstance(layers, (list, tuple)) or not layers or any(
            isinstance(index, bool) or not isinstance(index, int) for index in layers
        )
        if bad or len(set(layers)) != len(layers):
            raise ValueError(
                f"CrossLayer(layers={layers!r}): expected a non-empty list of distinct layer indices (ints; a "
                "negative one counts from the last layer)"
            )
        self.layers = list(layers)

    def resolve(self, num_layers: int) -> tuple[int, ...]:
        """The ranking layers as indices in ``[0, num_layers)``, in model order."""
        out_of_range = [index for index in self.layers if not -num_layers <= index < num_layers]
        if out_of_range:
            raise ValueError(
                f"CrossLayer(layers={self.layers}): {out_of_range} not a layer of a {num_layers}-layer model "
                f"(allowed: {-num_layers}..{num_layers - 1})"
            )
        resolved = sorted({index % num_layers for index in self.layers})
        if len(resolved) != len(self.layers):
            raise ValueError(f"CrossLayer(layers={self.layers}): names a layer twice in a {num_layers}-layer model")
        return tuple(resolved)

    GENERATED = 1.0  # a generated token's score: no prompt token can be given more

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        """Every new token scores ``GENERATED``; at a multi-token step ``prepare`` then gives each held token
        the ranking layers' score."""
        state["cross_layer"].scatter_(2, observation.inserted, self.GENERATED)

    def prepare(self, state: dict[str, torch.Tensor], view: SlotView) -> None:
        if view.cross_layer is None:
            raise ValueError(
                "CrossLayer ranks by other layers' attention, so the layers' slot stores must share one "
                "CrossLayerBoard: run the policy under evictlayers.apply (EvictionCache makes one), or pass "
                "SlotStore(board=CrossLayerBoard(...)) to every layer"
            )
        held = view.pos >= 0
        by_position = view.cross_layer[:, None, :].expand(*view.pos.shape[:2], -1)
        score = by_position.gather(2, view.pos.clamp(min=0))
        state["cross_layer"].copy_(torch.where(held, score, 0.0))

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        return state["cross_layer"]
