"""The static-shape step (clover_cli/step/graphs.py) against the eager step and transformers' own greedy generate.

On a CPU the static step runs as plain operators (what CI checks: the padded rows, the device-side KV writes, the
mask built from the committed length and the tree, sliding windows); on a CUDA device the same tests run it
captured as CUDA graphs and replayed.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from clover_cli.drafters.merged import MergedDrafter
from clover_cli.drafters.clover2 import CloverDrafter
from clover_cli.drafters.medusa import MedusaDrafter
from clover_cli.drafters.ngram import NgramDrafter
from clover_cli.decode.engine import Engine
from clover_cli.decode.verify import StopCheck
from clover_cli.step.graphs import SIZES, StaticStep, attach, heads_graphs
from clover_cli.target import Target
from clover_cli.tree import DraftTree
from conftest import tiny_config
from helpers import run_engine
from test_lossless import drafter_for as lossless_drafter, random_heads

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
FAMILIES = {"llama": {}, "mistral": {"sliding_window": 24}, "qwen2": {}}


def make_model(family: str, seed: int, device: str, dtype=torch.float32, vocab: int = 96):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, vocab, max_position_embeddings=1024, **FAMILIES[family])
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.seed = seed
    return model.to(device=device, dtype=dtype)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return DraftTree([rng.randrange(3, vocab) for _ in range(n)], parents)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_static_step_matches_the_eager_step_on_random_trees(family, device):
    """Logits, hidden states and the keys and values written, for random trees of every size up to the largest,
    after prompts long enough to cross span boundaries (256, 512) and the sliding window."""
    model = make_model(family, 0, device)
    rng = random.Random(zlib.crc32(f"trees-{family}".encode()))
    eager, static = Target(model, initial_capacity=640), Target(model, initial_capacity=640)
    step = attach(static, 640)
    assert static.cache.capacity == 640
    for past in (0, 5, 250, 300, 509):
        prompt = torch.tensor([rng.randrange(3, 96) for _ in range(past)], device=device, dtype=torch.long)
        for target in (eager, static):
            target.reset(0)
            if past:
                target.forward(prompt)
                target.cache.append(past)
        for n in sorted({1, 2, 3, 7, 16, 33, 64, rng.randint(1, 64)}):
            if past + step.rows_for(n) > 640:
                continue
            tree = random_tree(rng, n, 96)
            tokens, depths, mask = tree.tensors(device)
            assert step.fits(static.cache, n)
            want_pre, want = eager.forward(tokens, past + depths, mask)
            got_pre, got = static.forward(tokens, past + depths, mask)
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
            torch.testing.assert_close(got_pre, want_pre, atol=2e-5, rtol=1e-4)
            for live, ref in zip(static.cache.layers, eager.cache.layers):
                torch.testing.assert_close(live.keys[:, :, :past + n], ref.keys[:, :, :past + n], atol=2e-5, rtol=0)
                torch.testing.assert_close(live.values[:, :, :past + n], ref.values[:, :, :past + n], atol=2e-5,
                                           rtol=0)
            rows = torch.tensor(sorted(rng.sample(range(n), max(1, n // 2))), device=device)
            _, picked = static.forward(tokens, past + depths, mask, logits_for=rows)
            torch.testing.assert_close(picked, want[rows], atol=2e-4, rtol=1e-4)
    if device == "cuda":
        assert len(step.graphs), "no graph was captured"
        assert {span for _, span in step.graphs.keys()} >= {256, 512}


def test_a_step_that_does_not_fit_runs_eager():
    model = make_model("llama", 1, "cpu")
    target = Target(model, initial_capacity=300)
    step = attach(target, 300)
    assert not step.fits(target.cache, SIZES[-1] + 1)  # longer than the largest size: a prefill
    target.cache.length = 290
    assert step.fits(target.cache, 8) and not step.fits(target.cache, 9)  # 16 rows would pass the capacity
    target.cache.length = 0
    target.cache.grow_to(600)  # the buffers moved: the program is not for them
    assert not step.fits(target.cache, 1)


def drafter_for(kind, model, target, rng, reference, prompt_len):
    if kind in ("none", "ngram", "oracle"):
        return lossless_drafter(kind, model, target, rng, reference, prompt_len)
    # built beside a CPU twin of the model: moving the model itself would move the weights the graphs read
    twin = make_model(model.config.model_type, model.seed, "cpu")
    heads = random_heads(twin, "clover2", rng.randrange(10**6), rng.choice([1, 3, 5]), 1)
    clover = CloverDrafter(heads.to(target.device), target, topk=rng.choice([2, 4, 8]), width=rng.choice([1, 4]))
    clover.attach_programs(heads_graphs(clover, target.cache.capacity))  # as the session does on CUDA
    return MergedDrafter(clover, NgramDrafter()) if kind == "merged" else clover


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family,kind", [(family, kind) for family in FAMILIES
                                         for kind in ("none", "ngram", "oracle", "clover", "merged")])
def test_greedy_with_the_static_step_matches_transformers(family, kind, device):
    """Speculative decoding through the static step (prefills longer than the largest size run eager between
    them): every output token-identical to transformers' own greedy generate, follow-ups reusing the cache."""
    rng = random.Random(zlib.crc32(f"greedy-{family}-{kind}".encode()))
    model = make_model(family, rng.randrange(4), device)
    target = Target(model, initial_capacity=512)
    step = attach(target, 512)
    for _ in range(3):
        base = [rng.randrange(3, 96) for _ in range(rng.randint(2, 12))]
        prompt = (base * rng.randint(1, 12))[: rng.choice([rng.randint(1, 30), rng.randint(60, 120)])] or [5]
        n = rng.randint(8, 48)
        reference = hf_greedy(model, prompt, n)
        drafter = drafter_for(kind, model, target, rng, reference, len(prompt))
        engine = Engine(target, drafter, budget=rng.choice([4, 16, 40]), auto_budget=False)
        out, _ = run_engine(engine, prompt, StopCheck(n))
        assert out == reference, f"prompt {prompt} n={n}"
        follow = prompt + reference + [rng.randrange(3, 96)]
        ref2 = hf_greedy(model, follow, 10)
        if kind == "oracle":
            engine.drafter = drafter_for(kind, model, target, rng, ref2, len(follow))
        out2, _ = run_engine(engine, follow, StopCheck(10))
        assert out2 == ref2
    if device == "cuda":
        assert len(step.graphs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_half_precision_graphs_match_the_eager_step():
    """fp16 on the GPU: the graph replay computes what the eager step (with the Triton kernels) computes, up to
    half-precision rounding, and picks the same top tokens."""
    model = make_model("llama", 2, "cuda", torch.float16, vocab=512)
    eager, static = Target(model, initial_capacity=1024), Target(model, initial_capacity=1024)
    attach(static, 1024)
    rng = random.Random(7)
    prompt = torch.randint(3, 512, (300,), device="cuda")
    for target in (eager, static):
        target.forward(prompt)
        target.cache.append(300)
    for n in (1, 5, 16, 40, 64):
        tokens, depths, mask = random_tree(rng, n, 512).tensors("cuda")
        _, want = eager.forward(tokens, 300 + depths, mask)
        _, got = static.forward(tokens, 300 + depths, mask)
        torch.testing.assert_close(got, want, atol=5e-2, rtol=1e-2)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


def test_static_step_class_is_a_program():
    model = make_model("qwen2", 3, "cpu")
    target = Target(model, initial_capacity=256)
    step = StaticStep(target, 256, sizes=(1, 4))
    assert step.rows_for(3) == 4 and step.rows_for(5) is None
    assert step.span_for(1) == 256 and step.span_for(257) == 256  # never past the capacity


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family,window", [("llama", None), ("mistral", None), ("mistral", 5)])
def test_heads_static_calls_match_the_eager_heads(family, window, device):
    """Clover-2's catch-up (over 1..64 new positions, across span boundaries, the heads' cache written in place;
    with a catch-up window, slots that are not positions, under the target's sliding window) and its levels (1..64
    rows, and more: eager), and Medusa's heads: the static calls (captured on CUDA) give the eager modules' states
    and ranked tokens."""
    twin = make_model(family, 5, "cpu")
    model = make_model(family, 5, device)
    target = Target(model, initial_capacity=640)
    attach(target, 640)
    heads = random_heads(twin, "clover2", 11, 3, 2).to(device)
    eager, static = CloverDrafter(heads, target, window=window), CloverDrafter(heads, target, window=window)
    programs = heads_graphs(static, 640)
    static.attach_programs(programs)
    g = torch.Generator().manual_seed(3)
    hidden_size = model.config.hidden_size
    for n in (1, 3, 5, 17, 64, 2, 64, 64, 64, 4):  # 284 positions after the ninth catch-up: past the first span
        hidden = torch.randn(n, hidden_size, generator=g).to(device)
        tokens = torch.randint(3, 96, (n,), generator=g).to(device)
        for drafter in (eager, static):
            drafter.observe(hidden, tokens)
            drafter._catch_up()
        torch.testing.assert_close(static.state, eager.state, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(static.cache.layers[0].keys[:, :, :static.cache.length],
                                   eager.cache.layers[0].keys[:, :, :eager.cache.length], atol=2e-5, rtol=1e-4)
    assert static.cache.length == eager.cache.length == (288 if window is None else 40)
    for r in (1, 3, 8, 20, 64, 70):
        states = torch.randn(r, hidden_size, generator=g).to(device)
        tokens = torch.randint(3, 96, (r,), generator=g).to(device)
        for depth in (0, 1):
            want = eager.levels[depth](states, tokens)
            got = programs.levels[depth](states, tokens)
            torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-4)
            assert torch.equal(got[2], want[2])
    medusa_heads = random_heads(twin, "medusa", 12, 4, 1).to(device)
    medusa = MedusaDrafter(medusa_heads, target)
    medusa_programs = heads_graphs(medusa, 640)
    for _ in range(3):
        last = torch.randn(1, hidden_size, generator=g).to(device)
        want, got = medusa.levels(last), medusa_programs.levels(last)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-4)
        assert torch.equal(got[1], want[1])
    if device == "cuda":
        assert len(programs.graphs) and len(medusa_programs.graphs)


