"""The built wheel carries the recipes and the int4 kernel's C++ source: installed outside the repository,
a recipe loads by name and the CLI finds it."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, cwd=tmp_path)
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
