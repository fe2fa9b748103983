"""The transformers version check of ``evictlayers.apply``: an error below the tested range, one warning
above it, silence inside it. Versions are monkeypatched strings, never installs."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import transformers

from evictlayers.hf import versions
from evictlayers.hf.versions import (
    TESTED_HIGHEST, TESTED_LOWEST, UnsupportedTransformersError, check_transformers_version,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def installed(monkeypatch):
    """Set the installed transformers version (as ``transformers.__version__``) with a fresh warn-once flag."""
    monkeypatch.setattr(versions, "_warned", False)

    def install(version: str) -> None:
        monkeypatch.setattr(transformers, "__version__", version)

    return install


def _quietly() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails
        check_transformers_version()


@pytest.mark.parametrize("version", ["5.14.1", "5.19.0", "5.21.1", "5.22.2", "5.23.0", "5.24.0", "5.24.9", "5.24.0.dev0", "5.14.0rc1"])
def test_tested_versions_pass_silently(installed, version):
    installed(version)
    _quietly()


@pytest.mark.parametrize("version", ["5.13.1", "5.12.1", "5.0.0", "4.57.6", "5.13.0.dev0"])
def test_older_versions_are_refused_naming_installed_and_tested(installed, version):
    installed(version)
    with pytest.raises(UnsupportedTransformersError) as raised:
        check_transformers_version()
    message = str(raised.value)
    assert f"transformers {version} is installed" in message
    assert "5.14 to 5.24" in message and ">= 5.14" in message
    assert not versions._warned


@pytest.mark.parametrize("version", ["5.25.0", "5.25.0.dev0", "5.30.1", "6.0.0"])
def test_newer_versions_warn_once(installed, version):
    installed(version)
    with pytest.warns(UserWarning) as caught:
        check_transformers_version()
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"transformers {version} is installed" in message and "tested on transformers 5.14 to 5.24" in message
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")  # Python's own once-per-location filter cannot hide a second warning
        check_transformers_version()
        check_transformers_version()
    assert again == []


def test_warns_once_per_process_even_across_newer_versions(installed):
    installed("5.25.0")
    with pytest.warns(UserWarning):
        check_transformers_version()
    installed("5.26.0")
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        check_transformers_version()
    assert again == []


def test_version_is_read_at_each_call_and_an_explicit_version_wins(installed):
    installed("5.13.0")
    with pytest.raises(UnsupportedTransformersError):
        check_transformers_version()
    installed("5.22.0")
    check_transformers_version()
    with pytest.raises(UnsupportedTransformersError, match="transformers 5.13.1 is installed"):
        check_transformers_version("5.13.1")


def test_unreadable_version_is_refused(installed):
    installed("not-a-version")
    with pytest.raises(UnsupportedTransformersError, match="cannot read the installed transformers version"):
        check_transformers_version()


def test_installed_transformers_is_in_the_tested_range(monkeypatch):
    """The suite runs on a tested version: a newer transformers must be tested (and the range moved) first."""
    monkeypatch.setattr(versions, "_warned", False)
    _quietly()


def test_range_matches_pyproject_and_the_ci_compat_job():
    """pyproject's transformers requirement, the main and compat jobs' pins and ``versions`` name the same range."""
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    (low, high), = re.findall(r'"transformers>=(\d+\.\d+),<(\d+\.\d+)"', pyproject)
    assert tuple(map(int, low.split("."))) == TESTED_LOWEST
    assert tuple(map(int, high.split("."))) == (TESTED_HIGHEST[0], TESTED_HIGHEST[1] + 1)
    run_sh = (REPO / "scripts" / "run.sh").read_text(encoding="utf-8")
    (pinned,) = re.findall(r'^COMPAT_TRANSFORMERS="(\d+\.\d+\.\d+)"$', run_sh, flags=re.MULTILINE)
    assert '"transformers==$COMPAT_TRANSFORMERS"' in run_sh
    assert tuple(map(int, pinned.split(".")))[:2] == TESTED_LOWEST
    (top,) = re.findall(r'^TOP_TRANSFORMERS="(\d+\.\d+\.\d+)"$', run_sh, flags=re.MULTILINE)
    assert '"transformers==$TOP_TRANSFORMERS"' in run_sh
    assert tuple(map(int, top.split(".")))[:2] == TESTED_HIGHEST


def test_apply_warns_once_above_the_range_and_refuses_below_before_touching_the_model(installed):
    import evictlayers as el
    from tiny_models import build

    model = build("llama")
    installed("5.99.0")
    with pytest.warns(UserWarning, match="tested on transformers 5.14 to 5.24"):
        with el.apply(model, el.Policy(budget=None)):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with el.apply(model, el.Policy(budget=None)):
            pass
    installed("5.13.1")
    with pytest.raises(UnsupportedTransformersError, match="transformers 5.13.1 is installed"):
        el.apply(model, el.Policy(budget=None))
    assert not hasattr(model, "_evictlayers_run")
