"""Engine pieces: KV cache commits, sampling exactness, trees and the n-gram drafter."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from clover_cli.drafters.base import Drafter
from clover_cli.drafters.ngram import NgramDrafter
from clover_cli.decode.budget import AcceptanceCurve, CostModel, DraftValue
from clover_cli.decode.engine import Engine
from clover_cli.decode.verify import Sampling, StopCheck, accept, sample, warp
from clover_cli.target import Target, cache_kwarg
from clover_cli.tree import DraftTree, TreeBuilder
from helpers import OracleDrafter, hf_greedy, run_engine
from test_lossless import make_model


def path_scores(tree: DraftTree) -> dict[tuple, float]:
    """Each drafted node's path of tokens from the root (root excluded) -> its score."""
    out = {}
    for i in range(1, len(tree)):
        path, j = [], i
        while j > 0:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        out[tuple(reversed(path))] = tree.scores[i]
    return out


class RecordingOracle(OracleDrafter):
    """An oracle that keeps what the engine tells it (observes = True) or says it reads nothing and fails if told."""

    def __init__(self, *args, observes: bool = True, **kw):
        super().__init__(*args, **kw)
        self.observes, self.seen = observes, []

    def observe(self, hidden, next_tokens):
        assert self.observes, "asked to observe although it said it reads nothing"
        self.seen.append((hidden.clone(), next_tokens.tolist()))


@pytest.mark.parametrize("seed", range(3))
def test_the_drafter_observes_the_target_states_of_exactly_the_accepted_positions(seed):
    """What observe() gets, over a reply, is the target's own pre-norm hidden state at every committed position and
    the token after it, whether the accepted path was the tree's first nodes (the engine hands a view) or another
    branch (a gather); a drafter that says it reads nothing (observes = False) is not told, and the output is the
    same."""
    model = make_model("llama", seed)
    prompt = [random.Random(seed).randrange(3, 96) for _ in range(9)]
    reference = hf_greedy(model, prompt, 60)  # past the 40 kept: a last step may accept beyond the stop
    target = Target(model)
    drafter = RecordingOracle(reference, len(prompt), 96, 0.7, seed)
    engine = Engine(target, drafter, budget=8, auto_budget=False)
    out, events = run_engine(engine, prompt, StopCheck(40))
    assert out == reference[:40]
    prefix_paths = sum(1 for h, tokens in drafter.seen[1:] if len(tokens) > 1)
    assert prefix_paths and len(drafter.seen) - 1 - prefix_paths  # long paths, and steps that took none
    hidden = torch.cat([h for h, _ in drafter.seen])
    nexts = [t for _, tokens in drafter.seen for t in tokens]
    sequence = prompt + reference
    assert len(nexts) >= len(prompt) + 39 and nexts == sequence[1:len(nexts) + 1]
    with torch.inference_mode():
        own, _ = Target(model).forward(torch.tensor(sequence[:len(nexts)]))
    torch.testing.assert_close(hidden, own, atol=1e-4, rtol=1e-4)

    quiet = Engine(Target(model), RecordingOracle(reference, len(prompt), 96, 0.7, seed, observes=False), budget=8,
                   auto_budget=False)
    assert run_engine(quiet, prompt, StopCheck(40))[0] == reference[:40] and not quiet.drafter.seen


# ------------------------------------------------------------------------------------------------ KV cache

@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("seed", range(3))
def test_cache_equals_plain_forward(family, seed):
    """After any sequence of accepts, the committed cache equals the cache of one plain forward over its tokens."""
    rng = random.Random(seed)
    model = make_model(family, seed)
    target = Target(model)
    prompt = [rng.randrange(3, 96) for _ in range(rng.randint(1, 20))]
    reference = hf_greedy(model, prompt, 50)
    engine = Engine(target, OracleDrafter(reference, len(prompt), 96, 0.7, seed), budget=rng.choice([4, 16, 32]),
                    auto_budget=False)
    run_engine(engine, prompt, StopCheck(50))
    # A second, edited conversation exercises truncation and prefix reuse too.
    edited = prompt + reference[:7] + [rng.randrange(3, 96)]
    ref2 = hf_greedy(model, edited, 20)
    engine.drafter = OracleDrafter(ref2, len(edited), 96, 0.7, seed + 1)
    run_engine(engine, edited, StopCheck(20))

    tokens = engine.context
    assert len(tokens) == target.length
    plain = DynamicCache(config=model.config)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        model(input_ids=torch.tensor([tokens]), **{cache_kwarg(model): plain}, use_cache=True)
        model.set_attn_implementation("clover_tree")
    for layer, mine in zip(plain.layers, target.cache.layers):
        n = len(tokens)
        torch.testing.assert_close(mine.keys[:, :, :n], layer.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mine.values[:, :, :n], layer.values, rtol=1e-4, atol=1e-5)


def test_cache_grows_and_refuses_past_the_context():
    from clover_cli.errors import CloverError
    from clover_cli.target import TreeKVCache

    model = make_model("llama", 0)
    target = Target(model, initial_capacity=8)
    prompt = list(range(3, 40))
    reference = hf_greedy(model, prompt, 30)
    engine = Engine(target, OracleDrafter(reference, len(prompt), 96, 0.9, 0), budget=16, auto_budget=False)
    out, _ = run_engine(engine, prompt, StopCheck(30))
    assert out == reference and target.cache.capacity >= target.length
    cache = TreeKVCache(2, 4, 10)
    cache.length = 8
    with pytest.raises(CloverError, match="context"):
        cache.reserve(5)


