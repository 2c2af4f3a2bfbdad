"""Losslessness: greedy speculative output is token-identical to transformers' own greedy generate (fp32).

Hundreds of cases: three model families (Llama, Mistral with a short sliding window, Qwen2), every drafter
(random Clover-2 and Medusa heads, n-gram, none, and an oracle drafter that builds random trees around the right
answer so that deep paths are accepted), static and dynamic trees, random budgets, many prompts and lengths.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from clover_cli.drafters.base import NoDrafter
from clover_cli.drafters.merged import MergedDrafter
from clover_cli.drafters.eagle import EagleDrafter
from clover_cli.drafters.clover2 import CloverDrafter
from clover_cli.drafters.medusa import MedusaDrafter
from clover_cli.drafters.ngram import NgramDrafter
from clover_cli.decode.budget import PROBE_NODES
from clover_cli.decode.engine import Engine
from clover_cli.decode.verify import Sampling, StopCheck
from clover_cli.drafters.common import HeadsConfig
from clover_cli.drafters.registry import build_heads
from clover_cli.target import Target
from helpers import OracleDrafter, hf_greedy, run_engine
from conftest import tiny_config

FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 24},  # shorter than prompt + reply: the window is exercised
    "qwen2": {},
}


def make_model(family: str, seed: int, vocab: int = 96):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, vocab, **FAMILIES[family])
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def random_heads(model, arch: str, seed: int, num_heads: int, num_layers: int, feature_norm: bool = False):
    torch.manual_seed(seed)
    cfg = HeadsConfig.for_target(model.config, architecture=arch, num_heads=num_heads, num_layers=num_layers)
    cfg.feature_norm = feature_norm  # Clover-2 heads that norm the target's hidden state first (new heads' default)
    heads = build_heads(cfg, model)
    heads.init_from_target(model)
    with torch.no_grad():  # random, but not too far from the identity init: trees get varied shapes
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return heads.eval()


def drafter_for(kind: str, model, target, rng: random.Random, reference, prompt_len):
    if kind == "none":
        return NoDrafter()
    if kind == "ngram":
        return NgramDrafter(max_depth=rng.choice([3, 6, 10]))
    if kind == "oracle":
        return OracleDrafter(reference, prompt_len, model.config.vocab_size, rng.choice([0.5, 0.8, 0.95]),
                             rng.randrange(10**6))
    if kind in ("merged", "eagle-merged"):  # the default drafter: heads merged with n-gram lookup
        heads = "eagle" if kind == "eagle-merged" else "clover"
        return MergedDrafter(drafter_for(heads, model, target, rng, reference, prompt_len), NgramDrafter(),
                             enough=rng.choice([None, 0.5, 3.0]))
    arch = {"clover": "clover2", "medusa": "medusa", "eagle": "eagle"}[kind]
    heads = random_heads(model, arch, rng.randrange(10**6), rng.choice([1, 3, 5]), rng.choice([1, 2]))
    if rng.random() < 0.4:  # a draft-vocabulary shortlist: the heads propose only these tokens
        vocab = model.config.vocab_size
        heads.draft_vocab = torch.randperm(vocab, generator=torch.Generator().manual_seed(rng.randrange(10**6)))
        heads.draft_vocab = heads.draft_vocab[:rng.choice([8, vocab // 2, vocab - 1])]
    cls = {"clover": CloverDrafter, "medusa": MedusaDrafter, "eagle": EagleDrafter}[kind]
    grow = {"static": True} if rng.random() < 0.3 else {"topk": rng.choice([2, 4, 8]), "width": rng.choice([1, 4])}
    if kind == "eagle" and rng.random() < 0.5:
        grow = {}  # EAGLE-2's own: top-10 children, 10 nodes expanded per depth
    if kind == "clover":  # a catch-up over the last few positions only (holes in the heads' cache), or all
        grow["window"] = rng.choice([None, 2, 5, CloverDrafter.WINDOW])
    return cls(heads, target, **grow)


CASES = [(fam, kind, seed) for fam in FAMILIES
         for kind in ("clover", "medusa", "ngram", "oracle", "none", "merged") for seed in range(10)]


def check_prompts_and_follow_ups(model, target, kind: str, rng: random.Random):
    """Three random prompts (repeating, so that n-gram lookup finds matches), each decoded with a `kind` drafter and
    a random tree budget, then extended by a follow-up request that reuses the cache: every output identical to
    transformers' own greedy generate."""
    prompts = []
    for _ in range(3):
        base = [rng.randrange(3, 96) for _ in range(rng.randint(2, 12))]
        prompts.append((base * rng.randint(1, 3))[: rng.randint(1, 30)] or [5])
    for prompt in prompts:
        n = rng.randint(1, 40)
        reference = hf_greedy(model, prompt, n)
        drafter = drafter_for(kind, model, target, rng, reference, len(prompt))
        engine = Engine(target, drafter, budget=rng.choice([1, 4, 16, 40]), auto_budget=False)
        out, events = run_engine(engine, prompt, StopCheck(n))
        assert out == reference, f"prompt {prompt} n={n}"
        assert sum(len(e.tokens) for e in events) == n
        follow = prompt + reference + [rng.randrange(3, 96)]
        ref2 = hf_greedy(model, follow, 10)
        if kind == "oracle":
            engine.drafter = drafter_for(kind, model, target, rng, ref2, len(follow))
        out2, _ = run_engine(engine, follow, StopCheck(10))
        assert out2 == ref2