def test_the_session_compiler_attaches_static_calls_on_cuda(tmp_path):
    """StepCompiler on a CUDA device (here: told so, with the model on the CPU, where the static calls run
    uncaptured): the static step attached at once, nothing built, the heads' static calls attached to the drafter
    and to another one (ready_heads), and what the banner says; --compile off and 8-bit stay eager."""
    from clover_cli.step.manager import StepCompiler

    model = make_model("llama", 4, "cpu")
    model.save_pretrained(tmp_path / "model")
    target = Target(model)
    cuda = torch.device("cuda")
    compiler = StepCompiler("auto", target, tmp_path / "model", torch.float32, cuda, warn=pytest.fail)
    assert compiler.active and isinstance(target.program, StaticStep)
    twin = make_model("llama", 4, "cpu")
    drafter = CloverDrafter(random_heads(twin, "clover2", 1, 3, 1), target)
    compiler.use_drafter(drafter, tmp_path / "heads")
    assert drafter.programs is not None and drafter.programs.kind == "clover"
    assert compiler.describe() == "CUDA graphs active; heads too"
    compiler.start(background=True)
    assert compiler.builder is None  # nothing to build
    other = MedusaDrafter(random_heads(twin, "medusa", 2, 3, 1), target)
    assert compiler.ready_heads(other, tmp_path / "medusa") and other.programs.kind == "medusa"
    reference = hf_greedy(model, [5, 6, 7, 5, 6], 24)
    out, _ = run_engine(Engine(target, drafter, budget=16, auto_budget=False), [5, 6, 7, 5, 6], StopCheck(24))
    assert out == reference

    for mode, eight_bit, reason in (("off", False, "--compile off"), ("auto", True, "8-bit weights are not compiled")):
        plain = Target(make_model("llama", 4, "cpu"))
        compiler = StepCompiler(mode, plain, tmp_path / "model", torch.float32, cuda, load_in_8bit=eight_bit,
                                warn=pytest.fail)
        assert not compiler.active and plain.program is None and compiler.reason == reason


