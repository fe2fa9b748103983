"""The project's C++ CPU kernels, compiled once per machine for the instruction set it has.

Instruction-set level (``isa_level``): one of ``LEVELS``, each adding compiler flags to the one below it,

- ``scalar``: none (x86-64's baseline, or any other CPU's);
- ``avx2``: ``-mavx2 -mfma -mf16c``;
- ``avx512``: ``avx2``'s and ``-mavx512f -mavx512bw -mavx512dq -mavx512vl``;
- ``avx512_bf16``: ``avx512``'s and ``-mavx512bf16``;

the highest whose instructions this CPU has (Linux on x86-64: the flags every core lists in ``/proc/cpuinfo``;
x86-64 elsewhere: torch's CPU capability, which names AVX2 and AVX-512 but not AVX512-BF16; other CPUs:
``scalar``), lowered to ``EVICTLAYERS_CPU_ISA`` where that names a lower level. ``cpu_kernels.h`` picks its loops
by the compiler's macros for those flags, so a kernel built at a level uses no instruction above it.

Build. ``torch.utils.cpp_extension.load`` compiles a kernel's one source file on first use (``compiler_flags``:
``-O3``, the level's flags and ``-mtune=native``, with this folder on the include path for ``cpu_kernels.h``; it
needs a C++ compiler and ninja, as ``torch.compile`` on CPU does) into
``<root>/<python>_torch<version>/<kernel>_<level>_<hash>/`` (``build_name``; ``<root>``: ``TORCH_EXTENSIONS_DIR``
or torch's default). The level is in the name, so a cached build never runs on a CPU without its instructions and
a capped run never loads an uncapped build; the hash of the code and flags is too, so a later process imports the
cached build as it is, without asking ninja or the compiler. A build says so on stderr, before and after (with the
seconds it took); a cached import prints nothing. ``python -m evictlayers.kernels build`` builds every kernel
ahead, ``python -m evictlayers.kernels info`` prints the level and what is built. A kernel that cannot be built is
reported once (a ``RuntimeWarning`` with the reason and what runs instead), and its callers take their PyTorch
path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16")  # lowest first
ENVIRONMENT = "EVICTLAYERS_CPU_ISA"
HERE = Path(__file__).parent
HEADER = HERE / "cpu_kernels.h"

# per level, the compiler flags it adds to the level below, and the /proc/cpuinfo flags that say a CPU has them
_ADDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "scalar": ((), ()),
    "avx2": (("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
    "avx512": (("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"),
               ("avx512f", "avx512bw", "avx512dq", "avx512vl")),
    "avx512_bf16": (("-mavx512bf16",), ("avx512_bf16",)),
}


def _up_to(level: str) -> list[str]:
    return list(LEVELS[: LEVELS.index(level) + 1])


def isa_flags(level: str) -> list[str]:
    """The flags that build ``level``'s instructions (and no others): its own and every lower level's."""
    return [flag for below in _up_to(level) for flag in _ADDS[below][0]]


def compiler_flags(level: str) -> list[str]:
    """Everything a kernel is compiled with at ``level``: ``-O3``, ``isa_flags``, and above ``scalar``
    ``-mtune=native``, which schedules for the CPU that builds (as ``-march=native`` did) but adds no instruction:
    the generic tuning took longer in ``python -m benchmarks --only cpu_linear``'s 8-row products."""
    return ["-O3", *isa_flags(level), *(["-mtune=native"] if level != "scalar" else [])]


def level_of_flags(cpu_flags: set[str] | frozenset[str]) -> str:
    """The highest level whose instructions a CPU with these ``/proc/cpuinfo`` flags has."""
    level = "scalar"
    for candidate in LEVELS[1:]:
        if not all(flag in cpu_flags for below in _up_to(candidate) for flag in _ADDS[below][1]):
            break
        level = candidate
    return level


def _cpuinfo_flags() -> frozenset[str] | None:
    """The flags every core lists in ``/proc/cpuinfo`` (a process may run on any of them); ``None`` without it."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    per_core = [frozenset(line.partition(":")[2].split()) for line in text.splitlines() if line.startswith("flags")]
    return frozenset.intersection(*per_core) if per_core else None


@functools.cache
def cpu_level() -> str:
    """The highest level this CPU runs (before ``EVICTLAYERS_CPU_ISA``)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "scalar"  # the levels' flags are x86-64's
    flags = _cpuinfo_flags()
    if flags is not None:
        return level_of_flags(flags)
    # no /proc/cpuinfo (macOS, Windows): torch's own check, which cannot tell AVX512-BF16
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability(), "scalar")


def requested_level() -> str | None:
    """``EVICTLAYERS_CPU_ISA``, checked (``None`` where it is unset or empty)."""
    value = os.environ.get(ENVIRONMENT, "").strip()
    if not value:
        return None
    if value.lower() not in LEVELS:
        raise ValueError(
            f"{ENVIRONMENT}={value!r} is not an instruction-set level of evictlayers' C++ CPU kernels; choose one of "
            f"{', '.join(LEVELS)} (lowest first; the kernels are built for the lower of it and what this CPU has)"
        )
    return value.lower()


