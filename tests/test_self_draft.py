"""--draft self (issue #16 item 5): the target with layers skipped as its own draft. Lossless (greedy output identical
to transformers' generate, chain and MCSD tree; sampling keeps the target's distribution), the skipped model shares
the target's weights and computes what the target without those layers computes, the calibration chooses a valid
set and caches it on disk, and a model with too few layers is refused in one line."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from clover_cli.drafters.self_draft import SelfDrafter, calibrate, load_choice, merit, skipping
from clover_cli.store import self_draft_path
from clover_cli.decode.engine import Engine
from clover_cli.decode.verify import Sampling, StopCheck
from clover_cli.errors import CloverError
from clover_cli.target import Target
from helpers import hf_greedy, run_engine
from test_draft_model import VOCAB, make_model


def check_cache_is_a_fresh_prefill(drafter: SelfDrafter, sequence: list[int]):
    """The draft's cache holds a prefix of the conversation and exactly the keys a fresh prefill of it gives, in
    the kept layers' slots; the skipped layers' slots hold nothing."""
    ids = list(drafter.ids)
    assert len(ids) >= len(sequence) // 2 and ids == sequence[:len(ids)]
    runner = drafter.draft
    assert runner.cache.length == len(ids)
    fresh = Target(runner.model, max_context=runner.max_context)
    fresh.forward(torch.tensor(ids))
    fresh.cache.append(len(ids))
    for i, (a, b) in enumerate(zip(runner.cache.layers, fresh.cache.layers)):
        assert a.is_initialized == b.is_initialized == (i not in drafter.skip)
        if a.is_initialized:
            assert torch.allclose(a.keys[:, :, :len(ids)], b.keys[:, :, :len(ids)], atol=1e-4, rtol=1e-4)


def test_skipped_model_shares_weights_and_drops_the_layers():
    model = make_model(0, num_hidden_layers=6)
    skipped = skipping(model, [2, 4])
    assert skipping(model, [4, 2]) is skipped  # made once per set
    base, mine = model.model, skipped.model
    assert len(base.layers) == 6 and len(mine.layers) == 4  # the target is untouched
    assert [m for m in mine.layers] == [base.layers[i] for i in (0, 1, 3, 5)]  # the same modules, no copies
    assert skipped.lm_head is model.lm_head and mine.embed_tokens is base.embed_tokens
    # what the target computes without those layers (a real copy with them deleted, no cache)
    reference = copy.deepcopy(model)
    reference.model.layers = torch.nn.ModuleList([reference.model.layers[i] for i in (0, 1, 3, 5)])
    ids = torch.tensor([[5, 9, 11, 4, 7, 30]])
    with torch.inference_mode():
        want = reference(input_ids=ids, use_cache=False).logits
        got = skipped(input_ids=ids, use_cache=False).logits
        full = model(input_ids=ids, use_cache=False).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, full, atol=1e-3)
    with pytest.raises(CloverError, match="never the first or the last"):
        skipping(model, [0])


@pytest.mark.parametrize("seed", range(2))
def test_greedy_identical_to_transformers(seed):
    """Chain and MCSD tree, random budgets and shapes, several prompts, a follow-up that reuses the cache."""
    rng = random.Random(seed)
    model = make_model(seed, num_hidden_layers=5)
    target = Target(model)
    accepted = 0
    for tree in ("mcsd", "chain"):
        for skip in ([2], [1, 3], None):  # None: calibrated on the first prompt
            drafter = SelfDrafter(target, tree=tree, skip=skip, root_k=rng.choice([2, 3]),
                                  max_depth=rng.choice([3, 6]), stop_below=rng.choice([0.0, 0.2]))
            engine = Engine(target, drafter, budget=rng.choice([1, 4, 12]), auto_budget=False)
            for _ in range(2):
                prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))]
                n = rng.randint(8, 32)
                out, events = run_engine(engine, prompt, StopCheck(n))
                reference = hf_greedy(model, prompt, n)
                assert out == reference, (tree, skip, prompt)
                accepted += sum(e.accepted for e in events)
                follow = prompt + reference[: rng.randint(1, n)] + [rng.randrange(3, VOCAB)]
                out2, _ = run_engine(engine, follow, StopCheck(10))
                assert out2 == hf_greedy(model, follow, 10)
                check_cache_is_a_fresh_prefill(drafter, follow + out2)
            assert drafter.skip and all(0 < i < 4 for i in drafter.skip)
    assert accepted > 10


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_other_families_greedy_identical(family):
    """Mistral with a sliding window shorter than the replies, and Qwen2: calibrated sets, both trees."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(family, VOCAB, num_hidden_layers=5, **({"sliding_window": 6} if family == "mistral" else {}))
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    target = Target(model)
    for tree in ("mcsd", "chain"):
        engine = Engine(target, SelfDrafter(target, tree=tree), budget=8, auto_budget=False)
        for seed in range(2):
            rng = random.Random(seed)
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 14))]
            assert run_engine(engine, prompt, StopCheck(20))[0] == hf_greedy(model, prompt, 20), (tree, prompt)