@pytest.mark.parametrize("family,kind,seed", CASES)
def test_greedy_matches_transformers(family, kind, seed):
    rng = random.Random(zlib.crc32(f"{family}-{kind}-{seed}".encode()))
    model = make_model(family, seed=seed % 4)
    check_prompts_and_follow_ups(model, Target(model), kind, rng)


@pytest.mark.parametrize("seed", range(8))
def test_stops_inside_accepted_paths(seed):
    """EOS, stop strings and max_new_tokens cut the output exactly where plain decoding would stop."""
    rng = random.Random(seed)
    model = make_model("llama", seed)
    target = Target(model)
    prompt = [rng.randrange(3, 96) for _ in range(8)]
    reference = hf_greedy(model, prompt, 40)
    # EOS: pick a token from the middle of the reference; HF stops right after emitting it.
    eos = reference[rng.randrange(5, 30)]
    ref_eos = hf_greedy(model, prompt, 40, eos=eos)
    assert ref_eos[-1] == eos
    engine = Engine(target, OracleDrafter(reference, len(prompt), 96, 0.95, seed), budget=24, auto_budget=False)
    out, events = run_engine(engine, prompt, StopCheck(40, eos_ids=[eos]))
    assert out == ref_eos and events[-1].finish == "eos"
    # max_new_tokens inside a long accepted path.
    k = rng.randint(1, 39)
    engine = Engine(target, OracleDrafter(reference, len(prompt), 96, 1.0, seed), budget=24, auto_budget=False)
    out, events = run_engine(engine, prompt, StopCheck(k))
    assert out == reference[:k] and events[-1].finish == "length"
    # A stop string: decode tokens as letters; stop at the first occurrence of the text of two reference tokens.
    decode = lambda ids: "".join(chr(65 + (i % 58)) for i in ids)  # noqa: E731
    j = rng.randrange(3, 30)
    stop_text = decode(reference[j:j + 2])
    first = decode(reference).find(stop_text)
    engine = Engine(target, OracleDrafter(reference, len(prompt), 96, 1.0, seed), budget=24, auto_budget=False)
    out, events = run_engine(engine, prompt, StopCheck(40, stop_strings=[stop_text], decode=decode))
    assert events[-1].finish == "stop"
    assert out == reference[:first + 2]


def test_auto_budget_is_lossless_and_measures_cost():
    model = make_model("llama", 3)
    target = Target(model)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 96) for _ in range(10)]
    reference = hf_greedy(model, prompt, 30)
    engine = Engine(target, OracleDrafter(reference, len(prompt), 96, 0.9, 0), budget=32, auto_budget=True)
    out, events = run_engine(engine, prompt, StopCheck(30))
    assert out == reference
    cost = engine.policy.cost_model
    assert cost is not None and 1 in cost.verify_s and 33 in cost.verify_s
    assert all(e.proposed <= 32 for e in events)


