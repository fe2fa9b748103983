"""The project's C++ CPU kernels, compiled on first use for the machine they run on.

``torch.utils.cpp_extension.load`` builds a kernel's one source file (``-O3 -march=native``, with this
folder on the include path for ``cpu_kernels.h``, what the kernels share; it needs a C++ compiler and ninja,
as ``torch.compile`` on CPU does) in about a minute, once: torch caches the build in
``TORCH_EXTENSIONS_DIR`` and rebuilds only when the source changes. A kernel that cannot be built is
reported once, with the reason and what runs instead, and its callers take their PyTorch path.
"""

from __future__ import annotations

import logging
import threading
import warnings
from pathlib import Path

_LOG = logging.getLogger(__name__)
_LOCK = threading.Lock()
_BUILT: dict[str, object] = {}


def build(name: str, source: Path, what: str, instead: str):
    """The compiled module of ``source`` (``name`` is its import name), built on the first call; ``None``,
    after one ``RuntimeWarning`` naming ``what`` failed and ``instead`` (what runs in its place), when it
    cannot be built."""
    with _LOCK:
        if name not in _BUILT:
            from torch.utils.cpp_extension import load

            _LOG.info("compiling %s (once per machine; torch caches the build)", source.name)
            try:
                _BUILT[name] = load(name=name, sources=[str(source)], extra_cflags=["-O3", "-march=native"],
                                    extra_include_paths=[str(Path(__file__).parent)], verbose=False)
            except Exception as error:  # noqa: BLE001 (a missing compiler or ninja shows up as several types)
                warnings.warn(
                    f"evictlayers could not compile its {what} ({source}): {error}. {instead}; install a C++ "
                    "compiler and ninja to build it.", RuntimeWarning, stacklevel=3,
                )
                _BUILT[name] = None
        return _BUILT[name]
