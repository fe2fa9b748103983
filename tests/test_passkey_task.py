"""Passkey prompts: length, key placement, determinism, scoring; slow: real tokenizer and model."""

import re
import subprocess
import sys

import pytest

from evictlayers.eval import PasskeyPrompt, passkey_grid, passkey_prompts, score_passkey
from evictlayers.eval.tasks import passkey


class WordTokenizer:
    """Stand-in tokenizer: one token per word or punctuation mark."""

    chat_template = None

    def encode(self, text):
        return [hash(piece) for piece in re.findall(r"\w+|[^\w\s]", text)]

    def __call__(self, text):
        return {"input_ids": self.encode(text)}


class ChatWordTokenizer(WordTokenizer):
    chat_template = "fake"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        body = "".join(f"<{m['role']}>\n{m['content']}\n" for m in messages)
        return body + ("<assistant>\n" if add_generation_prompt else "")


def _split(prompt: PasskeyPrompt):
    """(filler sentences before the key, filler sentences after it) in the prompt."""
    key = passkey.key_sentence(prompt.answer)
    before, after = prompt.text.split(key)
    pattern = "|".join(re.escape(s) for s in passkey.FILLER_SENTENCES)
    return len(re.findall(pattern, before)), len(re.findall(pattern, after))


@pytest.mark.parametrize("target", [200, 1500, 4000])
def test_prompts_hit_the_target_length(target):
    tok = WordTokenizer()
    for prompt in passkey_prompts(tok, n_prompts=3, target_tokens=target):
        assert prompt.n_tokens == len(tok.encode(prompt.text))
        assert abs(prompt.n_tokens - target) <= 0.1 * target


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.9, 1.0])
def test_key_sits_at_the_requested_depth(depth):
    (prompt,) = passkey_prompts(WordTokenizer(), n_prompts=1, target_tokens=1500, depth=depth)
    before, after = _split(prompt)
    assert before + after > 100
    assert before == round(depth * (before + after))
    assert prompt.depth == depth


def test_prompt_shape():
    for prompt in passkey_prompts(WordTokenizer(), n_prompts=4, target_tokens=500):
        assert re.fullmatch(r"[1-9]\d{4}", prompt.answer)
        assert prompt.text.count(passkey.key_sentence(prompt.answer)) == 1
        assert prompt.text.count(prompt.answer) == 2
        assert prompt.text.startswith(passkey.INSTRUCTION)
        assert prompt.text.endswith("What is the pass key? The pass key is")


def test_key_at_the_ends():
    first, last = passkey_prompts(WordTokenizer(), n_prompts=2, target_tokens=500)
    key = passkey.key_sentence(first.answer)
    assert first.text.startswith(f"{passkey.INSTRUCTION} {key}")
    assert last.text.endswith(f"{passkey.key_sentence(last.answer)} What is the pass key? The pass key is")


def test_default_depths_spread_evenly():
    prompts = passkey_prompts(WordTokenizer(), n_prompts=5, target_tokens=300)
    assert [p.depth for p in prompts] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert passkey_prompts(WordTokenizer(), n_prompts=1, target_tokens=300)[0].depth == 0.5


def test_deterministic_per_seed():
    tok = WordTokenizer()
    assert passkey_prompts(tok, seed=3, target_tokens=300) == passkey_prompts(tok, seed=3, target_tokens=300)
    a = [p.answer for p in passkey_prompts(tok, seed=3, target_tokens=300)]
    b = [p.answer for p in passkey_prompts(tok, seed=4, target_tokens=300)]
    assert a != b


def test_chat_format_wraps_in_the_template():
    (prompt,) = passkey_prompts(ChatWordTokenizer(), n_prompts=1, target_tokens=400, chat=True)
    assert prompt.text.startswith("<user>\n" + passkey.INSTRUCTION)
    assert prompt.text.endswith("What is the pass key?\n<assistant>\nThe pass key is")
    assert abs(prompt.n_tokens - 400) <= 40


def test_bad_arguments_are_explained():
    tok = WordTokenizer()
    with pytest.raises(ValueError, match="depth must be a fraction in \\[0, 1\\]"):
        passkey_prompts(tok, depth=1.5)
    with pytest.raises(ValueError, match="n_prompts must be >= 1"):
        passkey_prompts(tok, n_prompts=0)
    with pytest.raises(ValueError, match="target_tokens=10 is too short"):
        passkey_prompts(tok, target_tokens=10)
    with pytest.raises(ValueError, match="chat template"):
        passkey_prompts(tok, chat=True)