def test_a_capture_that_fails_falls_back_to_eager_once():
    """A forward that cannot be captured (here: capture asked for on a CPU, where torch.cuda fails) runs eager
    instead, the target and the heads go back to their eager modules for good, and each says why once."""
    model = make_model("llama", 6, "cpu")
    eager, target = Target(model, initial_capacity=256), Target(model, initial_capacity=256)
    step = attach(target, 256, capture=True)
    heard = []
    step.on_failure = heard.append
    tokens = torch.tensor([5, 9, 11, 4])
    for t in (eager, target):
        out = t.forward(tokens)
    torch.testing.assert_close(out[1], eager.forward(tokens)[1])
    assert target.program is None and len(heard) == 1 and "cannot capture" in heard[0]

    twin = make_model("llama", 6, "cpu")
    heads = random_heads(twin, "clover2", 4, 3, 1)
    want, got = CloverDrafter(heads, eager), CloverDrafter(heads, target)
    programs = heads_graphs(got, 256, capture=True)
    programs.on_failure = heard.append
    got.attach_programs(programs)
    hidden, next_tokens = torch.randn(4, model.config.hidden_size), torch.tensor([9, 11, 4, 7])
    for d in (want, got):
        d.observe(hidden, next_tokens)
    tree_want, tree_got = want.propose([5, 9, 11, 4, 7], 16), got.propose([5, 9, 11, 4, 7], 16)
    assert (tree_got.tokens, tree_got.parents) == (tree_want.tokens, tree_want.parents)
    assert got.programs is None and len(heard) == 2 and "heads" in heard[1]


