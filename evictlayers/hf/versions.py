"""The transformers versions evictlayers is tested on, and the check ``evictlayers.apply`` makes.

evictlayers reaches into transformers' attention modules and cache classes, which change between
minor releases, so only the minors below are known to give the unmodified model's results:

- ``TESTED_HIGHEST`` (5.24): the whole test suite, and ``docs/models.md`` was generated on it;
- ``TESTED_LOWEST`` (5.14.1, pinned exactly by CI's ``compat`` job, ``bash scripts/run.sh compat``):
  the conformance sweep and the family tests.

Between the two, transformers 5.14 to 5.18 return one cache-layer keywords dict for every layer
(``hf/support.py`` splits it per layer type), and 5.14 to 5.20 offer sdpa for Gemma2 while ignoring its
soft-capping (``apply`` refuses soft-capped logits under sdpa). 5.13 and older lack
``transformers.cache_utils.DYNAMIC_LAYER_TYPE_MAPPING`` and build cache layers differently. Above
5.24 evictlayers may work but is untested: ``check_transformers_version`` warns once.
"""

from __future__ import annotations

import warnings

from packaging.version import InvalidVersion, Version

TESTED_LOWEST = (5, 14)  # the lowest tested minor (CI's compat job runs 5.14.1)
TESTED_HIGHEST = (5, 24)  # the highest tested minor (the full test suite)

_warned = False


class UnsupportedTransformersError(RuntimeError):
    """The installed transformers is older than any version evictlayers is tested on."""


def tested_range() -> str:
    """``"5.14 to 5.24"``: the tested minors, for messages."""
    return f"{TESTED_LOWEST[0]}.{TESTED_LOWEST[1]} to {TESTED_HIGHEST[0]}.{TESTED_HIGHEST[1]}"


def _minor(version: str) -> tuple[int, int]:
    try:
        release = Version(version).release
    except InvalidVersion as error:
        raise UnsupportedTransformersError(
            f"evictlayers cannot read the installed transformers version {version!r}; it is tested on transformers "
            f"{tested_range()}"
        ) from error
    return (release + (0, 0))[:2]


def check_transformers_version(version: str | None = None) -> None:
    """Refuse a transformers older than the tested range; warn once when it is newer.

    ``version`` defaults to the installed ``transformers.__version__`` (read at each call). A pre-release
    or dev build counts as its minor (``5.25.0.dev0`` is 5.25).

    Raises:
        UnsupportedTransformersError: the installed transformers is below ``TESTED_LOWEST``.

    Warns:
        UserWarning: once per process, the first time the installed transformers is above ``TESTED_HIGHEST``.
    """
    global _warned
    if version is None:
        # the module as sys.modules holds it now: transformers' lazy module can be swapped in after
        # this module was imported
        import transformers as installed

        version = installed.__version__
    minor = _minor(version)
    if minor < TESTED_LOWEST:
        raise UnsupportedTransformersError(
            f"evictlayers needs transformers >= {TESTED_LOWEST[0]}.{TESTED_LOWEST[1]} (tested on {tested_range()}); "
            f"transformers {version} is installed. Older versions give results that differ from the unmodified "
            f'model. Upgrade with `pip install "transformers>={TESTED_LOWEST[0]}.{TESTED_LOWEST[1]},'
            f'<{TESTED_HIGHEST[0]}.{TESTED_HIGHEST[1] + 1}"`.'
        )
    if minor > TESTED_HIGHEST and not _warned:
        _warned = True
        warnings.warn(
            f"evictlayers is tested on transformers {tested_range()}, but transformers {version} is installed: "
            "its attention modules or cache classes may have changed, so check that the patched model still gives "
            "the unmodified model's results (python -m pytest tests/test_architecture_sweep.py)",
            UserWarning,
            stacklevel=4,  # the caller of evictlayers.apply (apply -> EvictionRun.__init__ -> here)
        )
