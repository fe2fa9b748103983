"""Base class for every policy component: an ``nn.Module`` with a dataclass-like config surface.

A component's constructor arguments are its whole configuration: ``params()`` returns them, equality
compares them, and the recipe layer dumps and loads them (``compose/recipes.py``).
"""

from __future__ import annotations

from typing import Any

from torch import nn


class Component(nn.Module):
    """A configured policy piece. Subclasses list their constructor arguments in ``param_names``."""

    param_names: tuple[str, ...] = ()

    def params(self) -> dict[str, Any]:
        """Constructor keyword arguments that rebuild an equal component."""
        return {name: getattr(self, name) for name in self.param_names}

    def extra_repr(self) -> str:
        # component-valued arguments are submodules and print themselves
        return ", ".join(f"{k}={v!r}" for k, v in self.params().items() if not isinstance(v, nn.Module))

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.params() == other.params()

    # nn.Module relies on identity hashing (module sets in named_modules)
    __hash__ = nn.Module.__hash__
