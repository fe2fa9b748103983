"""How the C++ CPU kernels are built (``kernels/cpu_extension.py``, ``python -m evictlayers.kernels``): the
instruction-set level read from a CPU's flags and capped by ``EVICTLAYERS_CPU_ISA``, the compiler flags and build
name of each level, the lines a build prints (and a cached import does not), and the command that builds ahead.
The CPUs are described by their ``/proc/cpuinfo`` flags, so every level is checked on any machine."""

import shutil
import subprocess

import pytest
import torch

from evictlayers.kernels import __main__ as command
from evictlayers.kernels import cpu_extension
from evictlayers.kernels.cpu_extension import LEVELS, compiler_flags, isa_flags, isa_level, level_of_flags
from evictlayers.kernels.decode import slots_cpu

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}


@pytest.mark.parametrize("flags,level", [
    (set(), "scalar"),
    ({"sse4_2", "avx"}, "scalar"),
    (AVX2 - {"f16c"}, "scalar"),  # the avx2 loops convert float16 with F16C
    (AVX2, "avx2"),
    (AVX2 | {"avx512f", "avx512cd", "avx512er"}, "avx2"),  # AVX-512F without BW/DQ/VL (Xeon Phi)
    (AVX512, "avx512"),
    (AVX512 | {"avx512_vnni"}, "avx512"),
    (AVX512 | {"avx512_bf16"}, "avx512_bf16"),
    ({"avx512_bf16"}, "scalar"),  # each level needs every lower one's flags too
])
def test_the_level_is_the_highest_whose_flags_the_cpu_lists(flags, level):
    assert level_of_flags(flags) == level


def test_each_level_compiles_with_its_flags_and_every_lower_ones():
    assert isa_flags("scalar") == []
    assert isa_flags("avx2") == ["-mavx2", "-mfma", "-mf16c"]
    assert isa_flags("avx512") == isa_flags("avx2") + ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
    assert isa_flags("avx512_bf16") == isa_flags("avx512") + ["-mavx512bf16"]
    # tuned for the building CPU on x86-64 (scheduling, no instructions); scalar may be another architecture
    assert compiler_flags("scalar") == ["-O3"]
    for level in LEVELS[1:]:
        assert compiler_flags(level) == ["-O3", *isa_flags(level), "-mtune=native"]
        assert not any(flag.startswith("-march") for flag in compiler_flags(level))


@pytest.mark.parametrize("cpu", LEVELS)
@pytest.mark.parametrize("requested", [None, *LEVELS])
def test_the_environment_caps_the_level_at_what_the_cpu_has(monkeypatch, cpu, requested):
    monkeypatch.setattr(cpu_extension, "cpu_level", lambda: cpu)
    if requested is None:
        monkeypatch.delenv(cpu_extension.ENVIRONMENT, raising=False)
    else:
        monkeypatch.setenv(cpu_extension.ENVIRONMENT, requested.upper())  # any case
    expected = cpu if requested is None else min(cpu, requested, key=LEVELS.index)
    assert isa_level() == expected
    assert cpu_extension.describe_level().startswith(expected)
    assert cpu_extension.at_least("avx512") == (LEVELS.index(expected) >= LEVELS.index("avx512"))


def test_an_unknown_level_is_refused_naming_the_allowed_ones(monkeypatch, capsys):
    monkeypatch.setenv(cpu_extension.ENVIRONMENT, "avx3")
    with pytest.raises(ValueError, match=r"EVICTLAYERS_CPU_ISA='avx3' is not an instruction-set level .*choose one "
                                         r"of scalar, avx2, avx512, avx512_bf16"):
        isa_level()
    with pytest.raises(SystemExit):
        command.main(["info"])
    assert "EVICTLAYERS_CPU_ISA='avx3'" in capsys.readouterr().err


def test_a_cpu_the_flags_do_not_describe_gets_a_level_without_them(monkeypatch):
    """Other architectures build scalar; x86-64 without /proc/cpuinfo asks torch, which cannot tell AVX512-BF16."""
    monkeypatch.setattr(cpu_extension.platform, "machine", lambda: "aarch64")
    cpu_extension.cpu_level.cache_clear()
    try:
        assert cpu_extension.cpu_level() == "scalar"
        monkeypatch.setattr(cpu_extension.platform, "machine", lambda: "AMD64")
        monkeypatch.setattr(cpu_extension, "_cpuinfo_flags", lambda: None)
        for capability, level in (("AVX512", "avx512"), ("AVX2", "avx2"), ("DEFAULT", "scalar")):
            monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
            cpu_extension.cpu_level.cache_clear()
            assert cpu_extension.cpu_level() == level
    finally:
        cpu_extension.cpu_level.cache_clear()


