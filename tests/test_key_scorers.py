"""KeyDiff, KeyNorm, pooling, layer-scoped and shared-budget selection against plain-loop references
(tests/reference_retrieval.py): the retained set after prefill and after every decode step."""

import pytest
import torch

import evictlayers as el
from reference_retrieval import keydiff_scores, keynorm_scores, pooled, run_reference, split_keep


def _retained(store: el.SlotStore, row: int = 0, head: int = 0) -> set[int]:
    pos = store.pos[row, head]
    return set(pos[pos >= 0].tolist())


def _drive(policy: el.Policy, keys: torch.Tensor, prompt: int, heads: int = 1) -> tuple[el.SlotStore, list]:
    """Feed ``keys`` ``[heads, n, d]`` (queries and values random) as a prefill of ``prompt`` tokens then
    single steps; returns the store and its per-head retained sets after each step."""
    n, d = keys.shape[1], keys.shape[2]
    q, v = torch.randn(heads, n, d), torch.randn(heads, n, d)
    store = el.SlotStore(policy)
    history = []
    for start, stop in [(0, prompt)] + [(i, i + 1) for i in range(prompt, n)]:
        store.step(q[None, :, start:stop], keys[None, :, start:stop], v[None, :, start:stop], scaling=d**-0.5)
        history.append([_retained(store, head=h) for h in range(heads)])
    return store, history


def _lowest_out(score_fn):
    """keep_fn for one selector: drop the lowest scores (ties: the oldest goes first)."""
    def keep(held, budget):
        scores = score_fn(held)
        return sorted(sorted(held, key=lambda j: (-scores[j], -j))[:budget])
    return keep


@pytest.mark.parametrize("accumulator,score_fn", [(el.KeyDiff(), keydiff_scores), (el.KeyNorm(), keynorm_scores)],
                         ids=["keydiff", "keynorm"])
@pytest.mark.parametrize("prompt,budget", [(20, 8), (5, 8), (1, 3)], ids=str)
def test_key_scorer_matches_reference(accumulator, score_fn, prompt, budget):
    torch.manual_seed(prompt * 7 + budget)
    keys = torch.randn(1, 40, 16) + torch.tensor([2.0] + [0.0] * 15)  # a shared direction, as real keys have
    _, history = _drive(el.Policy(el.HeavyHitterSelector(accumulator), budget=budget), keys, prompt)
    expected = run_reference(keys[0], prompt, budget, _lowest_out(lambda held: score_fn(keys[0], held)))
    assert [h[0] for h in history] == expected


def test_keydiff_anchor_is_kept_incrementally():
    """The per-head anchor equals the sum of the held keys' unit vectors after every step (no drift)."""
    torch.manual_seed(3)
    keys = torch.randn(2, 60, 8) + 1.0
    store = el.SlotStore(el.Policy(el.HeavyHitterSelector(el.KeyDiff()), budget=10))
    q, v = torch.randn(2, 60, 8), torch.randn(2, 60, 8)
    store.step(q[None, :, :25], keys[None, :, :25], v[None, :, :25], scaling=0.3)
    for i in range(25, 60):
        store.step(q[None, :, i : i + 1], keys[None, :, i : i + 1], v[None, :, i : i + 1], scaling=0.3)
        for head in range(2):
            held = sorted(_retained(store, head=head))
            expected = torch.stack([keys[head, j] / keys[head, j].norm() for j in held]).sum(0)
            torch.testing.assert_close(store.state["anchor"][0, head], expected, atol=1e-5, rtol=1e-5)


def test_keydiff_keeps_the_odd_key_among_repeats():
    """A needle among near-identical filler keys survives a 25% budget (KeyDiff's motivation)."""
    torch.manual_seed(4)
    filler = torch.randn(1, 1, 8)
    keys = filler + 0.05 * torch.randn(1, 64, 8)
    keys[0, 20] = torch.randn(8)  # the needle
    _, history = _drive(el.Policy(el.HeavyHitterSelector(el.KeyDiff()), budget=16), keys, prompt=48)
    assert all(20 in h[0] for h in history)


