"""What every layer above the kernels shares: the ``Component`` base class and the slot helpers.

It imports nothing from the rest of the package, so ``scoring/``, ``modules/`` and ``compose/`` can all
depend on it: each layer of the package imports only the layers below it (docs/architecture.md, "Layers
and their dependencies")."""

from evictlayers.core.component import Component

__all__ = ["Component"]
