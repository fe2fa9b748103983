"""``research/kvpress``: the export holds the prompts ``evictlayers eval --task ruler`` runs (checked against the
task's own rows, ``ruler_samples`` and a real command-line run on a tiny checkpoint), the question's end is
where the prompt's text puts it, and the scoring of hand-made raw predictions gives the ``ruler.json`` that
``markdown_table``, ``plot_ruler`` and the transfer report read. kvpress itself is not needed: run_presses'
own pieces run here against a stand-in for kvpress's pipeline."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

import evictlayers.eval.tasks.ruler as ruler_pkg
from evictlayers.cli import main as evictlayers_main
from evictlayers.eval.protocol import split_books
from evictlayers.eval.ruler_report import compression_ratio, markdown_table, plot_ruler
from evictlayers.eval.suite import make_task
from evictlayers.eval.tasks.documents import read_texts
from evictlayers.eval.tasks.ruler import Books, ruler_samples
from research.kvpress import export_prompts as export_module
from research.kvpress import run_presses, score
from research.kvpress.export_prompts import export_prompts
from research.transfer_report import load as load_results
from research.transfer_report import merge, transfer_report
from test_eval_helpers import char_tokenizer, tiny_llama
from test_ruler_tasks import chat_tok, synthetic_books  # noqa: F401 (a fixture)
from tiny_models import single_thread  # noqa: F401

LENGTH = 1800  # characters = tokens with the character tokenizer
TASKS = ["niah_single_1", "niah_single_2", "vt", "fwe"]  # noise, essay, noise, words: all held-out families
STEPS = 4


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    return synthetic_books(tmp_path_factory.mktemp("kvpress-books"))


def _export(tokenizer, books, **options):
    return export_prompts(tokenizer, "tiny", lengths=[LENGTH], samples=2, tasks=TASKS, max_new_tokens=STEPS,
                          data=books, **options)


# ---- the export ----------------------------------------------------------------------------------------


def test_export_holds_the_prompts_the_ruler_task_runs_on_the_held_out_split(chat_tok, books):
    doc = _export(chat_tok, books)
    assert ruler_pkg.render is ruler_pkg.prompt.render  # evictlayers' render is itself again
    assert doc["settings"]["split"] == "held_out" and doc["settings"]["seed"] == 2 and doc["settings"]["chat"]
    assert doc["settings"]["sources"] == ["book1.txt"]  # the held-out split's book only
    # the ruler task of the command line, built independently here, feeds the same ids in the same order
    task = make_task("ruler", chat_tok, tasks=TASKS, lengths=[LENGTH], samples=2, split="held_out",
                     max_new_tokens=STEPS, data=str(books))
    rows = [r for r in task.rows() if r["setting"] == "query_aware"]
    assert [p["input_ids"] for p in doc["prompts"]] == [r["input_ids"] for r in rows]
    assert [(p["task"], p["sample"], p["n_context"], p["answers"]) for p in doc["prompts"]] == \
        [(r["task"], r["sample"], r["n_context"], r["answers"]) for r in rows]
    # and ruler_samples called by hand with the held-out split's seed and books
    held_books = Books(split_books(read_texts(books), "held_out"))
    for name in TASKS:
        mine = [p for p in doc["prompts"] if p["task"] == name]
        theirs = ruler_samples(chat_tok, name, LENGTH, 2, seed=2, chat=True, books=held_books, max_new_tokens=STEPS)
        assert [p["input_ids"] for p in mine] == [list(s.input_ids) for s in theirs]
        assert [p["max_new_tokens"] for p in mine] == [STEPS, STEPS]
    # another split's prompts are other prompts: the comparisons above can tell them apart
    tuning = export_prompts(chat_tok, "tiny", lengths=[LENGTH], samples=2, tasks=["niah_single_2"],
                            max_new_tokens=STEPS, data=books, split="tuning")
    held = next(p for p in doc["prompts"] if p["task"] == "niah_single_2")
    assert tuning["prompts"][0]["input_ids"] != held["input_ids"]


def test_question_end_splits_the_question_from_the_chat_templates_end(chat_tok, books):
    doc = _export(chat_tok, books, text=True)
    for p in doc["prompts"]:
        text = p["text"]
        assert len(p["input_ids"]) == len(text)  # one id per character
        context, question, tail = (text[: p["n_context"]], text[p["n_context"] : p["n_question_end"]],
                                   text[p["n_question_end"] :])
        assert context.startswith("<user>\n") and question[-1] in "?."
        assert "\n<user>" not in question and "<assistant>" not in question
        # kvpress's query-aware setting feeds this after compression: the end of the turn and the answer prefix
        assert tail.startswith("\n<assistant>\n") and len(tail) > len("\n<assistant>\n")
    assert "text" not in _export(chat_tok, books)["prompts"][0]  # the books' text only on request


def test_question_end_without_a_chat_template_is_before_the_answer_prefix(tok, books):
    doc = _export(tok, books, text=True)
    for p in doc["prompts"]:
        tail = p["text"][p["n_question_end"] :]
        assert p["n_context"] < p["n_question_end"] < p["n_tokens"]
        assert tail.startswith(" ") and ("Answer" in tail or "special magic" in tail), tail


def test_export_refuses_what_the_ruler_task_refuses(tok, books):
    with pytest.raises(ValueError, match="split does not hold"):
        export_prompts(tok, "tiny", lengths=[LENGTH], tasks=["vt"], split="tuning", data=books)


# ---- run_presses' own pieces, against a stand-in for kvpress's pipeline --------------------------------


def test_run_presses_imports_nothing_of_evictlayers():
    tree = ast.parse(Path(run_presses.__file__).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert imported and not [m for m in imported if m and (m.startswith("evictlayers") or m.startswith("research"))]


class _Pipe:
    """kvpress's pipeline's ``forward`` in miniature: the context into the cache (a press would compress it
    there), then one decoded answer."""

    def __init__(self, model, tokenizer, keep: int | None = None):
        self.model, self.tokenizer, self.keep, self.calls = model, tokenizer, keep, []

    def forward(self, inputs, press=None, max_new_tokens=50, cache=None):
        self.calls.append((inputs["context_ids"].shape[1], inputs["questions_ids"][0].shape[1], max_new_tokens, press))
        self.model.model(input_ids=inputs["context_ids"], past_key_values=cache)
        if self.keep is not None:
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[:, :, -self.keep :], layer.values[:, :, -self.keep :]
        return [self.tokenizer.decode(torch.tensor([40, 41, 2]), skip_special_tokens=True)]


@pytest.mark.usefixtures("single_thread")
def test_run_prompt_splits_where_kvpress_would_and_notes_the_decoded_ids(tok, books):
    doc = _export(tok, books)
    prompt = doc["prompts"][0]
    model = tiny_llama(len(tok))
    pipe = _Pipe(model, tok, keep=100)
    aware = run_presses.run_prompt(pipe, prompt, "query_aware", press="P")
    agnostic = run_presses.run_prompt(pipe, prompt, "query_agnostic", press="P")
    n = prompt["n_tokens"]
    assert pipe.calls == [(prompt["n_question_end"], n - prompt["n_question_end"], STEPS, "P"),
                          (prompt["n_context"], n - prompt["n_context"], STEPS, "P")]
    assert aware["generated_ids"] == [40, 41, 2]
    assert aware["generated_kvpress"] == tok.decode([40, 41, 2], skip_special_tokens=True)
    heads, layers = model.config.num_key_value_heads, model.config.num_hidden_layers
    assert aware["kept_context_slots"] == 100 * heads * layers and aware["kept_by_layer"] == [100 * heads] * layers
    assert agnostic["context_slots"] == prompt["n_context"] * heads * layers
    assert aware["compressed_tokens"] == prompt["n_question_end"]
    assert agnostic["compressed_tokens"] == prompt["n_context"]
    # a head-wise press's masked keys are not kept
    model.model.layers[0].self_attn.masked_key_indices = (torch.zeros(5), torch.zeros(5), torch.arange(5))
    kept, per_layer = run_presses._kept_slots(model, _cache_of(model, 30))
    assert per_layer == [30 * heads - 5] + [30 * heads] * (layers - 1)
    del model.model.layers[0].self_attn.masked_key_indices
    assert tok.decode.__self__ is tok  # the pipeline's tokenizer has its own decode back


def _cache_of(model, n):
    from transformers import DynamicCache

    cache = DynamicCache()
    model.model(input_ids=torch.arange(4, 4 + n)[None], past_key_values=cache)
    return cache


def test_select_prompts_keeps_the_first_samples_of_the_tasks_asked(tok, books):
    prompts = _export(tok, books)["prompts"]
    chosen = run_presses.select_prompts(prompts, ["vt", "fwe"], 1, None)
    assert [(p["task"], p["sample"]) for p in chosen] == [("vt", 0), ("fwe", 0)]
    assert run_presses.select_prompts(prompts, None, None, [LENGTH + 1]) == []


# ---- scoring ---------------------------------------------------------------------------------------


def _raw_record(tok, prompt, press, ratio, setting, text, seconds=2.0, eos_then=""):
    """A record as run_presses writes it: the generated ids are the text's, then EOS and ``eos_then``."""
    ids = (tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
           + tok(eos_then, add_special_tokens=False)["input_ids"])
    split = prompt["n_question_end"] if setting == "query_aware" else prompt["n_context"]
    layers, heads = 2, 2
    kept = split if press == "no_press" else round(split * (1 - ratio))
    return {"press": press, "ratio": ratio, "setting": setting, "id": prompt["id"], "task": prompt["task"],
            "length": prompt["length"], "sample": prompt["sample"], "attn": "sdpa",
            "generated_kvpress": text, "generated_ids": ids, "compressed_tokens": split,
            "kept_context_slots": kept * layers * heads, "context_slots": split * layers * heads,
            "kept_by_layer": [kept * heads] * layers, "n_layers": layers, "n_kv_heads": heads, "head_dim": 8,
            "seconds": seconds}


