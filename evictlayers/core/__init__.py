"""What every layer above the kernels shares: the ``Component`` base class and the slot helpers.

It imports nothing from the rest of the package, so ``scoring/``, ``modules/`` and ``compose/`` can all
depend on it (DESIGN.md "Layers of the package")."""

from evictlayers.core.component import Component

__all__ = ["Component"]