def test_keynorm_near_equal_norms_evict_the_oldest():
    """A repeated token's keys differ only by RoPE, which keeps the norm: rounding noise (here 1e-6
    relative) must not decide which goes; the oldest of the near-tied highest norms does."""
    key = torch.randn(8, generator=torch.Generator().manual_seed(0))
    key = key / key.norm() * 2.0
    keys = torch.stack([key, key * (1 + 1e-6), key * 0.5, key * 0.25])[None, None]  # positions 0..3
    store = el.SlotStore(el.Policy(el.HeavyHitterSelector(el.KeyNorm()), budget=3))
    store.step(keys[:, :, :3], keys[:, :, :3], keys[:, :, :3], scaling=1.0)
    assert sorted(store.pos[0, 0][store.pos[0, 0] >= 0].tolist()) == [0, 1, 2]
    store.step(keys[:, :, 3:], keys[:, :, 3:], keys[:, :, 3:], scaling=1.0)
    assert sorted(store.pos[0, 0][store.pos[0, 0] >= 0].tolist()) == [1, 2, 3]  # the exact rule would drop 1


@pytest.mark.parametrize("reduce,side,width", [("mean", "both", 5), ("max", "both", 5), ("mean", "before", 4),
                                               ("max", "before", 6)])
def test_pooled_selection_matches_reference(reduce, side, width):
    torch.manual_seed(5)
    keys = torch.randn(1, 36, 8) * 2
    selector = el.HeavyHitterSelector(el.KeyNorm(), refine=[el.PooledScores(width, reduce, side)])
    _, history = _drive(el.Policy(selector, budget=10), keys, prompt=24)
    keep = _lowest_out(lambda held: pooled(keynorm_scores(keys[0], held), width, reduce, side))
    assert [h[0] for h in history] == run_reference(keys[0], 24, 10, keep)


def test_pooling_keeps_a_multi_token_needle_whole():
    """Three adjacent needle tokens, one of them unremarkable on its own: pooling keeps all three."""
    keys = torch.ones(1, 40, 4)
    keys[0, :, 0] = torch.linspace(1.0, 1.2, 40)  # filler norms: gently rising
    keys[0, 15:18] = torch.tensor([[0.1, 0, 0, 0], [3.0, 0, 0, 0], [0.1, 0, 0, 0]])  # small norms around a big one
    unpooled = _drive(el.Policy(el.HeavyHitterSelector(el.KeyNorm()), budget=6), keys, prompt=40)[1][-1][0]
    pooled_set = _drive(el.Policy(el.HeavyHitterSelector(el.KeyNorm(), refine=[el.PooledScores(3)]), budget=6), keys,
                        prompt=40)[1][-1][0]
    assert {15, 17} <= unpooled and 16 not in unpooled
    assert {15, 16, 17} <= pooled_set


def test_pooling_before_carries_a_score_forward_only():
    """One token with a small key norm (KeyNorm keeps those) among equal filler: pooled over it and the
    two tokens before, its score lifts the two tokens after it, not the ones before (a centred window
    lifts both sides)."""
    keys = torch.ones(1, 40, 4)
    keys[0, 20] = torch.tensor([0.1, 0, 0, 0])
    def kept(pooling):
        return _drive(el.Policy(el.HeavyHitterSelector(el.KeyNorm(), refine=[pooling]), budget=3), keys,
                      prompt=40)[1][-1][0]
    assert kept(el.PooledScores(3, reduce="max", side="before")) == {20, 21, 22}
    assert kept(el.PooledScores(3, reduce="max")) == {19, 20, 21}


