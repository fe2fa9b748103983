"""ExpectedAttention (arXiv:2510.00636, kvpress's ExpectedAttentionPress) against a slow reference written from
the formula, and on tiny models.

The reference works in absolute positions with explicit matrices, where the scorer works in a rotating frame
on post-RoPE queries: it takes the pre-RoPE queries the test drew, their mean and biased covariance per query
head (positions ``>= n_sink``), the rotation matrices ``R(t)`` built from RoPE's formula averaged over the next
``T`` positions, ``mu_f = R_bar mu`` and ``Sigma_f = R_bar Sigma R_bar^T``, the expected log-attention
``scaling mu_f . k + scaling^2 k^T Sigma_f k / 2`` of each post-RoPE key, a softmax over the head's held keys
past the sinks, the GQA group's mean and ``(. + epsilon) ||v||``, all in float64 loops.
"""

from __future__ import annotations

import math

import pytest
import torch

import evictlayers as el
from evictlayers.compose.positions import RotaryTable
from evictlayers.scoring import SlotView
from tiny_models import build, left_padded, single_thread  # noqa: F401

BASE = 10000.0
HEAD_DIM = 16
SCALING = 0.3  # not 16 ** -0.5: the scorer must take the model's scaling


# ---- the reference -------------------------------------------------------------------------------