# ------------------------------------------------------------------------------------------------ sampling

def _tv(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


def _null_tv_bound(probs: np.ndarray, n: int, rng: np.random.Generator, sims: int = 400) -> float:
    """A bound on the TV distance of n exact samples: above the largest of `sims` simulated exact runs."""
    tvs = [_tv(rng.multinomial(n, probs).astype(float), probs) for _ in range(sims)]
    return 1.2 * max(tvs)


def _first_token(tree, logits, s, gen, rule=accept):
    path, bonus = rule(tree, logits, s, gen)
    return tree.tokens[path[1]] if len(path) > 1 else bonus


def _biased_accept(tree, logits, s, gen):
    """A classic mistake: accept a child with probability p(x) but draw the fallback from the unmodified p."""
    p = warp(logits[0], s)
    for c in tree.children()[0]:
        if torch.rand((), generator=gen).item() < p[tree.tokens[c]].item():
            return [0, c], 0
    return [0], int(torch.multinomial(p, 1, generator=gen).item())


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_sibling_rejection_samples_exactly(temperature, top_p):
    """The first token out of accept() follows the warped target distribution exactly, whatever the siblings."""
    torch.manual_seed(0)
    V = 12
    logits = torch.randn(5, V) * 2.0
    s = Sampling(temperature, top_p)
    probs = warp(logits[0], s).numpy().astype(float)
    order = np.argsort(-probs)
    # Children: the two likeliest tokens, a mid one and an unlikely one (possibly outside the nucleus).
    kids = [int(order[0]), int(order[1]), int(order[5]), int(order[-1])]
    tree = DraftTree([0] + kids, [-1, 0, 0, 0, 0])
    gen = torch.Generator().manual_seed(1)
    n = 20000
    counts = np.zeros(V)
    for _ in range(n):
        counts[_first_token(tree, logits, s, gen)] += 1
    bound = _null_tv_bound(probs, n, np.random.default_rng(0))
    assert _tv(counts, probs) < bound
    if top_p < 1.0:
        assert counts[probs == 0].sum() == 0  # nothing outside the nucleus, ever
    # The same statistic catches a biased rule: the test can fail.
    biased = np.zeros(V)
    for _ in range(n):
        biased[_first_token(tree, logits, s, gen, _biased_accept)] += 1
    assert _tv(biased, probs) > bound


class RandomTreeDrafter(Drafter):
    """Random trees over a tiny vocabulary: likely and unlikely tokens, several siblings, depth up to 3."""

    name = "random"

    def __init__(self, vocab, seed):
        self.vocab, self.rng = vocab, random.Random(seed)

    def reset(self, length):
        pass

    def observe(self, hidden, next_tokens):
        pass

    def propose(self, context, budget):
        b = TreeBuilder(context[-1])
        frontier = [0]
        for _ in range(3):
            nxt = []
            for node in frontier:
                for tok in self.rng.sample(range(self.vocab), self.rng.randint(0, 3)):
                    nxt.append(b.add(node, tok, b.scores[node] * 0.5))
            frontier = nxt
        return b.build(budget)


@pytest.mark.parametrize("temperature,top_p,penalty,top_k,min_p", [
    (1.0, 1.0, 1.0, 0, 0.0), (0.8, 0.9, 1.0, 0, 0.0), (1.0, 1.0, 3.0, 0, 0.0), (1.2, 1.0, 1.0, 3, 0.0),
    (1.1, 0.95, 1.0, 4, 0.2)])
def test_speculative_sampling_matches_the_target_distribution(temperature, top_p, penalty, top_k, min_p):
    """End to end on a tiny-vocabulary model: the joint distribution of the first two sampled tokens equals the
    target's own (computed exactly by enumeration; with a repetition penalty, through transformers' own
    RepetitionPenaltyLogitsProcessor), within a TV bound that exact sampling meets."""
    from transformers import RepetitionPenaltyLogitsProcessor

    V = 6
    model = make_model("llama", 5, vocab=V)
    with torch.no_grad():  # temper the x8 sharpening: spread-out distributions (less so for the penalty to bite)
        model.get_output_embeddings().weight.mul_(0.15 if penalty == 1.0 else 1.0)
    s = Sampling(temperature, top_p, repetition_penalty=penalty, top_k=top_k, min_p=min_p)
    prompt = [1, 4, 2, 1]  # tokens 0, 3 and 5 unseen (until drawn): the penalty moves mass towards them

    def joint(penalty):
        processor = RepetitionPenaltyLogitsProcessor(penalty)

        def probs(ids):
            logits = model(torch.tensor([ids])).logits[:, -1].float()
            return warp(processor(torch.tensor([ids]), logits)[0], s)

        exact = np.zeros((V, V))
        with torch.no_grad():
            model.set_attn_implementation("sdpa")
            p1 = probs(prompt)
            for a in range(V):
                if p1[a] > 0:
                    exact[a] = (p1[a] * probs(prompt + [a])).numpy()
        return exact.ravel() / exact.sum()

    exact = joint(penalty)
    n = 2500
    bound = _null_tv_bound(exact, n, np.random.default_rng(1))
    if penalty != 1.0:  # sampling without the penalty would fail this test
        assert 0.5 * np.abs(joint(1.0) - exact).sum() > 2 * bound
    target = Target(model)
    engine = Engine(target, RandomTreeDrafter(V, 0), budget=12, auto_budget=False)
    counts = np.zeros(V * V)
    accepted = 0
    for i in range(n):
        out, events = run_engine(engine, prompt, StopCheck(2), Sampling(temperature, top_p, seed=i,
                                                                        repetition_penalty=penalty, top_k=top_k,
                                                                        min_p=min_p))
        counts[out[0] * V + out[1]] += 1
        accepted += sum(e.accepted for e in events)
    assert accepted > n * 0.2  # the drafts really were accepted a good share of the time
    assert _tv(counts, exact) < bound
    if top_k or min_p:  # the filters cut something here, and nothing they cut is ever drawn
        assert (exact == 0).any() and counts[exact == 0].sum() == 0


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 5, 1.0, 0.0), (0.7, 0, 1.0, 0.05), (1.3, 20, 0.8, 0.0), (0.9, 10, 0.9, 0.02), (1.0, 1, 1.0, 0.0),
    (2.0, 0, 0.5, 0.5), (1.0, 64, 1.0, 0.0)])