def test_grid_cells():
    tok = WordTokenizer()
    grid = passkey_grid(tok, lengths=[300, 600], depths=[0.0, 0.5, 1.0], per_cell=2, seed=1)
    assert list(grid) == [(300, 0.0), (300, 0.5), (300, 1.0), (600, 0.0), (600, 0.5), (600, 1.0)]
    for (length, depth), prompts in grid.items():
        assert len(prompts) == 2
        assert all(p.depth == depth and abs(p.n_tokens - length) <= 0.1 * length for p in prompts)
    assert grid == passkey_grid(tok, lengths=[300, 600], depths=[0.0, 0.5, 1.0], per_cell=2, seed=1)
    answers = [p.answer for prompts in grid.values() for p in prompts]
    assert len(set(answers)) > len(answers) // 2


@pytest.mark.parametrize(
    "generated, expected",
    [
        (" 48213.", True),
        (" 48213. Remember it.", True),
        ("48213", True),
        (" is 48213", True),
        (" 4821", False),
        (" 482130", False),
        (" 12345 or 48213", False),
        (" the pass key.", False),
        ("", False),
    ],
)
def test_score_passkey(generated, expected):
    assert score_passkey(generated, "48213") is expected


def test_eval_package_imports_no_lightning_or_datasets():
    code = "import sys, evictlayers.eval; print(any(m in sys.modules for m in ('lightning', 'datasets')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.fixture(scope="module")
def default_model():
    from evictlayers import models

    return models.load_default()


@pytest.mark.slow
def test_real_tokenizer_lengths(default_model):
    _, tokenizer = default_model
    for target in (500, 1500, 4000):
        for prompt in passkey_prompts(tokenizer, n_prompts=3, target_tokens=target):
            assert abs(prompt.n_tokens - target) <= 0.1 * target
            assert prompt.n_tokens == len(tokenizer(prompt.text)["input_ids"])


@pytest.mark.slow
def test_full_cache_model_finds_most_keys(default_model):
    import torch

    model, tokenizer = default_model
    prompts = passkey_prompts(tokenizer, n_prompts=8, target_tokens=1500, seed=0)
    inputs = tokenizer([p.text for p in prompts], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    correct = sum(score_passkey(t, p.answer) for t, p in zip(texts, prompts))
    assert correct >= 6, list(zip(texts, [p.answer for p in prompts]))


BOOK = " ".join(
    f"Sentence {i} of the made-up book tells of {'ships' if i % 2 else 'hills'} and weather number {i}."
    for i in range(3000)
)


def test_prose_haystack_uses_book_sentences_at_the_depth():
    texts = [("a.txt", BOOK), ("b.txt", BOOK.replace("made-up", "invented"))]
    prompts = passkey_prompts(WordTokenizer(), n_prompts=4, target_tokens=400, seed=3, haystack="prose", texts=texts)
    for prompt in prompts:
        assert abs(prompt.n_tokens - 400) <= 25  # within about one sentence (~21 words)
        key = passkey.key_sentence(prompt.answer)
        assert prompt.text.count(key) == 1
        before, after = prompt.text.split(key)
        n_before = before.count("Sentence ")
        n_after = after.count("Sentence ")
        assert abs(n_before / (n_before + n_after) - prompt.depth) <= 0.1
        assert "grass is green" not in prompt.text
    assert "invented" in prompts[1].text and "made-up" in prompts[0].text  # prompt i takes book i % 2
    first = [re.search(r"Sentence (\d+)", p.text).group(1) for p in prompts]
    assert len(set(first)) == 4  # each prompt starts at its own offset
    again = passkey_prompts(WordTokenizer(), n_prompts=4, target_tokens=400, seed=3, haystack="prose", texts=texts)
    assert [p.text for p in again] == [p.text for p in prompts]


def test_prose_haystack_errors_name_the_problem():
    with pytest.raises(ValueError, match="haystack='poetry'"):
        passkey_prompts(WordTokenizer(), haystack="poetry")
    with pytest.raises(ValueError, match="needs texts"):
        passkey_prompts(WordTokenizer(), haystack="prose")