def test_the_build_name_holds_the_level_and_a_hash_of_the_code(monkeypatch, tmp_path):
    source = slots_cpu.SOURCE
    names = {level: cpu_extension.build_name(source, level) for level in LEVELS}
    assert len(set(names.values())) == len(LEVELS)
    for level, name in names.items():
        assert name.startswith(f"evictlayers_slots_cpu_{level}_") and name.isidentifier()
    copy = tmp_path / "slots_cpu.cpp"
    copy.write_text(source.read_text() + "\n// changed\n")
    assert cpu_extension.build_name(copy, "avx2") != names["avx2"]
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cpu_extension.library(source, "avx2").parent.parent.parent == tmp_path


def test_a_build_says_so_before_and_after_with_the_levels_flags(monkeypatch, tmp_path, capsys):
    import torch.utils.cpp_extension

    asked = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: asked.append(kwargs) or "module")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv(cpu_extension.ENVIRONMENT, "scalar")
    monkeypatch.setattr(cpu_extension, "_BUILT", {})
    assert slots_cpu.extension() == "module"
    assert slots_cpu.extension() == "module"  # once a process
    (call,) = asked
    name = cpu_extension.build_name(slots_cpu.SOURCE, "scalar")
    assert call["name"] == name and call["extra_cflags"] == ["-O3"]
    assert call["build_directory"] == str(tmp_path / cpu_extension.cache_root().name / name)
    before, after = capsys.readouterr().err.splitlines()
    assert before == (f"evictlayers: building the C++ CPU kernel evictlayers_slots_cpu for scalar (once per machine; "
                      f"cached in {call['build_directory']}) ...")
    assert after.startswith("evictlayers: built evictlayers_slots_cpu for scalar in ") and after.endswith(" s")


def test_a_cached_build_is_imported_without_a_word(monkeypatch, capsys):
    import torch.utils.cpp_extension

    assert slots_cpu.extension() is not None  # built (or imported) by this process
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: pytest.fail("asked to build again"))
    monkeypatch.setattr(cpu_extension, "_BUILT", {})
    capsys.readouterr()
    assert slots_cpu.extension().__name__ == cpu_extension.build_name(slots_cpu.SOURCE, isa_level())
    assert capsys.readouterr().err == ""


def test_the_command_builds_what_the_level_uses_and_reports_it(monkeypatch, capsys):
    monkeypatch.setattr(cpu_extension, "cpu_level", lambda: "avx512_bf16")
    monkeypatch.setenv(cpu_extension.ENVIRONMENT, "avx2")
    built = []
    for module, _ in command.KERNELS:
        monkeypatch.setattr(module, "extension", lambda m=module: built.append(m) or "module")
    assert command.main(["build"]) == 0
    assert [m.__name__.rsplit(".", 1)[1] for m in built] == ["slots_cpu", "mass_cpu", "int4_cpu"]
    out = capsys.readouterr().out
    assert "evictlayers_linear_cpu: not built, as it is not used below avx512" in out
    assert "evictlayers_slots_cpu for avx2: " in out
    monkeypatch.setattr(command.int4_cpu, "extension", lambda: None)  # could not be built (a warning said why)
    assert command.main(["build"]) == 1
    assert "not built: evictlayers_int4_cpu" in capsys.readouterr().err
    assert command.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "instruction-set level: avx2 (EVICTLAYERS_CPU_ISA=avx2; this CPU has avx512_bf16)" in out
    assert "compiler flags: -O3 -mavx2 -mfma -mf16c -mtune=native\n" in out
    assert f"{cpu_extension.build_name(command.linear_cpu.SOURCE, 'avx2')}: not used below avx512" in out


# registers and instructions no build below each level may hold: zmm and the mask registers are AVX-512's, ymm
# AVX's (the scalar level is x86-64's baseline, SSE2), vdpbf16ps AVX512-BF16's
ABOVE = {"avx2": ("%zmm", "%k1"), "avx512": ("vdpbf16ps",), "avx512_bf16": ()}
ABOVE["scalar"] = ("%ymm", *ABOVE["avx2"])
OWN = {"scalar": None, "avx2": "%ymm", "avx512": "%zmm", "avx512_bf16": "%zmm"}  # the widest register of a level
# the highest level whose registers a kernel's own loops use, where that is not every level: mass_cpu.cpp's vectors
# are ATen's 8-float ones at every level above scalar
WIDEST = {"evictlayers_mass_cpu": "avx2"}


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
@pytest.mark.parametrize("module,lowest", command.KERNELS, ids=[module.__name__ for module, _ in command.KERNELS])
def test_a_build_holds_no_instruction_above_its_level(module, lowest):
    """The machine code of each kernel built here, disassembled: it uses its level's widest registers, and nothing
    a CPU of that level cannot run (a SIGILL there). Checked at this run's level; the CI job capped at avx2 checks
    that one."""
    level = isa_level()
    if not cpu_extension.at_least(lowest):
        pytest.skip(f"not used below {lowest}; this run's level: {level}")
    assert module.extension() is not None
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(cpu_extension.library(module.SOURCE, level))],
                          capture_output=True, text=True, check=True).stdout
    assert [word for word in ABOVE[level] if word in code] == []
    widest = min(level, WIDEST.get(cpu_extension.kernel_name(module.SOURCE), level), key=LEVELS.index)
    assert OWN[widest] is None or OWN[widest] in code