def test_warp_is_transformers_warpers(temperature, top_k, top_p, min_p):
    """warp (the distribution every verification and every sampled draft uses) against transformers' own
    temperature, top-k, top-p and min-p warpers in the order its generate applies them: the same distribution."""
    from transformers import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 64, generator=g) * 3.0
    logits[0, 3] = logits[0, 9]  # a tie, kept together by top-k
    chain = [TemperatureLogitsWarper(temperature)]
    chain += [TopKLogitsWarper(top_k)] if top_k else []
    chain += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    chain += [MinPLogitsWarper(min_p)] if min_p > 0 else []
    expected = torch.softmax(LogitsProcessorList(chain)(None, logits.clone()), dim=-1)
    got = warp(logits, Sampling(temperature, top_p, top_k=top_k, min_p=min_p))
    got = got / got.sum(-1, keepdim=True)
    assert torch.equal(got == 0, expected == 0)  # the same tokens cut
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_on_a_real_vocabulary_is_the_full_sorts(top_p):
    """warp's top-p looks among the TOP_P_PEEK most likely tokens first and sorts the whole row only when their mass
    falls short: bit for bit what sorting every row gives, on rows of a 49,152-token vocabulary from peaked (the cut
    among the first few) to flat (the cut thousands down: the full sort), alone and mixed in one batch (agreement with
    transformers' warpers: test_warp_is_transformers_warpers)."""
    from clover_cli.decode import verify

    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(1, 49152, generator=g) * scale for scale in (12.0, 6.0, 3.0, 1.0, 0.3, 0.0)]
    logits = torch.cat(rows)

    def full_sort(probs):
        sorted_p, order = probs.sort(descending=True)
        outside = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        outside[..., 0] = False
        sorted_p[outside] = 0.0
        return torch.zeros_like(probs).scatter_(-1, order, sorted_p)

    s = Sampling(0.8, top_p)
    probs = torch.softmax((logits - logits.max(-1, keepdim=True).values) / 0.8, dim=-1)
    expected = full_sort(probs)
    kept = (expected > 0).sum(-1)
    assert kept.min() < 10 and kept.max() > verify.TOP_P_PEEK  # both paths taken
    assert torch.equal(warp(logits, s), expected)
    for i in range(len(rows)):  # each row alone: the batch's fallback must not be what makes it agree
        assert torch.equal(warp(logits[i:i + 1], s), expected[i:i + 1])


def test_sample_draws_each_token_with_its_share_of_the_mass():
    """engine.sample (the inverse of the cumulative sum) against the exact distribution: unnormalised input, zero
    entries (a top-p cut, a rejected sibling) never drawn, within the TV bound exact sampling meets; a version that
    forgets the input is unnormalised fails the same bound."""
    probs = np.array([0.0, 0.05, 0.3, 0.0, 0.15, 0.4, 0.1, 0.0])
    p = torch.tensor(probs * 3.7, dtype=torch.float32)  # as accept leaves p after rejections: not summing to 1
    gen = torch.Generator().manual_seed(3)
    n = 20000
    counts = np.bincount([sample(p, gen) for _ in range(n)], minlength=len(probs)).astype(float)
    bound = _null_tv_bound(probs, n, np.random.default_rng(2))
    assert counts[probs == 0].sum() == 0
    assert _tv(counts, probs) < bound

    def unscaled(p, gen):  # u uniform in [0, 1) instead of [0, sum(p))
        c = p.double().cumsum(0)
        i = int(torch.searchsorted(c, torch.rand((), generator=gen, dtype=torch.float64).reshape(1), right=True)[0])
        return min(i, len(c) - 1)

    wrong = np.bincount([unscaled(p, gen) for _ in range(n)], minlength=len(probs)).astype(float)
    assert _tv(wrong, probs) > bound
    one = torch.zeros(50_000)
    one[-1] = 1e-30  # a single token with any mass, at the very end
    assert {sample(one, gen) for _ in range(50)} == {49_999}
    for bad in (torch.zeros(4), torch.tensor([0.5, float("nan")]), torch.tensor([0.2, -0.5])):
        with pytest.raises(ValueError, match="cannot sample"):
            sample(bad, gen)