def test_drafts_that_never_pay_are_mostly_skipped():
    """With auto budget, a drafter whose nodes are never worth verifying is asked only now and then."""
    model = make_model("llama", 4)
    target = Target(model)
    prompt = [7, 8, 9, 10]
    reference = hf_greedy(model, prompt, 40)

    class Hopeless(OracleDrafter):
        calls = 0

        def propose(self, context, budget):
            Hopeless.calls += 1
            tree = super().propose(context, budget)
            tree.scores = [1.0] + [1e-9] * (len(tree) - 1)
            return tree

    engine = Engine(target, Hopeless(reference, len(prompt), 96, 0.0, 0), budget=16, auto_budget=True)
    out, events = run_engine(engine, prompt, StopCheck(40))
    assert out == reference
    steps = len(events) - 1
    assert Hopeless.calls < steps / 2
    probes = [e for e in events if e.proposed]  # retries verify a few nodes to keep learning
    assert all(e.proposed <= PROBE_NODES for e in probes) and len(probes) <= steps / 8 + 1


def test_a_low_calibration_recovers_and_is_kept_per_temperature():
    """Acceptance learned while sampling (low) must not stop greedy drafting, and a calibration that fell too low
    recovers through the retries' probes instead of skipping drafts for good."""
    model = make_model("llama", 5)
    target = Target(model)
    prompt = [11, 12, 13, 14]
    reference = hf_greedy(model, prompt, 60)
    engine = Engine(target, OracleDrafter(reference, len(prompt), 96, 1.0, 0), budget=16, auto_budget=True)
    out, _ = run_engine(engine, prompt, StopCheck(4))  # calibrates the cost model
    # fixed costs (a 16-node tree at 1.5x a plain step): what follows must not hang on this machine's timing noise
    engine.policy.cost_model.verify_s = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.25, 17: 1.5}
    engine.policy.cost_model.use_mode(0.7)
    engine.policy.cost_model.calibration = 0.0  # as if sampling at 0.7 had accepted nothing
    engine.policy.cost_model.use_mode(0.5)
    engine.policy.cost_model.use_mode(0.0)
    assert (engine.policy.cost_model.calibration > 0.5
            and engine.policy.cost_model.by_mode[0.7] == 0.0)  # greedy keeps its own
    engine.policy.cost_model.use_mode(0.5)
    engine.policy.cost_model.by_mode[0.0] = 0.0  # now greedy itself starts hopeless
    engine.reset()
    out, events = run_engine(engine, prompt, StopCheck(60))
    assert out == reference
    assert engine.policy.cost_model.calibration > 0.3
    assert sum(e.accepted for e in events[len(events) // 2:]) > len(events) // 2, "drafting resumed"


def test_draft_vocabulary_round_trip_and_refusals(tmp_path):
    """A shortlist survives save/load as int64 ids, drafts only its tokens, and a corrupt one is refused."""
    from safetensors.torch import load_file, save_file

    from clover_cli.drafters.common import DraftProjection
    from clover_cli.errors import CloverError
    from clover_cli.drafters.registry import load_own as load_heads, save_heads

    model = make_model("llama", 6)
    heads = random_heads(model, "clover2", 1, 2, 1)
    heads.cfg.draft_vocab_size = 16
    heads.draft_vocab = torch.arange(40, 56)
    save_heads(heads, tmp_path / "h", "card\n")
    loaded = load_heads(tmp_path / "h", model)
    assert loaded.draft_vocab.dtype == torch.long and loaded.draft_vocab.tolist() == list(range(40, 56))
    target = Target(model)
    proj = DraftProjection(target.lm_head, loaded.draft_vocab)
    x = torch.randn(3, model.config.hidden_size)
    full = target.lm_head(x)[:, 40:56]
    assert torch.allclose(proj(x), full, atol=1e-5)
    state = load_file(str(tmp_path / "h" / "model.safetensors"))
    for bad in (state["draft_vocab"].half(), torch.full((16,), 10**6), -state["draft_vocab"]):
        save_file({**state, "draft_vocab": bad}, str(tmp_path / "h" / "model.safetensors"))
        with pytest.raises(CloverError, match="draft vocabulary"):
            load_heads(tmp_path / "h", model)


def test_merged_drafter_skips_the_heads_when_lookup_is_confident():
    from clover_cli.tree import DraftTree

    class Fixed:
        name, calls = "fixed", 0

        def __init__(self, scores):
            self.scores = scores

        def propose(self, context, budget):
            Fixed.calls += 1
            n = len(self.scores)
            tree = DraftTree([context[-1]] + list(range(5, 5 + n)), [-1] + list(range(n)))
            tree.scores = [1.0] + self.scores
            return tree

    heads, lookup = Fixed([0.9, 0.8]), Fixed([0.9, 0.9, 0.9, 0.9])
    merged = MergedDrafter(heads, lookup, enough=3.0)
    assert len(merged.propose([1, 2], 16)) == 5 and Fixed.calls == 1  # 3.6 expected: lookup alone
    lookup.scores = [0.5, 0.4]
    assert len(merged.propose([1, 2], 16)) >= 3 and Fixed.calls == 3  # 0.9 expected: both drafters


def clover_and_hidden(seed: int, num_layers: int, length: int, step: int):
    """(target, random Clover-2 heads, token ids [1, length], the target's pre-norm hidden states, next tokens)."""
    from clover_cli.target import hidden_states

    model = make_model("llama", seed)
    heads = random_heads(model, "clover2", seed + 1, 3, num_layers)
    ids = torch.tensor([[(step * i) % 90 + 3 for i in range(length)]])
    with torch.inference_mode():
        pre, _ = hidden_states(model, ids)
    return Target(model), heads, ids, pre[0], ids[0, 1:]


def test_clover_drafter_catches_up_lazily_across_resets():
    """observe() only queues; the augmenting block runs when a proposal needs it. Whatever mix of observes,
    proposals and partial resets, the drafter proposes what one in-order pass over the kept tokens gives."""
    target, heads, ids, hidden, nxt = clover_and_hidden(7, num_layers=1, length=24, step=7)

    def fed(spans):
        d = CloverDrafter(heads, target, topk=4, width=4)
        for op in spans:
            if op[0] == "observe":
                d.observe(hidden[op[1]:op[2]], nxt[op[1]:op[2]])
            elif op[0] == "reset":
                d.reset(op[1])
            else:
                d.propose([1], 16)
        return d.propose(ids[0, :20].tolist(), 16), d

    want, plain = fed([("observe", 0, 20)])
    for spans in ([("observe", 0, 10), ("observe", 10, 14), ("reset", 12), ("observe", 12, 20)],
                  [("observe", 0, 10), ("propose",), ("observe", 10, 15), ("reset", 8), ("observe", 8, 20)],
                  [("observe", 0, 6), ("propose",), ("observe", 6, 9), ("propose",), ("observe", 9, 20)]):
        got, d = fed(spans)
        assert d.cache.length == 20 and not d.observed.pending
        assert torch.allclose(d.state, plain.state, atol=1e-5), spans
        assert got.tokens == want.tokens and got.parents == want.parents, spans


def test_clover_catch_up_window_runs_the_last_positions_at_their_own_positions():
    """A catch-up longer than the window runs the augmenting block over its last `window` positions only, at their
    true positions, after what the cache held; a reset into the skipped stretch cuts the cache before it."""
    from clover_cli.target import TreeKVCache

    target, heads, ids, hidden, nxt = clover_and_hidden(11, num_layers=2, length=40, step=5)

    d = CloverDrafter(heads, target, window=6)
    d.observe(hidden[:30], nxt[:30])
    d.propose(ids[0, :31].tolist(), 8)
    assert d.cache.length == 6 and d.observed.slots == list(range(24, 30))
    d.observe(hidden[30:33], nxt[30:33])  # within the window: every position runs
    d.propose(ids[0, :34].tolist(), 8)
    assert d.observed.slots == list(range(24, 33))

    with torch.inference_mode():  # the same state from scratch: positions 24-29, then 30-32, in a fresh cache
        block, cache = d.augment_block, TreeKVCache(heads.cfg.num_layers, 64, 64)
        block(hidden[24:30], nxt[24:30], torch.arange(24, 30), cache)
        cache.append(6)
        want = block(hidden[30:33], nxt[30:33], torch.arange(30, 33), cache)[-1]
    assert torch.allclose(d.state, want, atol=1e-5)

    d.reset(27)  # inside what the cache holds: slots from position 27 on go
    assert d.cache.length == 3 and d.observed.slots == [24, 25, 26]
    d.reset(10)  # inside the skipped stretch: nothing before it had a slot
    assert d.cache.length == 0 and d.observed.slots == []
    d.observe(hidden[10:14], nxt[10:14])
    d.propose(ids[0, :15].tolist(), 8)
    assert d.observed.slots == [10, 11, 12, 13]
    with torch.inference_mode():
        cache = TreeKVCache(heads.cfg.num_layers, 64, 64)
        want = d.augment_block(hidden[10:14], nxt[10:14], torch.arange(10, 14), cache)[-1]
    assert torch.allclose(d.state, want, atol=1e-5)


def _chain_drafter(n, score=0.3):
    """A drafter proposing the chain 5, 6, ..., 4 + n under the root, each node scored `score`."""
    from clover_cli.tree import DraftTree

    class Chain(NoDrafter):
        def propose(self, context, budget):
            return DraftTree([context[-1]] + list(range(5, 5 + n)), [-1] + list(range(n)), [1.0] + [score] * n)

    return Chain()


def test_merged_drafter_learns_when_its_first_drafter_pays(monkeypatch):
    """With ChoiceStats the merged drafter runs its first drafter where steps with it gave more tokens per second,
    each step timed from its proposal to the end of its verification, and notices when that changes."""
    import time as time_module

    from clover_cli.drafters.merged import ChoiceStats

    clock = {"t": 0.0}
    monkeypatch.setattr(time_module, "perf_counter", lambda: clock["t"])
    choices = ChoiceStats()
    # the second alone expects 0.3 tokens: the prior runs the first; the merged tree is the chain 5, ..., 9
    merged = MergedDrafter(_chain_drafter(5), _chain_drafter(1), enough=3.0, choices=choices)

    def run(steps, with_first, without_first):
        ran = []
        for _ in range(steps):
            tree = merged.propose([1, 2], 16)
            first = len(tree) > 2
            ran.append(first)
            accepted, seconds = with_first if first else without_first
            clock["t"] += seconds
            merged.observe(None, torch.tensor(accepted + [0]))  # the accepted drafted tokens, then the target's
        return ran

    ran = run(40, ([5, 6], 3.0), ([5], 1.0))  # the first drafter costs more than it brings: 1 vs 2 tokens/s
    assert ran[:2] == [True, False] and sum(ran[10:]) <= 30 // ChoiceStats.EXPLORE_FAR + 1  # 2x slower: rarely
    ran = run(250, ([5, 6, 7, 8, 9], 1.0), ([5], 1.0))  # now it pays (6 vs 2 tokens/s): soon it runs
    assert sum(ran[-30:]) >= 30 - 30 // ChoiceStats.EXPLORE - 1


def test_merged_drafter_times_only_each_proposals_own_step(monkeypatch):
    """After a step whose tree is empty the engine may make plain steps without asking the drafter (its idle rule,
    DraftValue). Those are not the proposal's: counted in, a step without the first drafter looked (1 + the plain
    steps) times slower than it was, and the first drafter ran wherever the second had nothing. Here the first
    drafter adds nothing and costs 1.5x a step, and each step without it is followed by 7 plain steps: it must
    soon be left out."""
    import time as time_module

    from clover_cli.drafters.merged import ChoiceStats

    clock = {"t": 0.0}
    monkeypatch.setattr(time_module, "perf_counter", lambda: clock["t"])
    choices = ChoiceStats()
    merged = MergedDrafter(_chain_drafter(5), _chain_drafter(1), enough=3.0, choices=choices)
    ran = []
    for _ in range(200):
        tree = merged.propose([1, 2], 16)
        first = len(tree) > 2
        ran.append(first)
        clock["t"] += 1.5 if first else 1.0
        merged.observe(None, torch.tensor([5, 0]))  # the second's one token, accepted either way
        if not first:
            for _ in range(7):  # the engine's plain steps before it asks again
                clock["t"] += 1.0
                merged.observe(None, torch.tensor([0]))
    assert sum(ran[20:]) <= 180 // ChoiceStats.EXPLORE + 1, sum(ran[20:])
    assert all(v == [1.0] * len(v) for (b, way), v in choices.seconds.items() if not way)


def test_merged_drafter_credits_its_first_drafter_only_with_what_it_adds(monkeypatch):
    """How many tokens a step gives depends mostly on the text. Here the text repeats (lookup alone accepts 8) on
    exactly the steps the choice explores, and the first drafter adds nothing while costing 1.5x a step: comparing
    the rates of the steps made each way would credit the first drafter with lookup's luck; the paired estimate
    (what the second alone would have had on the very steps that ran both) must keep it off."""
    import time as time_module

    from clover_cli.drafters.merged import ChoiceStats

    clock = {"t": 0.0}
    monkeypatch.setattr(time_module, "perf_counter", lambda: clock["t"])
    choices = ChoiceStats()
    merged = MergedDrafter(_chain_drafter(9), _chain_drafter(8, 0.01), enough=3.0, choices=choices)
    ran = []
    for _ in range(400):
        tree = merged.propose([1, 2], 16)
        first = len(tree) > 9
        ran.append(first)
        accepted = list(range(5, 13)) if choices.decisions[0] % ChoiceStats.EXPLORE == 0 else []  # lucky steps
        clock["t"] += 1.5 if first else 1.0
        merged.observe(None, torch.tensor(accepted + [0]))
    assert sum(ran[50:]) <= len(ran[50:]) // ChoiceStats.EXPLORE_FAR + 1, sum(ran[50:])
    assert choices.rate(0, True) < choices.rate(0, False)


def test_accepted_in_walks_the_tree_from_its_root():
    from clover_cli.drafters.merged import _accepted_in
    from clover_cli.tree import DraftTree

    tree = DraftTree([1, 5, 6, 7, 8], [-1, 0, 1, 0, 3], [1.0, 0.5, 0.4, 0.3, 0.2])  # 1 -> 5 -> 6 and 1 -> 7 -> 8
    assert [_accepted_in(tree, a) for a in ([], [5], [5, 6], [5, 6, 9], [7, 8], [8], [5, 8])] == [0, 1, 2, 2, 2, 0, 1]


def test_choice_stats_is_not_turned_by_one_pause():
    """A step that took 100 times its usual time (the process paused) must not turn a bin to the other way."""
    from clover_cli.drafters.merged import ChoiceStats

    choices = ChoiceStats()
    for _ in range(20):
        choices.add((0, False), 2, 1.0)  # lookup alone: 2 tokens a second
        choices.add((0, True), 3, 2.0, alone=2)  # the first drafter adds 1 token and doubles the step: 1.5 a second
    assert choices.rate(0, False) > choices.rate(0, True)
    choices.add((0, False), 2, 100.0)
    assert choices.rate(0, False) > choices.rate(0, True)
    assert [choices.choose(0, True) for _ in range(4)] == [False] * 4


def test_choice_stats_state_round_trips_and_refuses_what_is_not_one(monkeypatch):
    """What the default drafter learned is kept on disk between processes (a one-shot reply is too short to learn
    it): a ChoiceStats restored from another's state estimates the same rates and makes the same decisions."""
    import json
    import time as time_module

    from clover_cli.drafters.merged import ChoiceStats

    clock = {"t": 0.0}
    monkeypatch.setattr(time_module, "perf_counter", lambda: clock["t"])
    learned = ChoiceStats()
    merged = MergedDrafter(_chain_drafter(5), _chain_drafter(1), enough=3.0, choices=learned)
    for step in range(60):
        first = len(merged.propose([1, 2], 16)) > 2
        clock["t"] += (2.0 + step % 3) if first else 1.0
        merged.observe(None, torch.tensor(([5, 6, 7] if first else [5]) + [0]))
    restored = ChoiceStats()
    restored.restore(json.loads(json.dumps(learned.state())))  # through JSON, as the store keeps it
    assert restored.state() == learned.state()
    for way in (False, True):
        assert restored.rate(0, way) == pytest.approx(learned.rate(0, way))
    assert [restored.choose(0, True) for _ in range(40)] == [learned.choose(0, True) for _ in range(40)]
    fresh = ChoiceStats()
    assert fresh.choose(0, True) is True  # nothing learned: the prior first
    for bad in ({}, {"sums": {"alone/0": [1.0, 0.0]}, "seconds": {}, "decisions": {}},
                {"sums": {}, "seconds": {"0/1": []}, "decisions": {}}, {"sums": [], "seconds": {}, "decisions": {}},
                {"sums": {"other/0": [1, 1]}, "seconds": {}, "decisions": {}},
                {"sums": {}, "seconds": {"0/1": [float("nan")]}, "decisions": {}},
                {"sums": {"gain/0": [float("inf"), 1.0]}, "seconds": {}, "decisions": {}}):
        before = restored.state()
        with pytest.raises(ValueError):
            restored.restore(bad)
        assert restored.state() == before


@pytest.mark.parametrize("slower, every", [(1.15, 8), (1.45, 32), (2.0, 128)])
def test_choice_stats_tries_the_other_way_less_the_slower_it_is(slower, every):
    """The way the estimates do not favour is still tried now and then (a change must be noticed), the less often
    the slower it is: each try costs about `slower` - 1 steps."""
    from clover_cli.drafters.merged import ChoiceStats

    assert every in (ChoiceStats.EXPLORE, ChoiceStats.EXPLORE_FAR, ChoiceStats.EXPLORE_FARTHER)
    choices = ChoiceStats()
    for _ in range(9):
        choices.add((0, False), 2, 1.0)
        choices.add((0, True), 2, slower, alone=2)  # the heads add nothing and make the step `slower` times dearer
    ran = [choices.choose(0, True) for _ in range(1024)]
    assert sum(ran) == 1024 // every


def hf_greedy_penalised(model, prompt: list[int], n: int, penalty: float) -> list[int]:
    """transformers' greedy generate with its repetition penalty (RepetitionPenaltyLogitsProcessor), EOS off."""
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             repetition_penalty=penalty, eos_token_id=None, pad_token_id=0)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family,kind,seed", [(fam, kind, seed) for fam in ("llama", "qwen2")
                                              for kind in ("clover", "medusa", "ngram", "oracle", "merged", "none")
                                              for seed in range(3)])
