"""The board the layers of one cache share for ``CrossLayer``: the ranking layers' last-query attention
by original position, gathered during a multi-token step, and the layers waiting for it.

Layers run in model order, so at a multi-token step a layer before the last ranking layer cannot rank
yet: it hands the board the rest of its step (``wait``) and holds its whole step until the last ranking
layer has published, when the board finishes them all (``publish``). Layers after it rank at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class CrossLayerBoard:
    """One per cache (``EvictionCache`` makes it when a policy holds ``CrossLayer``).

    ``layers``: the ranking layers, resolved to ``[0, num_layers)`` (``CrossLayer.resolve``).
    """

    def __init__(self, layers: tuple[int, ...]):
        if not layers:
            raise ValueError("CrossLayerBoard: expected at least one ranking layer")
        self.layers = frozenset(layers)
        self.last = max(layers)
        self.reset()

    def reset(self) -> None:
        """Forget the current step: scores, what was published, and who waits."""
        self.scores: torch.Tensor | None = None  # [B, P] float32, P = the most real tokens any row has seen
        self.published: set[int] = set()
        self.waiting: dict[int, Callable[[torch.Tensor], None]] = {}  # layer index -> what finishes its step

    @property
    def complete(self) -> bool:
        """Every ranking layer has published this step's scores."""
        return self.published == self.layers

    def begin(self, layer_idx: int) -> None:
        """A multi-token step starts in layer ``layer_idx``: the first layer up to the last ranking layer to
        start after a complete board opens a new step (a chunked prefill's next chunk, a later turn)."""
        if self.complete and layer_idx <= self.last:
            self.reset()
        elif layer_idx > self.last and not self.complete:
            missing = sorted(self.layers - self.published)
            raise RuntimeError(
                f"CrossLayer: layer {layer_idx} ran a multi-token step before ranking layers {missing} did; the "
                "ranking layers must run evictlayers' attention in every forward (are they attention layers?)"
            )

    def publish(self, layer_idx: int, last_row: torch.Tensor, pos: torch.Tensor, seen: torch.Tensor) -> None:
        """A ranking layer's last query row ``last_row`` ``[B, H_kv, N]`` over its slots at positions ``pos``
        ``[B, H_kv, N]`` (``-1``: empty); ``seen`` ``[B]`` real tokens so far. Each position keeps the largest
        attention any head of any ranking layer gives it. The last ranking layer to publish finishes the
        layers that wait."""
        if layer_idx not in self.layers or layer_idx in self.published:
            return
        batch = pos.shape[0]
        width = int(seen.max())
        if self.scores is None:
            self.scores = torch.zeros(batch, width + 1, dtype=torch.float32, device=pos.device)
        # an empty slot lands in the spare last column, dropped below
        index = torch.where(pos >= 0, pos, width).flatten(1)
        self.scores.scatter_reduce_(1, index, last_row.float().flatten(1), reduce="amax")
        self.published.add(layer_idx)
        if self.complete:
            self.scores = self.scores[:, :width]
            waiting, self.waiting = self.waiting, {}
            for finish in waiting.values():
                finish(self.scores)

    def wait(self, layer_idx: int, finish: Callable[[torch.Tensor], None]) -> None:
        """Layer ``layer_idx`` holds its step until the scores are complete, then ``finish(scores)`` ranks it."""
        if layer_idx in self.waiting:
            raise RuntimeError(
                f"CrossLayer: layer {layer_idx} ran a second multi-token step before the ranking layers "
                f"{sorted(self.layers - self.published)} ran the first"
            )
        self.waiting[layer_idx] = finish
