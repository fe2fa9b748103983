"""The built wheel carries the recipes and the int4 kernel's C++ source: installed outside the repository,
a recipe loads by name and the CLI finds it. Neither the wheel nor the sdist carries the repository's
research (research/: the claims, the search candidates' YAML, the JSON of its runs)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _research_in(names: list[str], shipped_yaml: str) -> list[str]:
    """The names (paths inside a wheel, sdist or install) that are research: under a ``research/`` folder,
    a YAML file outside ``shipped_yaml`` (the shipped recipes' folder), or a JSON file."""
    return [name for name in names
            if "research/" in f"/{name}" or (name.endswith(".yaml") and f"/{shipped_yaml}/" not in f"/{name}")
            or name.endswith(".json")]


@pytest.mark.slow
def test_wheel_ships_recipes_and_they_load_outside_the_repo(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(REPO)], check=True, cwd=tmp_path)
    (wheel,) = wheels.glob("evictlayers-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(p.name for p in (REPO / "evictlayers" / "recipes").glob("*.yaml"))
    assert shipped and all(f"evictlayers/recipes/{name}" in names for name in shipped)
    assert "evictlayers/kernels/quantized_decode/int4_cpu.cpp" in names  # compiled on first use
    assert "evictlayers/kernels/prefill/mass_cpu.cpp" in names
    assert "evictlayers/kernels/decode/slots_cpu.cpp" in names and "evictlayers/kernels/cpu_kernels.h" in names
    assert "evictlayers/kernels/linear_cpu.cpp" in names
    assert _research_in(names, "evictlayers/recipes") == []

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, cwd=tmp_path)
    # the package's own files (pip's metadata beside it holds a JSON of its own)
    installed = [p.relative_to(target).as_posix() for p in (target / "evictlayers").rglob("*") if p.is_file()]
    assert not (target / "research").exists() and _research_in(installed, "evictlayers/recipes") == []
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    env.pop("EVICTLAYERS_RECIPES", None)
    script = ("import evictlayers as el, pathlib; "
              "assert pathlib.Path(el.__file__).is_relative_to(pathlib.Path(r'%s')); "
              "print(el.load_recipe('h2o').budget)" % target)
    out = subprocess.run([sys.executable, "-c", script], check=True, cwd=elsewhere, env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "0.2"
    # the CLI lists the shipped recipes from the installed package (an unknown name stops it before any model)
    cli = subprocess.run([sys.executable, "-m", "evictlayers.cli", "eval", "no_such_recipe", "--task", "passkey",
                          "--out", "x"], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert "recipe 'no_such_recipe' not found" in cli.stderr
    assert str(target) in cli.stderr and "tova_keydiff" in cli.stderr


@pytest.mark.slow
def test_sdist_holds_no_research(tmp_path):
    """The sdist (setuptools' build backend, as ``python -m build --sdist`` calls it) holds the package and
    its recipes, and none of research/."""
    script = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    built = subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, cwd=REPO, capture_output=True,
                           text=True)
    sdist = tmp_path / built.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as archive:
        names = [name.split("/", 1)[1] for name in archive.getnames() if "/" in name]  # without evictlayers-<version>/
    assert "evictlayers/cli.py" in names and "evictlayers/recipes/h2o.yaml" in names
    assert _research_in(names, "evictlayers/recipes") == []