def test_the_session_compiler_checks_the_static_step_first(tmp_path, monkeypatch):
    """A static step that computes something else than the eager one (here: attention that sees every key), or
    whose first capture fails, is never used: the session runs eager with one warning line."""
    from clover_cli.step import graphs
    from clover_cli.step.manager import StepCompiler

    model = make_model("llama", 7, "cpu")
    model.save_pretrained(tmp_path / "model")
    plain_mask = graphs.Rows.mask

    def sees_everything(self, rows, span):
        mask, extra = plain_mask(self, rows, span)
        return torch.ones_like(mask), extra

    broken_capture = graphs.Graphs.__init__
    always = lambda self, capture, device=None: broken_capture(self, True)  # noqa: E731 - captures even on a CPU
    for patch in (("mask", sees_everything), ("__init__", always)):
        with monkeypatch.context() as m:
            m.setattr(graphs.Rows if patch[0] == "mask" else graphs.Graphs, *patch)
            warned = []
            target = Target(model)
            compiler = StepCompiler("auto", target, tmp_path / "model", torch.float32, torch.device("cuda"),
                                    warn=warned.append)
            assert not compiler.active and target.program is None and compiler.graphs is None
            assert len(warned) == 1 and warned[0].startswith("no CUDA graphs: the static step"), warned
            assert target.length == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 0.9), (1.5, 0.5)])
def test_sampling_through_the_static_step_draws_what_eager_draws(temperature, top_p, device):
    """Sampling reads the static step's logits: with the same seed, the same tokens as the eager step (whose
    exactness against the target's distribution tests/test_engine.py checks), Clover-2 heads drafting."""
    from clover_cli.decode.verify import Sampling

    model = make_model("qwen2", 8, device)
    twin = make_model("qwen2", 8, "cpu")
    eager, static = Target(model), Target(model)
    attach(static, static.max_context)
    rng = random.Random(int(temperature * 10))
    for seed in range(3):
        prompt = [rng.randrange(3, 96) for _ in range(rng.randint(3, 15))]
        heads = random_heads(twin, "clover2", seed, 3, 1).to(device)
        runs = []
        for target in (eager, static):
            drafter = CloverDrafter(heads, target, topk=4, width=4)
            if target is static:
                drafter.attach_programs(heads_graphs(drafter, static.max_context))
            out, _ = run_engine(Engine(target, drafter, budget=12, auto_budget=False), prompt * 2, StopCheck(30),
                                Sampling(temperature, top_p, seed))
            runs.append(out)
        assert runs[0] == runs[1]


def test_a_draft_model_whose_capture_fails_midway_still_proposes(monkeypatch):
    """A draft model's static step whose capture fails at a new size in the middle of a proposal (out of memory at a
    larger span, say): the proposal finishes on the eager step, the same way it started, and proposes what the
    static step would have."""
    from clover_cli.step import graphs
    from clover_cli.drafters.draft_model import ModelDrafter

    model, draft = make_model("llama", 0, "cpu"), make_model("llama", 1, "cpu")
    context = [5, 9, 11, 4, 7, 8, 20]
    trees = []
    for fail in (False, True):
        target = Target(model, initial_capacity=256)
        drafter = ModelDrafter(draft, target, tree="mcsd", root_k=3, max_depth=4, stop_below=0.0)
        step = attach(drafter.draft, 256)
        heard = []
        step.on_failure = heard.append
        seen = set()
        if fail:
            def run(self, key, fn, failed=None):  # the first (rows, span) "captures" (runs as it is), later new fail
                if key not in seen and seen:
                    return failed(RuntimeError("out of memory"))
                seen.add(key)
                return fn()

            monkeypatch.setattr(graphs.Graphs, "run", run)
            step.graphs.capture = True  # the failure path is the capturing one
        tree = drafter.propose(context, 16)
        trees.append((tree.tokens, tree.parents))
        assert len(tree) > 3
        assert (drafter.draft.program is None, len(heard)) == ((True, 1) if fail else (False, 0))
        assert len(seen) == fail  # it failed after a first static call of this proposal
    assert trees[0] == trees[1]