def test_greedy_with_a_repetition_penalty_matches_transformers(family, kind, seed):
    """With a repetition penalty every tree node is judged on its own sequence (context + its path): the output is
    transformers' own greedy generate with the same penalty, for every drafter, tree shape and budget, and a reply
    that reuses the cache; the penalty really changes the output (else this would test nothing)."""
    rng = random.Random(zlib.crc32(f"penalty-{family}-{kind}-{seed}".encode()))
    model = make_model(family, seed=seed)
    target = Target(model)
    changed = 0
    for _ in range(3):
        base = [rng.randrange(3, 96) for _ in range(rng.randint(2, 8))]
        prompt = (base * rng.randint(1, 3))[: rng.randint(1, 24)] or [5]
        penalty, n = rng.choice([1.3, 2.0, 0.7]), rng.randint(8, 40)
        reference = hf_greedy_penalised(model, prompt, n, penalty)
        changed += reference != hf_greedy(model, prompt, n)
        drafter = drafter_for(kind, model, target, rng, reference, len(prompt))
        engine = Engine(target, drafter, budget=rng.choice([4, 16, 40]), auto_budget=False)
        out, _ = run_engine(engine, prompt, StopCheck(n), Sampling(repetition_penalty=penalty))
        assert out == reference, f"prompt {prompt} n={n} penalty {penalty}"
        follow = prompt + reference + [rng.randrange(3, 96)]
        ref2 = hf_greedy_penalised(model, follow, 10, penalty)
        if kind == "oracle":
            engine.drafter = drafter_for(kind, model, target, rng, ref2, len(follow))
        out2, _ = run_engine(engine, follow, StopCheck(10), Sampling(repetition_penalty=penalty))
        assert out2 == ref2
    assert changed
