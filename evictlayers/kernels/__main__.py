"""``python -m evictlayers.kernels build|info``: the C++ CPU kernels (``cpu_extension.py``) built ahead of first use,
or what is built here.

- ``build``: compiles every kernel for this machine's instruction-set level (``EVICTLAYERS_CPU_ISA`` caps it) that
  is not already cached, each announced as it builds; exits 1 if one could not be built (its warning says why).
- ``info``: the level and why, the compiler flags, the cache folder, and per kernel whether its build is cached.
"""

from __future__ import annotations

import argparse
import sys

from evictlayers.kernels import cpu_extension, linear_cpu
from evictlayers.kernels.decode import slots_cpu
from evictlayers.kernels.prefill import mass_cpu
from evictlayers.kernels.quantized_decode import int4_cpu

# each kernel's module (its SOURCE and extension()) and the lowest level it is used at: below avx512 the linear op
# would compute at::linear, and linear_cpu.available() never builds it
KERNELS = ((slots_cpu, "scalar"), (mass_cpu, "scalar"), (int4_cpu, "scalar"), (linear_cpu, "avx512"))


def build() -> int:
    level, failed = cpu_extension.isa_level(), []
    for module, lowest in KERNELS:
        name = cpu_extension.kernel_name(module.SOURCE)
        if not cpu_extension.at_least(lowest):
            print(f"{name}: not built, as it is not used below {lowest}")
        elif module.extension() is None:
            failed.append(name)
        else:
            print(f"{name} for {level}: {cpu_extension.library(module.SOURCE, level)}")
    if failed:
        print(f"not built: {', '.join(failed)} (the warnings above say why)", file=sys.stderr)
    return 1 if failed else 0


def info() -> int:
    level = cpu_extension.isa_level()
    print(f"instruction-set level: {cpu_extension.describe_level()}; levels: {', '.join(cpu_extension.LEVELS)} "
          f"(set {cpu_extension.ENVIRONMENT} to build for a lower one)")
    print(f"compiler flags: {' '.join(cpu_extension.compiler_flags(level))}")
    print(f"cache: {cpu_extension.cache_root()}")
    for module, lowest in KERNELS:
        if not cpu_extension.at_least(lowest):
            state = f"not used below {lowest}"
        elif cpu_extension.is_built(module.SOURCE, level):
            state = "built"
        else:
            state = "not built (python -m evictlayers.kernels build)"
        print(f"  {cpu_extension.build_name(module.SOURCE, level)}: {state}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evictlayers.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("build", "info"),
                        help="build: compile every C++ CPU kernel now; info: the level and what is built")
    command = parser.parse_args(argv).command
    try:
        cpu_extension.requested_level()
    except ValueError as error:
        parser.error(str(error))
    return build() if command == "build" else info()


if __name__ == "__main__":
    sys.exit(main())