def test_draft_value_stops_asking_a_drafter_whose_calls_do_not_pay_and_comes_back():
    """Calls that get nothing accepted: after a full window the drafter is asked only after EXPLORE plain steps,
    then twice as many after each try that did not pay for itself, up to MOST_WAIT, or further where tries that
    often would cost more than EXPLORE_SHARE of the time (up to LONGEST_WAIT); a try that paid brings the short wait
    back, and enough of them the every-step asking. A try is charged at most what a call at consecutive steps costs
    (a catch-up on the skipped steps is not the drafter's per-step price). Calls that pay are never refused."""
    def waits_of(try_s, tries):
        v = DraftValue()
        v.plain_step(1.0)
        for _ in range(DraftValue.WINDOW):
            assert v.ask(1.0)
            v.add(0, 0.1)
        waits = []
        for _ in range(tries):
            steps = 0
            while not v.ask(1.0):
                steps += 1
            waits.append(steps)
            v.add(0, try_s)  # a try: charged as a call at consecutive steps (0.1), not its try_s
        return v, waits

    v, waits = waits_of(0.3, 6)  # a try costs 0.3 plain steps: 64 apart, tries take 0.5% of the time
    assert waits == [8, 16, 32, 64, 64, 64]
    _, waits = waits_of(2.0, 8)  # 2 steps' time: 200 apart keeps them to 1%
    assert waits == [8, 16, 32, 64, 128, 200, 200, 200]
    _, waits = waits_of(50.0, 9)  # and never more than LONGEST_WAIT apart
    assert waits == [8, 16, 32, 64, 128, 256, 512, 512, 512] and DraftValue.LONGEST_WAIT == 512
    v, waits = waits_of(5.0, 6)
    assert all(c == pytest.approx(0.1) for _, c in v.calls)
    while not v.ask(1.0):
        pass
    v.add(1, 0.1)  # this try paid for itself: the short wait again
    steps = 0
    while not v.ask(1.0):
        steps += 1
    assert steps == DraftValue.EXPLORE
    v.add(1, 0.1)  # now the window's calls pay for their drafting: asked at every step
    assert all(v.ask(1.0) for _ in range(5))
    busy = DraftValue()
    busy.plain_step(1.0)
    for i in range(10 * DraftValue.WINDOW):
        assert busy.ask(1.0)
        busy.add(int(i % 4 == 0), 0.2)  # one token every 4th call: 0.25 of a step's time a call, for 0.2
    idle = DraftValue()  # steps the cost model's idle rule skipped count towards the wait
    idle.plain_step(1.0)
    for _ in range(DraftValue.WINDOW):
        idle.ask(1.0)
        idle.add(0, 0.1)
    for _ in range(DraftValue.EXPLORE):
        idle.skipped()
    assert idle.ask(1.0)


def test_a_drafter_that_proposes_nothing_is_asked_now_and_then():
    """With auto budget, a drafter whose proposals are always empty (sampled text it never predicts) is asked at a
    few steps only, not at each one, and the output is the target's."""
    model = make_model("llama", 4)
    target = Target(model)
    prompt = [7, 8, 9, 10]
    reference = hf_greedy(model, prompt, 80)

    class Empty(OracleDrafter):
        calls = 0

        def propose(self, context, budget):
            Empty.calls += 1
            return DraftTree.root_only(context[-1])

    engine = Engine(target, Empty(reference, len(prompt), 96, 0.0, 0), budget=16, auto_budget=True)
    out, events = run_engine(engine, prompt, StopCheck(80))
    assert out == reference
    steps = len(events) - 1
    assert Empty.calls < DraftValue.WINDOW + steps / DraftValue.EXPLORE
    Empty.calls = 0  # an ablation measuring the trees themselves asks at every step
    engine = Engine(target, Empty(reference, len(prompt), 96, 0.0, 0), budget=16, auto_budget=True,
                    skip_unpaid=False)
    out, events = run_engine(engine, prompt, StopCheck(80))
    assert out == reference and Empty.calls == len(events) - 1
    # the same drafter proposing the target's own next tokens is asked at every step

    class Right(OracleDrafter):
        calls = 0

        def propose(self, context, budget):
            Right.calls += 1
            return super().propose(context, budget)

    engine = Engine(target, Right(reference, len(prompt), 96, 1.0, 0), budget=16, auto_budget=True)
    out, events = run_engine(engine, prompt, StopCheck(80))
    assert out == reference and Right.calls == len(events) - 1 and sum(e.accepted for e in events) > 40


def test_sampling_is_reproducible_with_a_seed():
    """The same seed and the same drafts give the same sample (drafts steer which random numbers are used)."""
    model = make_model("llama", 2)
    target = Target(model)
    runs = []
    for _ in range(2):
        engine = Engine(target, RandomTreeDrafter(96, 3), budget=8, auto_budget=False)
        runs.append(run_engine(engine, [5, 6, 7], StopCheck(20), Sampling(0.9, 0.95, seed=42))[0])
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------------------------ trees