def _angles(position: int, rotary: int) -> list[float]:
    return [position * BASE ** (-2 * i / rotary) for i in range(rotary // 2)]


def rotation(position: int, rotary: int, dim: int = HEAD_DIM) -> torch.Tensor:
    """``[D, D]`` float64 RoPE matrix at ``position`` from the formula (rotate-half pairs ``(i, i + R/2)`` of the
    first ``rotary`` dims, the identity on the rest)."""
    matrix, half = torch.eye(dim, dtype=torch.float64), rotary // 2
    for i, angle in enumerate(_angles(position, rotary)):
        c, s = math.cos(angle), math.sin(angle)
        matrix[i, i], matrix[i, i + half], matrix[i + half, i], matrix[i + half, i + half] = c, -s, s, c
    return matrix


def formula_table(rotary: int) -> RotaryTable:
    def compute(rows, device, dtype):
        inverse = BASE ** (-torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
        angles = torch.arange(rows, dtype=torch.float64)[:, None] * inverse
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)

    return RotaryTable(compute)


class Reference:
    """One batch row's tokens (pre-RoPE queries per query head, post-RoPE keys, values), by position."""

    def __init__(self, rotary: int, future: int, n_sink: int, scaling: float, covariance: bool):
        self.rotary, self.future, self.n_sink, self.scaling, self.covariance = rotary, future, n_sink, scaling, covariance
        self._rotations: dict[int, torch.Tensor] = {}

    def r(self, position: int) -> torch.Tensor:
        if position not in self._rotations:
            self._rotations[position] = rotation(position, self.rotary)
        return self._rotations[position]

    def averaged(self, start: int) -> torch.Tensor:
        """``R_bar = mean_{t = start}^{start + T - 1} R(t)``."""
        return sum(self.r(t) for t in range(start, start + self.future)) / self.future

    def logits(self, queries: torch.Tensor, key: torch.Tensor, next_position: int) -> torch.Tensor:
        """``[G]`` expected log-attention of ``key`` ``[D]`` (post-RoPE) for the query heads whose pre-RoPE queries
        ``[G, n, D]`` (those at positions ``>= n_sink``) are given, the future starting at ``next_position``."""
        out = torch.zeros(queries.shape[0], dtype=torch.float64)
        r_bar = self.averaged(next_position)
        for g in range(queries.shape[0]):
            q = queries[g]
            mu = q.mean(0) if len(q) else torch.zeros(q.shape[-1], dtype=torch.float64)
            sigma = ((q - mu).T @ (q - mu)) / max(len(q), 1)
            mu_f, sigma_f = r_bar @ mu, r_bar @ sigma @ r_bar.T
            out[g] = self.scaling * (mu_f @ key)
            if self.covariance:
                out[g] += self.scaling**2 / 2 * (key @ sigma_f @ key)
        return out


def reference_scores(held: dict[int, tuple[torch.Tensor, float]], n_sink: int, epsilon: float, vnorm: bool):
    """``{position: score}`` of a head's held tokens past the sinks: ``held`` maps a position to its ``[G]`` logits
    and ``||v||``."""
    counted = [p for p in held if p >= n_sink]
    logits = torch.stack([held[p][0] for p in counted])  # [n, G]
    probabilities = torch.softmax(logits, dim=0).mean(1)
    return {
        p: float((probabilities[i] + epsilon) * held[p][1]) if vnorm else float(probabilities[i])
        for i, p in enumerate(counted)
    }


# ---- the data: two left-padded rows, GQA ------------------------------------------------------------


def draw(lengths: list[int], steps: int, group: int, rotary: int, seed: int = 0):
    """Pre-RoPE queries and keys, values, per row ``[H, n_tokens, D]`` by position, and the step tensors as the
    attention function receives them (post-RoPE at each row's positions, left padding)."""
    g = torch.Generator().manual_seed(seed)
    kv_heads, width = 2, max(lengths)
    q_heads = kv_heads * group
    tokens = [length + steps for length in lengths]
    offset = torch.randn(q_heads, 1, HEAD_DIM, generator=g, dtype=torch.float64) * 1.5  # queries far from 0 mean
    pre_q = [torch.randn(q_heads, n, HEAD_DIM, generator=g, dtype=torch.float64) + offset for n in tokens]
    pre_k = [torch.randn(kv_heads, n, HEAD_DIM, generator=g, dtype=torch.float64) for n in tokens]
    values = [torch.randn(kv_heads, n, 12, generator=g, dtype=torch.float64) for n in tokens]
    ref = Reference(rotary, 1, 0, 1.0, True)
    post_q = [torch.stack([pre_q[b][:, p] @ ref.r(p).T for p in range(n)], 1) for b, n in enumerate(tokens)]
    post_k = [torch.stack([pre_k[b][:, p] @ ref.r(p).T for p in range(n)], 1) for b, n in enumerate(tokens)]
    # the prompt step: columns of padding hold junk, which nothing may read
    query = torch.randn(len(lengths), q_heads, width, HEAD_DIM, generator=g, dtype=torch.float64) * 50
    key = torch.randn(len(lengths), kv_heads, width, HEAD_DIM, generator=g, dtype=torch.float64) * 50
    value = torch.randn(len(lengths), kv_heads, width, 12, generator=g, dtype=torch.float64)
    real = torch.zeros(len(lengths), width, dtype=torch.bool)
    for b, length in enumerate(lengths):
        query[b, :, width - length :] = post_q[b][:, :length]
        key[b, :, width - length :] = post_k[b][:, :length]
        value[b, :, width - length :] = values[b][:, :length]
        real[b, width - length :] = True
    prompt = (query.float(), key.float(), value.float(), real)

    def decode(i: int):
        at = [length + i for length in lengths]
        return tuple(
            torch.stack([source[b][:, at[b]] for b in range(len(lengths))])[:, :, None].float()
            for source in (post_q, post_k, values)
        )

    return pre_q, post_k, values, prompt, decode


CASES = {
    # group, rotary dims, T, covariance, value norm, n_sink, epsilon
    "gqa3-kvpress-defaults": (3, 16, 512, True, True, 4, 0.0),
    "gqa2-partial-rotary-short-future": (2, 8, 7, True, True, 2, 0.01),
    "gqa3-mean-only-no-vnorm-no-sinks": (3, 16, 33, False, False, 0, 0.0),
}


def _policy(case, budget):
    _, _, future, covariance, vnorm, n_sink, epsilon = case
    scorer = el.ExpectedAttention(future, n_sink, covariance, vnorm, epsilon)
    return el.Policy(el.HeavyHitterSelector(scorer), budget=budget, min_budget=1), scorer


def _store_scores(store, scorer):
    view = SlotView(pos=store.pos, seen=store.seen, budget=store.budget)
    return scorer.score(store.state, view)


@pytest.mark.parametrize("name", list(CASES))
def test_scores_equal_the_reference_at_prefill_and_while_decoding(name):
    """Nothing evicted: after the prompt every slot's logits are the prompt statistics' (future from the prompt's
    end), each decoded key's are the statistics through its own query (future from the next position), and the
    score normalises over every held key at each step."""
    case = CASES[name]
    group, rotary, future, covariance, vnorm, n_sink, epsilon = case
    lengths, steps = [23, 17], 4
    pre_q, post_k, values, prompt, decode = draw(lengths, steps, group, rotary)
    policy, scorer = _policy(case, None)
    store = el.SlotStore(policy, rotary=formula_table(rotary))
    store.step(*prompt, scaling=SCALING)
    ref = Reference(rotary, future, n_sink, SCALING, covariance)
    held = [{} for _ in lengths]  # per row: {(head, position): (logits [G], ||v||)}

    def arrive(b, positions, next_position):
        for h in range(2):
            queries = pre_q[b][h * group : (h + 1) * group, n_sink:next_position]  # counted queries so far
            for p in positions:
                logits = ref.logits(queries, post_k[b][h, p], next_position)
                held[b][h, p] = (logits, float(values[b][h, p].norm()))

    for b, length in enumerate(lengths):
        arrive(b, range(length), length)
    for step in range(steps + 1):
        if step:
            store.step(*decode(step - 1), scaling=SCALING)
            for b, length in enumerate(lengths):
                arrive(b, [length + step - 1], length + step)
        scores = _store_scores(store, scorer)
        for b in range(len(lengths)):
            for h in range(2):
                mine = {int(p): j for j, p in enumerate(store.pos[b, h].tolist()) if p >= 0}
                assert sorted(mine) == list(range(lengths[b] + step))
                for p, j in mine.items():
                    torch.testing.assert_close(
                        store.state["expected_logit"][b, h, j].double(), held[b][h, p][0], rtol=2e-4, atol=2e-4
                    )
                expected = reference_scores({p: held[b][h, p] for p in mine}, n_sink, epsilon, vnorm)
                for p, want in expected.items():
                    assert float(scores[b, h, mine[p]]) == pytest.approx(want, rel=2e-4, abs=1e-6), (b, h, p, step)
                sinks = [float(scores[b, h, mine[p]]) for p in mine if p < n_sink]
                assert all(s > max(expected.values()) for s in sinks)


@pytest.mark.parametrize("name", list(CASES))
def test_eviction_keeps_what_the_reference_ranking_keeps(name):
    """A 9-token budget: the prompt keeps each head's 9 best, then every generated token arrives with its score
    and the head's lowest score goes (H2O's one a step), step by step as the reference decides it."""
    case = CASES[name]
    group, rotary, future, covariance, vnorm, n_sink, epsilon = case
    lengths, steps, budget = [23, 17], 6, 9
    pre_q, post_k, values, prompt, decode = draw(lengths, steps, group, rotary, seed=3)
    policy, _ = _policy(case, budget)
    store = el.SlotStore(policy, rotary=formula_table(rotary))
    store.step(*prompt, scaling=SCALING)
    ref = Reference(rotary, future, n_sink, SCALING, covariance)
    kept = [[{} for _ in range(2)] for _ in lengths]

    def ranking(b, h):
        scores = reference_scores(kept[b][h], n_sink, epsilon, vnorm)
        return sorted(kept[b][h], key=lambda p: (p < n_sink, scores.get(p, 0.0)))  # lowest first; sinks never go

    for b, length in enumerate(lengths):
        for h in range(2):
            queries = pre_q[b][h * group : (h + 1) * group, n_sink:length]
            for p in range(length):
                kept[b][h][p] = (ref.logits(queries, post_k[b][h, p], length), float(values[b][h, p].norm()))
            for p in ranking(b, h)[: length - budget]:
                del kept[b][h][p]
    for step in range(steps + 1):
        if step:
            store.step(*decode(step - 1), scaling=SCALING)
            for b, length in enumerate(lengths):
                p = length + step - 1
                for h in range(2):
                    queries = pre_q[b][h * group : (h + 1) * group, n_sink : p + 1]
                    kept[b][h][p] = (ref.logits(queries, post_k[b][h, p], p + 1), float(values[b][h, p].norm()))
                    del kept[b][h][ranking(b, h)[0]]
        for b in range(len(lengths)):
            for h in range(2):
                assert sorted(p for p in store.pos[b, h].tolist() if p >= 0) == sorted(kept[b][h]), (b, h, step)


def test_a_prompt_in_chunks_leaves_the_statistics_and_scores_of_one_forward():
    """The held statistics turn with the frame and merge each chunk's queries (Chan's update): a prompt fed in
    three chunks ends with the state one forward leaves, every slot rescored at the last chunk."""
    case = CASES["gqa3-kvpress-defaults"]
    pre_q, post_k, values, (query, key, value, real), _ = draw([23, 17], 0, 3, 16, seed=5)
    whole = el.SlotStore(_policy(case, None)[0], rotary=formula_table(16))
    whole.step(query, key, value, real, scaling=SCALING)
    chunked = el.SlotStore(_policy(case, None)[0], rotary=formula_table(16))
    for cut in (slice(0, 9), slice(9, 14), slice(14, 23)):
        chunked.step(query[:, :, cut], key[:, :, cut], value[:, :, cut], real[:, cut], scaling=SCALING)
    assert torch.equal(whole.pos, chunked.pos)
    for name, tensor in whole.state.items():
        torch.testing.assert_close(chunked.state[name], tensor, rtol=1e-4, atol=1e-4, msg=name)


# ---- validation --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"n_future_positions": 0}, r"ExpectedAttention\(n_future_positions=0\): n_future_positions must be an int >= 1"),
        ({"n_future_positions": 2.5}, r"n_future_positions=2.5\): n_future_positions must be an int >= 1"),
        ({"n_sink": -1}, r"ExpectedAttention\(n_sink=-1\): n_sink must be an int >= 0"),
        ({"n_sink": True}, r"ExpectedAttention\(n_sink=True\): n_sink must be an int >= 0"),
        ({"use_covariance": "yes"}, r"ExpectedAttention\(use_covariance='yes'\): use_covariance must be True or False"),
        ({"use_vnorm": 1}, r"ExpectedAttention\(use_vnorm=1\): use_vnorm must be True or False"),
        ({"epsilon": -0.1}, r"ExpectedAttention\(epsilon=-0.1\): epsilon must be a finite number >= 0"),
        ({"epsilon": float("inf")}, r"ExpectedAttention\(epsilon=inf\): epsilon must be a finite number >= 0"),
    ],
    ids=["future-0", "future-float", "sink-negative", "sink-bool", "covariance-str", "vnorm-int", "epsilon-negative",
         "epsilon-inf"],
)
def test_bad_arguments_name_the_value_and_what_is_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        el.ExpectedAttention(**kwargs)