def _raw(tok, doc, answer_for, presses=(("snapkv", 0.5), ("snapkv", 0.75), ("no_press", 0.0)), drop=None):
    records = []
    for press, ratio in presses:
        for setting in ("query_aware", "query_agnostic"):
            for p in doc["prompts"]:
                if drop == (press, ratio, setting, p["id"]):
                    continue
                text, after = answer_for(press, ratio, setting, p)
                records.append(_raw_record(tok, p, press, ratio, setting, text, eos_then=after))
    return {"format": run_presses.RAW_FORMAT, "model": doc["model"], "records": records,
            "failures": [{"press": "kvzip", "ratio": 0.5, "setting": "query_aware", "id": doc["prompts"][0]["id"],
                          "error": "ValueError: KVzipPress is not supported", "skipped": 7}],
            "kvpress": "0.5.5", "transformers": "5.2.0", "torch": "2.13.0", "threads": 1, "model_source": "x.gguf",
            "presses": {"no_press": "None", "snapkv": "SnapKVPress()", "kvzip": "KVzipPress()"}}


def test_scores_decode_as_evictlayers_and_fill_ruler_json(tok, books, tmp_path):
    doc = _export(tok, books)

    def answer_for(press, ratio, setting, p):
        # snapkv at 50% answers every reference, at 75% only niah_single_1's, and after EOS never counts
        right = " ".join(p["answers"])
        if press == "snapkv" and ratio == 0.75 and p["task"] != "niah_single_1":
            return "no idea", right
        return right, ""

    drop = ("snapkv", 0.75, "query_agnostic", doc["prompts"][-1]["id"])
    result = score.kvpress_result(tok, doc, [_raw(tok, doc, answer_for, drop=drop)])
    assert [(r["policy"], r["budget"], r["label"]) for r in result["runs"]] == \
        [("kvpress:snapkv", 0.5, "kvpress:snapkv@0.5"), ("kvpress:snapkv", 0.25, "kvpress:snapkv@0.25")]
    half, quarter = result["runs"]
    assert [compression_ratio(r) for r in result["runs"]] == [0.5, 0.75]
    assert half["scores"] == {s: {str(LENGTH): {t: 100.0 for t in TASKS}} for s in ("query_aware", "query_agnostic")}
    # the answer after EOS is cut off as evictlayers cuts it: only niah_single_1 scores
    assert quarter["scores"]["query_aware"][str(LENGTH)] == {"niah_single_1": 100.0, "niah_single_2": 0.0,
                                                             "vt": 0.0, "fwe": 0.0}
    # one prompt of the query-agnostic cell never ran: that cell is left out, and said so
    assert list(quarter["scores"]) == ["query_aware"]
    assert result["kvpress"]["incomplete"] == [{"press": "snapkv", "ratio": 0.75, "setting": "query_agnostic",
                                                "ran": len(doc["prompts"]) - 1, "of": len(doc["prompts"])}]
    assert result["kvpress"]["no_press"]["full_cache"] and result["kvpress"]["no_press"]["score"] == 100.0
    assert "kvpress:no_press" not in {r["policy"] for r in result["runs"]}  # it would replace evictlayers' full
    assert half["memory_by_setting"]["query_aware"]["kept_context_fraction"] == pytest.approx(0.5, abs=0.01)
    ex = half["examples"][0]
    assert ex["retained_slots"] < ex["full_slots"] and ex["generated"] == " ".join(doc["prompts"][0]["answers"])
    table = markdown_table(result)
    assert "| kvpress:snapkv | 50% | aware | 1800 | 100.0 | 100.0 | 100.0 | 100.0 | 100.0 |" in table
    assert "| kvpress:snapkv | 25% | aware | 1800 | 100.0 | 0.0 | 0.0 | 0.0 | 25.0 |" in table
    text = score.markdown(result)
    assert "KVzipPress is not supported (7 more prompts skipped)" in text
    assert f"ratio 0.75 query_agnostic: {len(doc['prompts']) - 1} of {len(doc['prompts'])} prompts ran" in text
    pytest.importorskip("matplotlib")
    assert plot_ruler([result], tmp_path / "plot.png").stat().st_size > 0