def test_prune_keeps_best_nodes_with_their_ancestors():
    rng = random.Random(0)
    for _ in range(200):
        b = TreeBuilder(0)
        for _ in range(rng.randint(0, 40)):
            parent = rng.randrange(len(b.tokens))
            b.add(parent, rng.randrange(10**6), b.scores[parent] * rng.random())
        full = DraftTree(b.tokens, b.parents, b.scores)
        budget = rng.randint(0, 45)
        tree = full.prune(budget)
        tree.validate()
        assert len(tree) == min(budget, len(full) - 1) + 1
        kept = sorted(tree.scores[1:], reverse=True)
        # every dropped node scores no better than the worst kept one (or its parent was dropped)
        if kept and len(tree) < len(full):
            worst = kept[-1]
            dropped = sorted(set(full.scores[1:]) - set(tree.scores[1:]))
            assert not dropped or max(dropped) <= worst + 1e-12
        mask = tree.ancestor_mask()
        for i, p in enumerate(tree.parents):
            assert mask[i, i] and (p < 0 or (mask[i] >= mask[p]).all())


def test_merged_trees_are_valid_unions():
    from clover_cli.tree import merge_trees

    rng = random.Random(1)
    for _ in range(200):
        trees = []
        for _ in range(2):
            b = TreeBuilder(7)
            for _ in range(rng.randint(0, 25)):
                parent = rng.randrange(len(b.tokens))
                tok = rng.randrange(6)  # a small alphabet: the two trees share many paths
                if tok not in [b.tokens[c] for c in range(1, len(b.tokens)) if b.parents[c] == parent]:
                    b.add(parent, tok, b.scores[parent] * rng.random())
            trees.append(DraftTree(b.tokens, b.parents, b.scores))
        merged = merge_trees(*trees)
        merged.validate()
        union = path_scores(merged)
        a, b = path_scores(trees[0]), path_scores(trees[1])
        assert set(union) == set(a) | set(b)
        for p, sc in union.items():
            assert sc >= min(max(a.get(p, 0.0), b.get(p, 0.0)), union.get(p[:-1], 1.0)) - 1e-12
            assert sc <= union.get(p[:-1], 1.0) + 1e-12


def test_prune_and_merge_keep_each_nodes_drafter_rank_and_probability():
    from clover_cli.tree import merge_trees

    rng = random.Random(2)
    info = lambda tok, k: (tok % 3, (tok % 97) / 194 + k / 2)  # noqa: E731  (a token's (rank, p) in tree k)
    for _ in range(200):
        trees = []
        for k, with_info in enumerate((rng.random() < 0.7, rng.random() < 0.5)):
            b = TreeBuilder(7)
            for _ in range(rng.randint(0, 25)):
                parent = rng.randrange(len(b.tokens))
                tok = rng.randrange(12)  # a small alphabet: the two trees share paths
                if tok not in [b.tokens[c] for c in range(1, len(b.tokens)) if b.parents[c] == parent]:
                    b.add(parent, tok, b.scores[parent] * rng.random(), drafted=info(tok, k) if with_info else None)
            trees.append(b.build(rng.randint(0, 30)))
        merged = merge_trees(*trees).prune(rng.randint(0, 40))
        assert (merged.drafted is None) == all(t.drafted is None for t in trees)
        for k, tree in enumerate(trees):
            if tree.drafted is not None:
                assert len(tree.drafted) == len(tree.tokens)
                assert all(tree.drafted[i] == info(tree.tokens[i], k) for i in range(1, len(tree)))
        if merged.drafted is None:
            continue
        # each node keeps the first tree's (rank, p) where that tree drafted it with them, else the second's
        where = [_paths(t) if t.drafted is not None else {} for t in trees]
        for path, i in _paths(merged).items():
            k = next((k for k in (0, 1) if path in where[k]), None)
            assert merged.drafted[i] == (None if k is None else trees[k].drafted[where[k][path]])


def _paths(tree: DraftTree) -> dict[tuple, int]:
    out = {(): 0}
    for i in range(1, len(tree)):
        parent_path = next(p for p, j in out.items() if j == tree.parents[i])
        out[parent_path + (tree.tokens[i],)] = i
    return {p: i for p, i in out.items() if p}


# ------------------------------------------------------------------------------------------------ acceptance curve

def _counted(curve):
    return {(r, b): (curve.seen[r][b], curve.accepted[r][b])
            for r in range(curve.RANKS) for b in range(curve.BINS) if curve.seen[r][b]}


def test_acceptance_curve_counts_only_nodes_whose_parent_was_accepted():
    # root -> a (first, 0.52) -> b (first, 0.33); root -> c (second, 0.17); root -> d (fourth, 0.04)
    tree = DraftTree([9, 1, 2, 3, 4], [-1, 0, 1, 0, 0], [1.0, 0.52, 0.17, 0.17, 0.04],
                     drafted=[None, (0, 0.52), (0, 0.33), (1, 0.17), (3, 0.04)])
    curve = AcceptanceCurve()
    curve.observe(tree, [0, 1])  # a accepted, its child b and its siblings c, d not
    assert _counted(curve) == {(0, 10): (1.0, 1.0), (0, 6): (1.0, 0.0), (1, 3): (1.0, 0.0), (2, 0): (1.0, 0.0)}
    curve = AcceptanceCurve()
    curve.observe(tree, [0])  # a, c and d rejected; b was never tested (its parent was not accepted)
    assert _counted(curve) == {(0, 10): (1.0, 0.0), (1, 3): (1.0, 0.0), (2, 0): (1.0, 0.0)}
    curve.observe(DraftTree([9, 1], [-1, 0], [1.0, 0.5]), [0, 1])  # a drafter without ranks and probabilities
    assert sum(map(sum, curve.seen)) == 3.0