def test_refused_with_rolling_positions_and_without_a_rotary_table():
    with pytest.raises(ValueError, match=r"positions='rolling'\) cannot hold ExpectedAttention"):
        el.Policy(el.HeavyHitterSelector(el.ExpectedAttention()), budget=8, positions="rolling")
    store = el.SlotStore(el.load_recipe("expected_attention"))
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 1, 5, 16)
    with pytest.raises(ValueError, match="needs the model's rotary table"):
        store.step(q, k, k, scaling=0.25)


def test_the_recipe_is_kvpress_composition():
    assert el.load_recipe("expected_attention") == el.Policy(
        el.SinkTokens(4), el.HeavyHitterSelector(el.ExpectedAttention()), budget=0.2
    )
    policy = el.load_recipe("expected_attention")
    assert policy.reads_queries and policy.rotary_rows == 512
    assert not policy.reads_mass and not policy.decode_needs_mass  # no attention mass is computed


# ---- tiny models -------------------------------------------------------------------------------------


def _greedy(model, ids, mask, new_tokens, cache=None):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, past_key_values=cache)
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_shipped_recipe_generates_within_its_budget(family):
    """20% of a long left-padded prompt (RoPE does not need max_position_embeddings): every layer holds at most
    its budget after the prompt and while generating, the model's positions untouched (no rolling), and
    something was evicted."""
    model = build(family)
    ids, mask = left_padded([190, 171])
    policy = el.load_recipe("expected_attention")
    full_tokens, full_logits = _greedy(model, ids, mask, 8)
    with el.apply(model, policy) as run:
        assert run.rotary is None and run.query_rotary is not None  # the tables, without rolling's position 0
        tokens, logits = _greedy(model, ids, mask, 8)
        layers = run.cache.stats()["layers"]
    assert all(layer["retained_tokens"] <= 38 for layer in layers)  # 0.2 * 190 = 38 tokens per head
    assert all(layer["state_bytes"] > 0 for layer in layers)
    assert (logits - full_logits).abs().max() > 1e-3, "nothing was evicted"
    assert tokens.shape == full_tokens.shape


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt_neox"])
def test_a_budget_that_evicts_nothing_gives_the_unmodified_models_logits(family):
    """RoPE families with their edge cases (GQA, a sliding window, QK-norm, Gemma 2's soft-cap, scaling and
    mixed layers, partial rotary): the scorer runs at every step, and the model's positions are its own."""
    model = build(family)
    ids, mask = left_padded([20, 13])
    want_tokens, want = _greedy(model, ids, mask, 6)
    with el.apply(model, el.load_recipe("expected_attention").replace(budget=64)):
        tokens, got = _greedy(model, ids, mask, 6)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family,name", [("gpt2", "GPT2LMHeadModel"), ("opt", "OPTForCausalLM")])
def test_a_model_without_rotary_positions_is_refused_naming_it_and_the_scorer(family, name):
    model = build(family)
    with pytest.raises(el.UnsupportedModelError, match=rf"ExpectedAttention .*{name}"):
        el.apply(model, el.load_recipe("expected_attention"))
    assert getattr(model, "_evictlayers_run", None) is None  # restored


def _decode_loop(model, policy, compile, steps):
    ids, mask = left_padded([20, 13])
    tokens, logits = [], []
    with torch.no_grad(), el.apply(model, policy, compile=compile) as run:
        cache = run.new_cache()
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1].float().clone())
        path = run.stats().get("compiled_decode")
    return torch.cat(tokens, 1), torch.stack(logits), path


def test_compiled_decode_gives_the_eager_tokens():
    model = build("llama")
    policy = el.load_recipe("expected_attention").replace(budget=10)
    eager_tokens, eager_logits, _ = _decode_loop(model, policy, False, 40)
    torch._dynamo.reset()
    tokens, logits, path = _decode_loop(model, policy, True, 40)
    assert path["graph_steps"] > 0, path  # the whole forward's graph ran
    assert torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-4)