# ---- the whole chain against a real `evictlayers eval` run -----------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("kvpress-tiny-llama")
    tiny_llama(len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.usefixtures("single_thread")
def test_export_score_and_merge_with_a_cli_run(checkpoint, books, tmp_path, capsys):
    common = ["--model", str(checkpoint), "--split", "held_out", "--ruler-tasks", "niah_single_1", "fwe",
              "--lengths", "1200", "--ruler-samples", "1", "--max-new-tokens", "3", "--data-dir", str(books)]
    assert evictlayers_main(["eval", "full", "local", "--task", "ruler", "--budget", "0.5", "--ruler-setting",
                             "query_aware", "query_agnostic", "--threads", "1", "--no-progress",
                             "--out", str(tmp_path / "el"), *common]) == 0
    assert export_module.main([*common, "--out", str(tmp_path / "prompts.json")]) == 0
    cli = json.loads((tmp_path / "el" / "ruler.json").read_text())
    doc = json.loads((tmp_path / "prompts.json").read_text())
    assert doc["packaged_model"] is None and doc["model"] == str(checkpoint)
    # the export's prompts are the command line's, example for example
    full = next(r for r in cli["runs"] if r["full_cache"])
    for p in doc["prompts"]:
        ran = [e for e in full["examples"] if (e["task"], e["sample"]) == (p["task"], p["sample"])]
        assert {(e["n_tokens"], e["n_context"], tuple(e["answers"])) for e in ran} == \
            {(p["n_tokens"], p["n_context"], tuple(p["answers"]))}
    # a raw file whose no_press answers are the full cache's and whose snapkv answers are the references
    generated = {(e["setting"], e["task"]): e["generated"] for e in full["examples"]}
    tok = char_tokenizer()

    def answer_for(press, ratio, setting, p):
        return (generated[(setting, p["task"])] if press == "no_press" else " ".join(p["answers"])), ""

    raw = _raw(tok, doc, answer_for, presses=(("snapkv", 0.5), ("no_press", 0.0)))
    (tmp_path / "raw.json").write_text(json.dumps(raw))
    assert score.main([str(tmp_path / "prompts.json"), str(tmp_path / "raw.json"), "--evictlayers",
                       str(tmp_path / "el" / "ruler.json"), "--out", str(tmp_path / "kv")]) == 0
    printed = capsys.readouterr().out
    assert "The same answer text on 4 of 4 prompts." in printed
    merged = json.loads((tmp_path / "kv" / "ruler_with_evictlayers.json").read_text())
    assert [r["label"] for r in merged["runs"]] == ["full", "local@0.5", "kvpress:snapkv@0.5"]
    assert "| kvpress:snapkv | 50% | agnostic | 1200 | 100.0 | 100.0 | 100.0 |" in markdown_table(merged)
    # the transfer report reads the presses' ruler.json beside the recipes' (one held-out split, one model)
    lines = "\n".join(transfer_report(merge(load_results([tmp_path / "el", tmp_path / "kv" / "ruler.json"]))))
    assert "kvpress:snapkv" in lines and "local" in lines
    pytest.importorskip("matplotlib")
    assert (tmp_path / "kv" / "ruler_with_evictlayers.png").stat().st_size > 0


def test_merge_refuses_a_run_of_other_prompts(tok, books):
    doc = _export(tok, books)
    result = score.kvpress_result(tok, doc, [_raw(tok, doc, lambda *a: (" ".join(a[3]["answers"]), ""))])
    other = {"task": "ruler", "model": "tiny", "runs": [],
             "settings": {**result["settings"], "samples": 3, "split": "tuning"}}
    with pytest.raises(ValueError, match="samples: evictlayers 3, kvpress 2; split: evictlayers 'tuning'"):
        score.merge_with(result, other)
    with pytest.raises(ValueError, match="model: evictlayers 'big'"):
        score.merge_with(result, {**other, "model": "big", "settings": result["settings"]})