def test_acceptance_curve_starts_at_the_identity_and_learns_a_monotone_chance_per_rank():
    curve = AcceptanceCurve()
    for p in (0.0, 0.01, 0.2, 0.47, 0.8):
        for rank in (0, 1, 5):
            assert curve(p, rank) == pytest.approx(p, abs=1e-9)  # nothing seen: the drafter's own probability
    rng = random.Random(5)
    truth = {0: lambda p: min(1.0, 0.05 + 2.2 * p), 1: lambda p: 0.15, 2: lambda p: 0.3 * p}  # greedy-like
    for _ in range(9000):
        p, rank = rng.random(), rng.choice([0, 1, 2, 4])
        accepted = rng.random() < truth[min(rank, 2)](p)
        curve.observe(DraftTree([9, 1], [-1, 0], [1.0, p], drafted=[None, (rank, p)]), [0, 1] if accepted else [0])
    curve.fit()
    grid = [i / 100 for i in range(101)]
    for rank in (0, 1, 2):
        values = [curve(p, rank) for p in grid]
        assert all(b >= a - 1e-12 for a, b in zip(values, values[1:]))  # non-decreasing
        assert max(values) <= curve.CAP and min(values) >= 0.0
        for p in (0.15, 0.3, 0.6, 0.9):
            assert curve(p, rank) == pytest.approx(min(truth[rank](p), curve.CAP), abs=0.1)
    assert curve(0.5, 7) == curve(0.5, 2)  # every later rank shares the last class
    # the verdicts of an unlucky bin out of order are pooled with their neighbours, never a dip
    curve.seen[0][8], curve.accepted[0][8] = 1000.0, 0.0
    curve.fit()
    values = [curve(p) for p in grid]
    assert all(b >= a - 1e-12 for a, b in zip(values, values[1:]))


def test_grower_scores_children_by_the_curve_and_keeps_their_own_rank_and_probability():
    from clover_cli.drafters.common import TreeGrower

    for curve in (None, lambda p, rank: min(0.99, 2 * p) if rank == 0 else p / 4):
        grower = TreeGrower(topk=4, width=4, min_ratio=0.0, top_p=1.0)
        grower.curve = curve
        b = TreeBuilder(3)
        level = grower.expand(b, [0], [[0.45, 0.3, 0.1]], [[11, 12, 13]], budget=10)
        chance = (lambda p, rank: p) if curve is None else curve
        assert b.scores[1:] == [chance(0.45, 0), chance(0.3, 1), chance(0.1, 2)]
        assert b.drafted == [None, (0, 0.45), (1, 0.3), (2, 0.1)]
        grower.expand(b, level[:1], [[0.5]], [[21]], budget=10)
        assert b.scores[-1] == pytest.approx(chance(0.45, 0) * chance(0.5, 0))
        assert b.build(10).drafted[-1] == (0, 0.5)


def test_grower_expands_only_nodes_whose_children_could_still_make_the_tree():
    """Once a tree holds its budget, a node at the budget-th best score is not expanded (its children score no more
    than it does): with a budget of 1 no level follows the first; below that score nothing is expanded either."""
    from clover_cli.drafters.common import TreeGrower

    for budget, expected in ((1, []), (2, [1]), (3, [1, 2]), (10, [1, 2, 3])):
        grower = TreeGrower(topk=4, width=4, min_ratio=0.0, top_p=1.0)
        b = TreeBuilder(3)
        level = grower.expand(b, [0], [[0.45, 0.3, 0.1]], [[11, 12, 13]], budget=budget)
        assert level == expected, budget
        assert b.build(budget).tokens[1:] == [11, 12, 13][:budget]


@pytest.mark.parametrize("learn", [True, False])
def test_engine_learns_the_acceptance_curve_of_a_heads_drafter_and_stays_exact(learn):
    from clover_cli.drafters.clover2 import CloverDrafter
    from test_lossless import random_heads

    model = make_model("llama", 3)
    target = Target(model)
    drafter = CloverDrafter(random_heads(model, "clover2", 4, 3, 1), target)
    engine = Engine(target, drafter, budget=12, auto_budget=False, learn_acceptance=learn)
    for prompt in ([5, 6, 7, 5, 6, 7], [9, 10, 11, 12]):
        engine.reset()
        out, _ = run_engine(engine, prompt, StopCheck(24))
        assert out == hf_greedy(model, prompt, 24)
    if learn:
        curve = engine.policy.curves[0.0]
        assert drafter.curve is curve and sum(map(sum, curve.seen)) > 0
    else:
        assert engine.policy.curves is None and drafter.curve is None


# ------------------------------------------------------------------------------------------------ n-gram