def test_bundled_model_greedy_identical_to_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clover_cli.aliases import BUNDLED
    from clover_cli.templates import render

    model = AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(BUNDLED)
    target = Target(model)
    accepted = 0
    for text in ("Write a short poem about the sea.", "Explain recursion to a child."):
        ids = tok(render(tok, [{"role": "user", "content": text}], None, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"]
        reference = hf_greedy(model, ids, 24)
        for tree in ("mcsd", "chain"):
            engine = Engine(target, SelfDrafter(target, tree=tree, skip=[2, 4, 6]), budget=8, auto_budget=False)
            out, events = run_engine(engine, ids, StopCheck(24))
            assert out == reference
            accepted += sum(e.accepted for e in events)
    assert accepted > 10  # the model without three of its layers agrees with itself often


def test_sampling_keeps_the_targets_distribution():
    """Under sampling the second emitted token (the first one the draft's tree is verified for: the first comes from
    the prefill) follows the target's own distribution, its marginal sum_x p(x) p(y | x), over many seeded runs
    through the engine with a self draft (total variation within what exact draws of this size give)."""
    from clover_cli.decode.verify import warp

    vocab = 24
    model = make_model(3, vocab=vocab, num_hidden_layers=4)
    target = Target(model)
    prompt = [5, 7, 9, 11]
    s = Sampling(temperature=1.0)
    with torch.inference_mode():
        p1 = warp(model(torch.tensor([prompt])).logits[0, -1].float(), s)
        after = torch.tensor([prompt + [x] for x in range(vocab)])
        p2 = torch.stack([warp(row.float(), s) for row in model(after).logits[:, -1]])
    want = p1 @ p2  # the second token's exact marginal
    drafter = SelfDrafter(target, skip=[1, 2], root_k=3, max_depth=3, stop_below=0.0)
    engine = Engine(target, drafter, budget=8, auto_budget=False)
    draws, accepted = 1500, 0
    counts = torch.zeros(vocab)
    for i in range(draws):
        out, events = run_engine(engine, prompt, StopCheck(2), Sampling(temperature=1.0, seed=i))
        counts[out[1]] += 1
        accepted += sum(e.accepted for e in events)
    tv = 0.5 * float((counts / draws - want).abs().sum())
    assert accepted > draws // 10  # the draft's candidates were accepted, not only the target's own tokens
    # exact draws of this size give about 0.05; the draft's own marginal (sum_x p(x) q(y | x)) is 0.27 away
    assert tv < 0.1, tv


def test_calibration_chooses_a_valid_set_and_is_cached(tmp_path):
    model = make_model(1, num_hidden_layers=6)
    target = Target(model)
    choice = calibrate(model, [5, 9, 11, 4] * 10)
    assert choice["skip"] and all(0 < i < 5 for i in choice["skip"]) and choice["layers"] == 6
    assert choice["seconds"] < 5 and choice["tried"] >= 4
    assert merit(1.0 - 1e-12, 0.0) > merit(0.5, 0.2) > merit(0.5, 0.9)  # the figure of merit is sane
    where = tmp_path / "self.json"
    drafter = SelfDrafter(target, cache=where)
    assert drafter.choice is None and not where.exists()
    drafter.propose([5, 9, 11, 4, 7], 8)  # the first proposal calibrates on its context and writes the file
    saved = json.loads(where.read_text())
    assert saved["skip"] == drafter.skip and saved["layers"] == 6
    # a second drafter reads the file and never calibrates: a set written there is what it uses
    where.write_text(json.dumps(dict(saved, skip=[2, 3])))
    again = SelfDrafter(target, cache=where)
    assert again.choice is not None and again.skip == [2, 3]
    import clover_cli.drafters.self_draft as mod

    called = []
    real, mod.calibrate = mod.calibrate, lambda *a, **k: called.append(1) or real(*a, **k)
    try:
        again.propose([5, 9, 11, 4, 7], 8)
    finally:
        mod.calibrate = real
    assert not called and again.skip == [2, 3] and len(again.draft.model.model.layers) == 4
    # a stale or broken file (another layer count, a bad set) is ignored
    where.write_text(json.dumps(dict(saved, layers=7)))
    assert load_choice(where, 6) is None
    where.write_text(json.dumps(dict(saved, skip=[0])))
    assert load_choice(where, 6) is None
    where.write_text("{")
    assert load_choice(where, 6) is None
    # the cache location: per model, dtype and device, under the compile cache
    a = self_draft_path(tmp_path, "cpu", torch.float32)
    assert a != self_draft_path(tmp_path, "cpu", torch.bfloat16) and a.parent.name == "self"


def test_too_few_layers_is_refused():
    model = make_model(2, num_hidden_layers=3)
    target = Target(model)
    with pytest.raises(CloverError, match="too few layers to skip"):
        SelfDrafter(target)
    with pytest.raises(CloverError, match="too few layers to skip"):
        calibrate(model, [5, 6, 7])


def test_cli_generate_and_bench_with_self(run_cli, tmp_path, prompts_file):
    """`clover generate --draft self` prints what --draft none prints; a 2-layer model is refused in one line;
    `clover bench --methods plain,self-chain,self` rows are identical to hf's."""
    from conftest import build_model

    model_dir = build_model(tmp_path / "m4", "llama", seed=3, num_hidden_layers=4)
    prompt = tmp_path / "p.txt"
    prompt.write_text("Hello! How can I help you today?")
    runs = {}
    for draft in ("none", "self"):
        code, out, err = run_cli("generate", str(model_dir), "-f", str(prompt), "-n", "16", "--json",
                                 "--draft", draft, "--stats-file", "off")
        assert code == 0, err
        runs[draft] = json.loads(out)
    assert runs["self"]["draft"] == "self" and runs["self"]["text"] == runs["none"]["text"]
    small = build_model(tmp_path / "m2", "llama", seed=3)  # two layers
    code, out, err = run_cli("generate", str(small), "-f", str(prompt), "-n", "4", "--draft", "self",
                             "--stats-file", "off")
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1 and "too few layers to skip" in lines[0], err
    code, out, err = run_cli("bench", str(model_dir), "--prompts", str(prompts_file), "-n", "10", "--json",
                             "--methods", "hf,plain,self-chain,self", "--compile", "off")
    assert code == 0, err
    report = json.loads(out)
    rows = {r["method"]: r for r in report["methods"]}
    assert set(rows) == {"hf", "plain", "self-chain", "self"} and all(r["identical"] for r in rows.values())
    assert report["self_draft"]["skip"] and report["self_draft"]["layers"] == 4
    # a session switched to it (what chat's /draft self does) reads the cached set and stays exact
    from clover_cli.session import Options, Session

    session = Session(Options(model=str(model_dir), draft="none"), quiet=True)
    ids = session.encode_raw("Hello! How can I help you today?")
    plain = [t for ev in session.generate(ids, 12, Sampling()) for t in ev.tokens]
    session.engine.policy.values[0.0] = object()  # what the last drafter's calls were worth (decode.budget.DraftValue) ...
    session.switch_draft("self")
    assert session.engine.policy.values == {}  # ... is not the new one's
    assert session.draft_name == "self" and session.drafter.skip == report["self_draft"]["skip"]
    assert [t for ev in session.generate(ids, 12, Sampling()) for t in ev.tokens] == plain