def _chunk_sums(scores: dict[int, float], chunk: int, reduce: str = "sum") -> dict[int, float]:
    """ChunkKV's chunk score by a loop: each held token gets the sum (or mean) over the held tokens of its chunk."""
    out = {}
    for j in scores:
        members = [v for i, v in scores.items() if i // chunk == j // chunk]
        out[j] = sum(members) / (len(members) if reduce == "mean" else 1)
    return out


@pytest.mark.parametrize("chunk,budget,reduce", [(4, 10, "sum"), (3, 7, "sum"), (10, 12, "sum"), (4, 10, "mean"),
                                                 (3, 7, "mean")], ids=str)
def test_chunked_selection_matches_reference(chunk, budget, reduce):
    torch.manual_seed(chunk * 11 + budget)
    keys = torch.randn(1, 44, 8) * 2
    policy = el.Policy(el.HeavyHitterSelector(el.KeyNorm(), refine=[el.ChunkScores(chunk, reduce)]), budget=budget)
    _, history = _drive(policy, keys, prompt=30)
    keep = _lowest_out(lambda held: _chunk_sums(keynorm_scores(keys[0], held), chunk, reduce))
    assert [h[0] for h in history] == run_reference(keys[0], 30, budget, keep)


def test_chunks_after_a_prefill_are_whole():
    """Budget 12 with chunks of 4 on a 40-token prompt: exactly three whole chunks stay."""
    torch.manual_seed(8)
    keys = torch.randn(1, 40, 8) * 2
    policy = el.Policy(el.HeavyHitterSelector(el.KeyNorm(), refine=[el.ChunkScores(4)]), budget=12)
    kept = _drive(policy, keys, prompt=40)[1][-1][0]
    assert len(kept) == 12 and all({4 * (j // 4) + i for i in range(4)} <= kept for j in kept)


def test_chunk_length_is_checked():
    with pytest.raises(ValueError, match=r"ChunkScores\(size=0\).*int >= 2"):
        el.ChunkScores(0)
    with pytest.raises(ValueError, match=r"ChunkScores\(size=1\).*leave ChunkScores out for no chunks"):
        el.ChunkScores(1)
    with pytest.raises(ValueError, match=r"size='sentence'.*SentenceScores\(cap\) chunks the text's sentences"):
        el.ChunkScores("sentence")
    with pytest.raises(ValueError, match=r"ChunkScores\(reduce='max'\): expected one of \('sum', 'mean'\)"):
        el.ChunkScores(5, reduce="max")


def test_layer_scope_keeps_the_same_tokens_in_every_head():
    torch.manual_seed(6)
    keys = torch.randn(3, 40, 8) + 1.0
    policy = el.Policy(el.HeavyHitterSelector(el.KeyDiff(), refine=[el.LayerScope()]), budget=9)
    store, history = _drive(policy, keys, prompt=20, heads=3)

    def mean_over_heads(held):
        per_head = [keydiff_scores(keys[h], held) for h in range(3)]
        return {j: sum(s[j] for s in per_head) / 3 for j in held}

    expected = run_reference(keys[0], 20, 9, _lowest_out(mean_over_heads))
    assert [h[0] for h in history] == expected
    assert all(h[0] == h[1] == h[2] for h in history)
    assert torch.equal(store.pos[0, 0], store.pos[0, 2])  # identical slot layouts, not just sets


def test_layer_scope_max_keeps_what_any_head_ranks_highest():
    torch.manual_seed(6)
    keys = torch.randn(3, 40, 8) + 1.0
    policy = el.Policy(el.HeavyHitterSelector(el.KeyDiff(), refine=[el.LayerScope("max")]), budget=9)
    store, history = _drive(policy, keys, prompt=20, heads=3)

    def max_over_heads(held):
        per_head = [keydiff_scores(keys[h], held) for h in range(3)]
        return {j: max(s[j] for s in per_head) for j in held}

    expected = run_reference(keys[0], 20, 9, _lowest_out(max_over_heads))
    assert [h[0] for h in history] == expected
    assert all(h[0] == h[1] == h[2] for h in history)
    mean_policy = el.Policy(el.HeavyHitterSelector(el.KeyDiff(), refine=[el.LayerScope()]), budget=9)
    mean = _drive(mean_policy, keys, prompt=20, heads=3)
    assert [h[0] for h in mean[1]] != expected  # the reduction matters on these keys
    with pytest.raises(ValueError, match=r"LayerScope\(reduce='median'\): expected one of \('mean', 'max'\)"):
        el.LayerScope("median")


@pytest.mark.parametrize("shares", [(0.5, 0.5), (0.25, 0.75), (0.7, 0.3)], ids=str)
def test_selectors_split_the_budget_by_share(shares):
    torch.manual_seed(7)
    keys = torch.randn(1, 50, 8) + 1.5
    policy = el.Policy(
        el.HeavyHitterSelector(el.KeyNorm(), share=shares[0]),
        el.HeavyHitterSelector(el.KeyDiff(), share=shares[1]),
        budget=12,
    )
    _, history = _drive(policy, keys, prompt=30)
    fns = [lambda held: keynorm_scores(keys[0], held), lambda held: keydiff_scores(keys[0], held)]
    expected = run_reference(keys[0], 30, 12, lambda held, budget: split_keep(fns, shares, held, budget))
    assert [h[0] for h in history] == expected


def test_shares_after_protections_and_two_selectors_of_one_type():
    """Shares split what a RecentWindow leaves; two KeyNorm selectors keep separate (prefixed) state."""
    torch.manual_seed(8)
    keys = torch.randn(1, 40, 8)
    policy = el.Policy(
        el.RecentWindow(4),
        el.HeavyHitterSelector(el.KeyNorm(), share=0.5),
        el.HeavyHitterSelector(el.KeyNorm(), refine=[el.PooledScores(3)], share=0.5),
        budget=12,
    )
    store, history = _drive(policy, keys, prompt=25)
    assert set(store.state) == {"0.key_norm", "1.key_norm"}
    fns = [lambda held: keynorm_scores(keys[0], held), lambda held: pooled(keynorm_scores(keys[0], held), 3, "mean")]

    def keep(held, budget):
        recent = [j for j in held if j > max(held) - 4]
        rest = [j for j in held if j not in recent]
        return sorted(recent + split_keep(fns, (0.5, 0.5), rest, budget - 4, held=held))

    assert [h[0] for h in history] == run_reference(keys[0], 25, 12, keep)


def test_shared_budget_round_trips_through_yaml(tmp_path):
    policy = el.Policy(
        el.SinkTokens(4),
        el.HeavyHitterSelector(el.Averaged(), refine=[el.PooledScores(7, reduce="max")], share=0.5),
        el.HeavyHitterSelector(el.KeyDiff(), share=0.5),
        budget=0.2,
    )
    path = tmp_path / "hybrid.yaml"
    el.dump_recipe(policy, path)
    assert el.load_recipe(path) == policy
    assert path.read_text().count("refine") == 1  # defaults stay out of the file: no empty list


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: el.PooledScores(4), "PooledScores(window=4): with side='both' the width must be an odd int >= 3"),
        (lambda: el.PooledScores(1), "PooledScores(window=1): the pooling width must be an int >= 2"),
        (lambda: el.PooledScores(3, side="after"), "PooledScores(side='after'): expected 'both'"),
        (lambda: el.PooledScores(3, reduce="median"), "PooledScores(reduce='median'): expected one of"),
        (lambda: el.HeavyHitterSelector(el.KeyDiff(), share=1.5), "float in (0, 1)"),
        (lambda: el.HeavyHitterSelector(el.KeyDiff(), refine=[el.PooledScores(3), el.PooledScores(5)]),
         "holds PooledScores more than once"),
        (lambda: el.HeavyHitterSelector(el.KeyDiff(), refine=[el.LayerScope(), el.ChunkScores(5)]),
         "LayerScope makes every head of the layer rank alike"),
    ],
    ids=["pool-even", "pool-1", "pool-side", "pool-reduce", "share", "pool-twice", "scope-not-last"],
)
def test_bad_selector_options_are_named(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


@pytest.mark.parametrize(
    "refine,message",
    [(el.PooledScores(5), "expected a list of score refinements"),
     ([el.Cumulative()], r"item #0 is Cumulative\(\); expected a ScoreRefinement")],
    ids=["not-a-list", "not-a-refinement"],
)
def test_refine_takes_a_list_of_refinements(refine, message):
    with pytest.raises(TypeError, match=message):
        el.HeavyHitterSelector(el.KeyDiff(), refine=refine)


def test_bad_policies_with_several_selectors_are_named():
    with pytest.raises(ValueError, match="only selector"):
        el.Policy(el.HeavyHitterSelector(el.KeyDiff(), share=0.5), budget=8)
    with pytest.raises(ValueError, match="not every one has a share"):
        el.Policy(el.HeavyHitterSelector(el.KeyDiff(), share=0.5), el.HeavyHitterSelector(el.KeyNorm()), budget=8)
    with pytest.raises(ValueError, match="sum to 0.9"):
        el.Policy(el.HeavyHitterSelector(el.KeyDiff(), share=0.5), el.HeavyHitterSelector(el.KeyNorm(), share=0.4))
    with pytest.raises(ValueError, match="mix a LayerScope refinement with selectors without one"):
        el.Policy(el.HeavyHitterSelector(el.KeyDiff(), refine=[el.LayerScope()], share=0.5),
                  el.HeavyHitterSelector(el.KeyNorm(), share=0.5))
    with pytest.raises(ValueError, match="one softmax"):
        el.Policy(el.HeavyHitterSelector(el.Cumulative(), el.StepGainSoftmax(), share=0.5),
                  el.HeavyHitterSelector(el.Averaged(), el.StepGainSoftmax(), share=0.5))
    with pytest.raises(ValueError, match=r"3 unprotected slots of a 5-token budget cannot give every selector"):
        el.Policy(el.RecentWindow(2), el.HeavyHitterSelector(el.KeyDiff(), share=0.9),
                  el.HeavyHitterSelector(el.KeyNorm(), share=0.1), budget=5)
    with pytest.raises(ValueError, match="not non-negative attention mass"):
        el.HeavyHitterSelector(el.KeyDiff(), prior=el.ValuePrior())


def _top_slots_reference(score, pos, open_slots, count):
    """Per head, a Python sort of the open slots by (score, position), both descending."""
    out = torch.zeros_like(open_slots)
    for b in range(score.shape[0]):
        for h in range(score.shape[1]):
            slots = [i for i in range(score.shape[2]) if open_slots[b, h, i]]
            ranked = sorted(slots, key=lambda i: (-float(score[b, h, i]), -int(pos[b, h, i])))
            for i in ranked[: max(int(count[b]), 0)]:
                out[b, h, i] = True
    return out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_top_slots_matches_a_sort_with_ties_signed_zeros_and_infinities(compiled):
    """The packed-key selection behind several selectors' claims keeps what sorting by (score, newest)
    keeps: exact ties (half the scores come from 4 values), -0.0 beside +0.0, +-inf, empty slots
    (position -1), and counts of 0, below, at and above the open slots of a row."""
    from evictlayers.compose.selection import top_slots

    generator = torch.Generator().manual_seed(3)
    batch, heads, slots = 4, 3, 37
    score = torch.randn(batch, heads, slots, generator=generator)
    tied = torch.rand(batch, heads, slots, generator=generator) < 0.5
    score = torch.where(tied, torch.tensor([-1.5, 0.0, -0.0, 2.0])[torch.randint(4, score.shape, generator=generator)], score)
    score[1, 0, :4] = torch.tensor([-0.0, 0.0, -torch.inf, torch.inf])
    pos = torch.stack([torch.randperm(1000, generator=generator)[:slots] for _ in range(batch * heads)])
    pos = pos.view(batch, heads, slots)
    empty = torch.rand(batch, heads, slots, generator=generator) < 0.15
    pos = pos.masked_fill(empty, -1)
    open_slots = ~empty & (torch.rand(batch, heads, slots, generator=generator) < 0.8)
    count = torch.tensor([0, 11, 30, slots])
    select = torch.compile(top_slots, fullgraph=True) if compiled else top_slots
    assert torch.equal(select(score, pos, open_slots, count), _top_slots_reference(score, pos, open_slots, count))