def test_ngram_proposes_what_followed_before_and_learns_trigrams():
    d = NgramDrafter(max_depth=5)
    context = [9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    tree = d.propose(context, budget=10)
    tree.validate()
    path = [tree.tokens[i] for i in range(1, len(tree)) if tree.depths()[i] <= 5]
    assert path[:5] == [4, 5, 6, 7, 8]  # the continuation after the earlier "1 2 3"
    # Tri-grams persist across a new conversation: (7, 8) was followed by 1.
    tree = d.propose([50, 51, 7, 8], budget=4)
    assert 1 in tree.tokens[1:]


def test_ngram_carries_a_repeat_past_the_end_of_the_context():
    d = NgramDrafter(max_depth=10)
    context = [5, 1, 2, 3, 1, 2, 3, 1, 2, 3]
    tree = d.propose(context, budget=64)
    tree.validate()
    node, chain = 0, []
    kids = tree.children()
    while kids[node]:
        node = max(kids[node], key=lambda c: tree.scores[c])
        chain.append(tree.tokens[node])
    assert chain == [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]  # the period-3 repeat, continued beyond what was seen


def test_ngram_learns_how_far_lookups_stay_right():
    """Survival rates per depth follow what the target went on to produce: a repeat that keeps going raises the
    score of deep nodes; continuations that break off after one token lower it."""

    def deep_score(d, context, depth):
        tree = d.propose(context, budget=64)
        depths = tree.depths()
        return max((s for s, dd in zip(tree.scores, depths) if dd == depth), default=0.0)

    loop = NgramDrafter(max_depth=12, decay=0.8)
    context = [50, 51] + [1, 2, 3, 4] * 3
    first = deep_score(loop, context, 8)
    for _ in range(6):  # the text keeps repeating, as proposed
        context = context + [1, 2, 3, 4]
        deep_score(loop, context, 8)
    assert deep_score(loop, context, 8) > first * 2

    base = [50, 51] + list(range(1, 13))
    broken, context = NgramDrafter(max_depth=12, decay=0.8), list(base)
    for j in (2, 4, 6, 8):  # a token seen before comes again; the next one is as before, the one after is new
        broken.propose(context + [base[j]], budget=64)
        context = context + [base[j], base[j + 1], 1000 + j]
        broken.propose(context, budget=64)
    query = context + [base[10]]
    assert deep_score(broken, query, 2) < deep_score(NgramDrafter(max_depth=12, decay=0.8), query, 2) / 2
    assert deep_score(broken, query, 1) > 0.9  # the first token kept being right


def test_ngram_grows_nothing_below_min_score():
    """With a min_score the drafter leaves out what could not pay for its verification: every node scored at least
    that is still proposed, with the same score, and far fewer below it are built."""

    def scored(tree):
        return path_scores(tree), max(tree.depths())

    context = [50, 51] + [1, 2, 3, 4, 5] * 4 + [7, 1, 2, 3]
    for bar in (0.15, 0.3, 0.6):
        full, cut = NgramDrafter(max_depth=24), NgramDrafter(max_depth=24)
        cut.min_score = bar
        (everything, deepest), (kept, depth) = scored(full.propose(context, 200)), scored(cut.propose(context, 200))
        assert {p: s for p, s in everything.items() if s >= bar} == {p: s for p, s in kept.items() if s >= bar}
        assert len(kept) < len(everything) and depth < deepest


def test_ngram_reset_makes_it_compare_the_context_again():
    """After reset(length) the drafter checks the next context from `length` on: a rewritten conversation is
    indexed anew (its tokens, not the old ones, are looked up)."""
    d = NgramDrafter(max_depth=4)
    d.propose([9, 1, 2, 3, 4, 5, 6], 8)
    d.reset(1)
    tree = d.propose([9, 5, 6, 8, 3, 5, 6], 8)  # as long as the old one, the same last tokens
    assert tree.tokens[1:3] == [8, 3]  # what followed "5 6" in this conversation


def test_greedy_argmax_rows_pick_the_first_maximum_as_torch_does():
    from clover_cli.decode.verify import argmax_rows

    g = torch.Generator().manual_seed(0)
    for rows, vocab in ((1, 7), (5, 8192), (33, 100)):
        logits = torch.randint(-3, 3, (rows, vocab), generator=g).float()  # many ties
        assert argmax_rows(logits) == logits.argmax(-1).tolist()
        logits[0, vocab // 2] = float("nan")
        assert argmax_rows(logits) == logits.argmax(-1).tolist()
        assert argmax_rows(logits.bfloat16()) == logits.bfloat16().argmax(-1).tolist()


def test_verify_upto_is_verify_for_every_size():
    from clover_cli.decode.budget import CostModel

    rng = random.Random(3)
    for padded in (False, True):
        for _ in range(50):
            table = {n: rng.random() for n in rng.sample(range(1, 90), rng.randint(2, 9))}
            cost = CostModel(verify_s=table, padded=padded)
            cost.monotone()
            assert cost.verify_upto(120)[1:] == [cost.verify(n) for n in range(1, 121)]


def test_cost_model_min_score_follows_speed_and_calibration():
    from clover_cli.decode.budget import CostModel

    cost = CostModel(verify_s={1: 0.010, 17: 0.018})
    assert cost.min_score() == 0.0  # nothing timed yet: every node may be grown
    cost.observe_step(4, 0.010)  # 400 tokens/s
    per_node = 0.008 / 16
    assert cost.min_score() == pytest.approx(400 * per_node)
    cost.calibration = 0.5  # the drafter's scores are worth half what they claim: a higher bar
    assert cost.min_score() == pytest.approx(800 * per_node)


def test_cost_table_refresh_follows_the_median_and_rescales_a_busy_table():
    cost = CostModel(verify_s={1: 1.0, 4: 1.2, 16: 2.0})
    cost.refresh(3, 1.0)  # not a size of the table
    cost.refresh(4, 5.0)  # e.g. a kernel built for a new size
    cost.refresh(4, 1.0)
    assert cost.verify_s == {1: 1.0, 4: 1.2, 16: 2.0} and not cost.refreshed  # too few forwards yet
    cost.refresh(4, 1.1)
    assert cost.refreshed
    assert cost.verify_s[4] == pytest.approx(1.1)  # the median: the one-time 5.0 is ignored
    # the sizes not timed yet follow the shape, scaled as size 4 is (1.1 / 1.2)
    assert cost.verify_s[1] == pytest.approx(1.0 * 1.1 / 1.2) and cost.verify_s[16] == pytest.approx(2.0 * 1.1 / 1.2)
    for _ in range(3):  # size 16 is cheaper now than the table said
        cost.refresh(16, 1.5)
    assert cost.verify_s[16] == pytest.approx(1.5)
    # size 1 (never timed) follows the median of the timed sizes' ratios to the shape: 1.1 / 1.2 and 1.5 / 2.0
    assert cost.verify_s[1] == pytest.approx(1.0 * 1.1 / 1.2)
    for _ in range(9):  # a plain step grown slower than a 4-token tree was: bigger trees never look cheaper
        cost.refresh(1, 1.5)
    assert cost.verify_s[1] == pytest.approx(1.5)
    assert cost.verify_s[4] >= cost.verify_s[1] and cost.verify_s[16] >= cost.verify_s[4]


def test_a_stale_stored_cost_comes_right_from_the_sizes_in_use():
    """A table stored while the machine was busy says 6- and 8-token trees cost twice what the build measured: the
    engine would avoid them and never time them again. Timing the sizes it does use brings them back to the
    build's shape, scaled to today's speed."""
    build = {1: 1.0, 2: 1.05, 4: 1.3, 6: 1.9, 8: 2.1, 12: 2.8}
    stored = {1: 1.2, 2: 1.3, 4: 1.6, 6: 3.8, 8: 4.2, 12: 4.3}
    cost = CostModel(verify_s=dict(stored), padded=True, shape=dict(build))
    assert cost.best_budget([0.97] * 5) <= 3  # the stale table: at most a 4-token tree
    for _ in range(3):
        cost.refresh(1, 1.1)  # plain steps and small trees, 10% slower than at build
        cost.refresh(3, 1.43)  # a 3-token tree runs as 4 (padded)
    assert cost.verify_s[1] == pytest.approx(1.1) and cost.verify_s[4] == pytest.approx(1.43)
    assert 3 not in cost.verify_s
    for n in (6, 8, 12):
        assert cost.verify_s[n] == pytest.approx(build[n] * 1.1)
    assert cost.best_budget([0.97] * 5) == 5  # now a 6-token tree pays
    for _ in range(3):
        cost.refresh(5, 1.9 * 1.1)  # a 5-token tree runs as 6
    assert cost.verify_s[6] == pytest.approx(1.9 * 1.1) and cost.recent.keys() == {1, 4, 6}


def test_padded_costs_are_steps():
    """The compiled step runs n tokens as the next size of its table: a tree between two sizes costs the larger."""
    table = {1: 1.0, 4: 2.0, 8: 3.0}
    assert CostModel(verify_s=table).verify(6) == pytest.approx(2.5)
    assert CostModel(verify_s=table, padded=True).verify(6) == 3.0
    assert CostModel(verify_s=table, padded=True).verify(4) == 2.0


def test_stop_strings_are_checked_only_when_a_token_can_complete_one():
    """A stop string that appears only now ends inside the new token's text: tokens without the last character of
    any stop string skip the decode, and every stop is still found, also across token boundaries."""
    pieces = {1: "Hel", 2: "lo U", 3: "SE", 4: "R", 5: ":", 6: " x", 7: "\ufffd"}
    calls = []

    def decode(ids):
        calls.append(len(ids))
        return "".join(pieces[i] for i in ids)

    stop = StopCheck(100, stop_strings=["USER:"], decode=decode)
    assert [stop.push(t) for t in (1, 2, 3, 4)] == [None] * 4
    assert [c for c in calls if c > 1] == []  # no token so far holds ':': the window was never decoded
    assert stop.push(5) == "stop"  # "Hello USER" + ":"
    assert StopCheck(100, stop_strings=["USER:"], decode=decode).push(6) is None
    again = StopCheck(100, stop_strings=["USER:"], decode=decode)
    assert [again.push(t) for t in (2, 3, 4, 7)] == [None] * 4 and len([c for c in calls if c > 1]) == 2


def test_each_step_is_sized_by_its_own_drafting_time():
    """Drafting time is part of a step's cost: a step whose drafter ran for long (the default drafter's heads) pays
    for more verified nodes than one that only looked up (~50x cheaper); the recent average is only the default."""
    cost = CostModel(verify_s={1: 1.0, 2: 1.3, 4: 1.8, 8: 3.2, 16: 6.0, 32: 12.0}, padded=True)
    scores = [0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2, 0.15, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]
    cheap, dear = cost.best_budget(scores, 0.1), cost.best_budget(scores, 5.0)
    assert cheap == 3 and dear == 7
    cost.draft_s = 5.0
    assert cost.best_budget(scores) == dear and cost.best_budget(scores, 0.1) == cheap