def isa_level() -> str:
    """The level the kernels are built for here: this CPU's, lowered to ``EVICTLAYERS_CPU_ISA`` if that is lower."""
    cpu, requested = cpu_level(), requested_level()
    return cpu if requested is None else min(cpu, requested, key=LEVELS.index)


def at_least(level: str) -> bool:
    """Whether the kernels here are built with ``level``'s instructions (``isa_level`` is ``level`` or higher)."""
    if level not in LEVELS:
        raise ValueError(f"unknown instruction-set level {level!r}; choose one of {', '.join(LEVELS)}")
    return LEVELS.index(isa_level()) >= LEVELS.index(level)


def describe_level() -> str:
    """``isa_level`` and why: what this CPU has, and ``EVICTLAYERS_CPU_ISA`` where it is set."""
    cpu, requested = cpu_level(), requested_level()
    if requested is None:
        return f"{cpu} (what this CPU has)"
    return f"{isa_level()} ({ENVIRONMENT}={requested}; this CPU has {cpu})"


def cache_root() -> Path:
    """Where the builds go, one folder each (``build_name``): ``TORCH_EXTENSIONS_DIR`` (or torch's default root),
    in a folder of this Python and torch (a build links against both)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(root) / f"{python}_torch{torch.__version__}"


def kernel_name(source: Path) -> str:
    """A kernel's name, from its source file: ``evictlayers_slots_cpu`` for ``decode/slots_cpu.cpp``."""
    return f"evictlayers_{source.stem}"


def build_name(source: Path, level: str) -> str:
    """The name of ``source``'s build at ``level``, its module's and its folder's: ``evictlayers_slots_cpu_avx2_``
    and 8 hex digits of a hash of the source, ``cpu_kernels.h`` and the compiler flags. A build is reused only for
    the code it was compiled from: a changed file, or another checkout's, builds beside it rather than over it."""
    digest = hashlib.sha256()
    for part in (source.read_bytes(), HEADER.read_bytes(), " ".join(compiler_flags(level)).encode()):
        digest.update(part)
    return f"{kernel_name(source)}_{level}_{digest.hexdigest()[:8]}"


def library(source: Path, level: str) -> Path:
    """The shared library torch builds for ``source`` at ``level`` (its suffix as ``torch.utils.cpp_extension``
    names it)."""
    name = build_name(source, level)
    return cache_root() / name / (name + (".pyd" if sys.platform == "win32" else ".so"))


def is_built(source: Path, level: str) -> bool:
    """Whether the build of ``source`` at ``level`` is cached and complete (torch holds a ``lock`` file beside it
    while a process builds it)."""
    built = library(source, level)
    return built.exists() and not (built.parent / "lock").exists()


_LOCK = threading.Lock()
_BUILT: dict[str, object] = {}  # kernel name -> its loaded module, or None when it could not be built


def build(source: Path, what: str, instead: str):
    """The compiled module of ``source`` (its import registers the kernel's ops) at ``isa_level``, imported from
    the cache or built on the first call of this process; ``None``, after one ``RuntimeWarning`` naming ``what``
    failed and ``instead`` (what runs in its place), when it cannot be built."""
    with _LOCK:
        name = kernel_name(source)
        if name not in _BUILT:
            level = isa_level()
            _BUILT[name] = _import(source, level) if is_built(source, level) else _compile(source, level, what, instead)
        return _BUILT[name]


def _import(source: Path, level: str):
    # as torch.utils.cpp_extension.load imports a build, without asking ninja first: the build's name already says
    # it is this code with these flags, and ninja compiles again, unannounced, wherever the source's path differs
    # from the one the build was made from (another checkout's, or an installed copy's)
    spec = importlib.util.spec_from_file_location(build_name(source, level), library(source, level))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(source: Path, level: str, what: str, instead: str):
    from torch.utils.cpp_extension import load

    directory = library(source, level).parent
    print(f"evictlayers: building the C++ CPU kernel {kernel_name(source)} for {level} (once per machine; cached in "
          f"{directory}) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        module = load(name=build_name(source, level), sources=[str(source)], extra_cflags=compiler_flags(level),
                      extra_include_paths=[str(HERE)], build_directory=str(directory), verbose=False)
    except Exception as error:  # noqa: BLE001 (a missing compiler or ninja shows up as several types)
        lower = "" if level == "scalar" else f", or set {ENVIRONMENT} below {level} if the compiler lacks its flags"
        warnings.warn(
            f"evictlayers could not compile its {what} ({source}) for {level}: {error}. {instead}; install a C++ "
            f"compiler and ninja to build it{lower}.", RuntimeWarning, stacklevel=4,
        )
        return None
    print(f"evictlayers: built {kernel_name(source)} for {level} in {time.perf_counter() - start:.1f} s",
          file=sys.stderr, flush=True)
    return module
