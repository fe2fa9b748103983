"""The interface of modules that reserve slots for tokens chosen by position, not by score."""

from __future__ import annotations

import torch

from evictlayers.core import Component
from evictlayers.scoring import SlotView


class Protection(Component):
    """Reserves slots for tokens chosen by position; a protected slot is never evicted."""

    def reserved(self, budget: torch.Tensor, reserved_by_others: torch.Tensor) -> torch.Tensor:
        """``[B]`` int64 slots this module reserves per head, given each row's ``budget`` and what the
        policy's other protections already reserved."""
        raise NotImplementedError

    def fixed_size(self) -> int | None:
        """Slots reserved whatever the budget (an int size), or ``None`` if they depend on the budget."""
        raise NotImplementedError

    def protect(self, view: SlotView, reserved: torch.Tensor) -> torch.Tensor:
        """``[B, H_kv, N]`` bool: slots this module keeps."""
        raise NotImplementedError
