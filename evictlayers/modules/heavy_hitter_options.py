"""``HeavyHitterSelector``'s options from before score refinements (``pool``, ``chunk``, ``scope`` and
their companions) and the ``refine=[...]`` list each stands for: recipes written with them (the recipe
search's candidates) load through this, and the keyword arguments still work, deprecated."""

from __future__ import annotations

from typing import Any

from evictlayers.scoring import ChunkScores, LayerScope, PooledScores, ScoreRefinement, SentenceScores

OPTION_DEFAULTS: dict[str, Any] = {
    "pool": 1, "pool_reduce": "mean", "pool_side": "both", "chunk": 1, "sentence_cap": 32, "chunk_reduce": "sum",
    "scope": "head", "scope_reduce": "mean",
}
"""Each old option and its default, which asked for no refinement."""


def refinement_arguments(options: dict[str, Any]) -> list[tuple[str, type[ScoreRefinement], dict[str, Any]]]:
    """``(option, refinement class, constructor arguments)`` for each refinement the old ``options`` (a
    subset of ``OPTION_DEFAULTS``' keys) ask for, in the order the selector applied them: pooling, then
    chunks, then the layer's scope. Arguments at their default are left out.

    Raises:
        ValueError: an option's value is not one it took, or a companion option (``pool_side``,
            ``sentence_cap``, ``chunk_reduce``, ``scope_reduce``) is given without the option it shapes.
    """
    given = {**OPTION_DEFAULTS, **options}
    changed = {key for key in options if options[key] != OPTION_DEFAULTS[key]}
    pool, chunk, scope = given["pool"], given["chunk"], given["scope"]
    if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1:
        raise ValueError(f"HeavyHitterSelector(pool={pool!r}): the pooling width must be an int >= 1 (1: no pooling)")
    if chunk != "sentence" and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"HeavyHitterSelector(chunk={chunk!r}): the chunk length must be an int >= 1 (1: no chunks; "
                         "ChunkKV uses 10) or 'sentence' (the text's sentences and lines)")
    if scope not in ("head", "layer"):
        raise ValueError(f"HeavyHitterSelector(scope={scope!r}): expected 'head' (each KV head keeps its own tokens) "
                         "or 'layer' (the heads of a layer keep the same tokens)")
    needs = {"pool_reduce": ("pool >= 2", pool > 1), "pool_side": ("pool >= 2", pool > 1),
             "sentence_cap": ("chunk='sentence'", chunk == "sentence"),
             "chunk_reduce": ("chunk >= 2 or chunk='sentence'", chunk != 1),
             "scope_reduce": ("scope='layer'", scope == "layer")}
    for key, (what, present) in needs.items():
        if key in changed and not present:
            raise ValueError(f"HeavyHitterSelector({key}={given[key]!r}) shapes an option that is off: it needs {what}")

    def set_options(**arguments: str) -> dict[str, Any]:
        """Each constructor argument (keyword) taken from its old option (value) where that is not at its
        default, which is the argument's default too."""
        return {name: given[key] for name, key in arguments.items() if key in changed}

    out: list[tuple[str, type[ScoreRefinement], dict[str, Any]]] = []
    if pool > 1:
        out.append(("pool", PooledScores, {"window": pool, **set_options(reduce="pool_reduce", side="pool_side")}))
    if chunk == "sentence":
        out.append(("chunk", SentenceScores, set_options(cap="sentence_cap", reduce="chunk_reduce")))
    elif chunk > 1:
        out.append(("chunk", ChunkScores, {"size": chunk, **set_options(reduce="chunk_reduce")}))
    if scope == "layer":
        out.append(("scope", LayerScope, set_options(reduce="scope_reduce")))
    return out
