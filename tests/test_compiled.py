"""The compiled step (clover_cli/step/): lossless against transformers' own generate with the compiled program
running every step, on several architectures, drafters, trees and sampling settings; eager and compiled steps
mixed in one generation; the package cache, the background build and its swap, fallbacks and the CLI.

Each architecture's program is built once per test session (about 10 s each on one core).
"""

from __future__ import annotations

import json
import random
import zlib

import pytest
import torch

from clover_cli import step as contract
from clover_cli import store
from clover_cli.step import aot, aot_export, manager
from clover_cli.step.aot import CompiledStep, HeadsPrograms, Package
from clover_cli.step.aot_export import build_for, build_heads_for
from clover_cli.step.costs import StepCosts
from clover_cli.step.manager import StepCompiler
from clover_cli.drafters.clover2 import CloverDrafter
from clover_cli.drafters.medusa import MedusaDrafter
from clover_cli.decode.engine import Engine
from clover_cli.decode.verify import Sampling, StopCheck
from clover_cli.target import Target
from helpers import hf_greedy, run_engine
from test_lossless import check_prompts_and_follow_ups, drafter_for, make_model, random_heads

pytestmark = pytest.mark.slow  # a program per architecture and heads kind, built once for the file (minutes)
FAMILIES = ("llama", "mistral", "qwen2")  # GQA; a sliding window shorter than the conversations; attention bias
STATIC_SIZES = {"llama": (1, 4), "mistral": (4,), "qwen2": ()}
# Autotuning (inductor compiling and timing its own C++ products against oneDNN's) adds ~30 s to each fixed-size
# program's build and changes which kernel does a product, not what the program computes: one program of each kind
# is built as a user's is (mistral's step for 4 tokens, Medusa's heads), the others without it.
# llama's weights are rounded to float16 values: its programs for 1 and 4 tokens keep them narrow (aot_export.NARROW);
# the others' are float32 values, their programs as before.
NARROWED = ("llama",)
AUTOTUNE = {"llama": False, "mistral": True, "qwen2": False, "clover": False, "medusa": True}


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """family -> (model, package directory, capacity), each program built from its own random model."""
    root = tmp_path_factory.mktemp("programs")
    # the test models' weights are far smaller than a CPU cache: narrow wherever they are exact, as a model too large
    # to stay cached would be
    least, aot_export.NARROW_MIN_BYTES = aot_export.NARROW_MIN_BYTES, 0
    try:
        return _build_programs(root)
    finally:
        aot_export.NARROW_MIN_BYTES = least


def _build_programs(root):
    out = {}
    for i, family in enumerate(FAMILIES):
        model = make_model(family, seed=i)
        if family in NARROWED:  # as a float16 checkpoint loads in float32 (the bundled model's case)
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.half().float())
        target = Target(model)
        # every program costs ~20 s to build here (~50 s autotuned): llama gets fixed sizes for 1 and 4 tokens,
        # mistral one (a 1-token step then runs padded to 4 rows), every family the program for any size (qwen2's
        # runs its 1-token steps)
        meta = build_for(target, root / family, log=lambda text: None, static=STATIC_SIZES[family],
                         autotune=AUTOTUNE[family])
        assert [name for name, *_ in aot_export.program_table(STATIC_SIZES[family])] == sorted(meta["ranges"])
        assert meta["capacity"] == target.cache.capacity == 512
        assert set(meta["verify_s"]) >= {"1", "16", "32"} and all(v > 0 for v in meta["verify_s"].values())
        # the programs for 1, 2 or 4 tokens keep the weights narrow where they are exactly float16
        narrow = {f"step-{n}.pt2": "float16" for n in STATIC_SIZES[family] if n <= aot_export.NARROW_ROWS}
        assert meta["narrow"] == (narrow if family in NARROWED else {})
        out[family] = (model, root / family, meta["capacity"])
    return out


def compiled_target(programs, family) -> tuple:
    """(model, a Target running its compiled step), the package loaded for the model as a session loads it (programs
    built with their weights keep them: llama's narrow float16 ones read their own, not the model's float32 ones)."""
    model, path, capacity = programs[family]
    target = Target(model)
    target.attach_program(Package.find(path).load(model))
    return model, target


def counting(target):
    """Count the forwards the compiled program serves."""
    step = target.program
    calls = {"n": 0}

    class Counting:
        capacity = step.capacity

        def fits(self, cache, n):
            return step.fits(cache, n)

        def __call__(self, *args):
            calls["n"] += 1
            return step(*args)

    target.program = Counting()
    return calls


CASES = [(fam, kind, seed) for fam in FAMILIES for kind in ("none", "ngram", "oracle", "clover", "merged")
         for seed in range(4)]


@pytest.mark.parametrize("family,kind,seed", CASES + [(fam, "eagle-merged", 0) for fam in FAMILIES])
def test_compiled_greedy_matches_transformers(programs, family, kind, seed):
    rng = random.Random(zlib.crc32(f"compiled-{family}-{kind}-{seed}".encode()))
    model, target = compiled_target(programs, family)
    calls = counting(target)
    check_prompts_and_follow_ups(model, target, kind, rng)
    assert calls["n"] >= 6  # prefills and steps ran compiled, not eager


@pytest.mark.parametrize("family", FAMILIES)
def test_the_first_prefill_after_attaching_runs_compiled(programs, family):
    """attach_program makes the cache's buffers (of each layer's own shape), so a fresh target's first forward
    runs the program, and gives what the eager forward gives."""
    model, target = compiled_target(programs, family)
    calls = counting(target)
    prompt = torch.tensor([(11 * i) % 90 + 3 for i in range(30)])
    with torch.inference_mode():
        _, logits = target.forward(prompt)
        _, eager = Target(model).forward(prompt)
    assert calls["n"] == 1
    assert torch.allclose(logits, eager, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_and_compiled_steps_mix_in_one_generation(programs, family):
    """The compiled step swapped in mid-reply (as a background build does) continues the same cache exactly."""
    rng = random.Random(family)
    model, path, capacity = programs[family]
    for swap_after in (1, 3, 7):
        target = Target(model)
        prompt = [rng.randrange(3, 96) for _ in range(rng.randint(5, 20))]
        reference = hf_greedy(model, prompt * 2, 60)
        engine = Engine(target, drafter_for("oracle", model, target, rng, reference, len(prompt) * 2), budget=12,
                        auto_budget=False)
        out = []
        for i, ev in enumerate(engine.generate(prompt * 2, StopCheck(60))):
            out += ev.tokens
            if i == swap_after:
                target.attach_program(Package.find(path).load())
        assert out == reference
        assert target.program is not None



@pytest.mark.parametrize("draft_family", ["llama", "qwen2"])
def test_a_draft_model_runs_its_own_compiled_step(programs, draft_family):
    """--draft model with both steps compiled: the target's and the draft model's own (its chain and MCSD tree
    forwards through its package). Greedy output identical to transformers' generate; the draft's forwards ran
    compiled. A draft equal to the target accepts deep paths; another random model mostly rejects."""
    from clover_cli.drafters.draft_model import ModelDrafter

    rng = random.Random(f"draft-{draft_family}")
    model, target = compiled_target(programs, "llama")
    draft_model, draft_path, _ = programs[draft_family]
    for tree in ("mcsd", "chain"):
        drafter = ModelDrafter(draft_model, target, tree=tree)
        drafter.draft.attach_program(Package.find(draft_path).load(draft_model))
        calls = counting(drafter.draft)
        engine = Engine(target, drafter, budget=16, auto_budget=False)
        for _ in range(3):
            prompt = [rng.randrange(3, 96) for _ in range(rng.randint(4, 30))]
            out, _ = run_engine(engine, prompt, StopCheck(40))
            assert out == hf_greedy(model, prompt, 40)
        assert calls["n"] >= 10  # the draft's prefills and tree levels ran compiled

@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 0.9), (1.5, 0.5)])
def test_compiled_sampling_draws_what_eager_draws(programs, temperature, top_p):
    """Sampling reads the compiled program's logits: with the same seed, the same tokens as the eager step (whose
    exactness against the target's distribution tests/test_engine.py checks)."""
    model, compiled_t = compiled_target(programs, "llama")
    eager_t = Target(model)
    rng = random.Random(int(temperature * 10))
    for seed in range(4):
        prompt = [rng.randrange(3, 96) for _ in range(rng.randint(3, 15))]
        runs = []
        for target in (eager_t, compiled_t):
            engine = Engine(target, drafter_for("ngram", model, target, random.Random(seed), [], 0), budget=8,
                            auto_budget=False)
            out, _ = run_engine(engine, prompt * 2, StopCheck(30), Sampling(temperature, top_p, seed))
            runs.append(out)
        assert runs[0] == runs[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_long_prompts_run_in_pieces_and_stay_exact(programs, family):
    """A prompt longer than the largest step size runs through the compiled program in PIECES (a few row counts, so
    no memory is left behind per prompt length): the eager step's hidden states and logits, and greedy output
    identical to transformers' generate."""
    model, target = compiled_target(programs, family)
    eager = Target(model)
    step, seen = target.program, []
    real = step._run
    step._run = lambda cache, tokens, *rest: seen.append(tokens.numel()) or real(cache, tokens, *rest)
    rng = random.Random(f"long-{family}")
    for n in (81, 200, 333, 460):
        prompt = [rng.randrange(3, 96) for _ in range(n)]
        ids = torch.tensor(prompt)
        for rows in (None, slice(-1, None), torch.tensor([0, n // 2, n - 1])):
            got, want = [], []
            for t, into in ((target, got), (eager, want)):
                t.reset(0)
                into.extend(t.forward(ids, logits_for=rows))
            assert got[1].shape == want[1].shape, (n, rows)
            for a, b in zip(got, want):
                assert (a - b).abs().max() <= 1e-3 * max(1.0, b.abs().max()), (n, rows)
        target.reset(0)
        engine = Engine(target, drafter_for("ngram", model, target, rng, [], 0), budget=8, auto_budget=False)
        out, _ = run_engine(engine, prompt, StopCheck(12))
        assert out == hf_greedy(model, prompt, 12), n
    assert {n for n in seen if n > aot.SIZES[-1]} <= set(aot.PIECES) and max(seen) > aot.SIZES[-1]


def test_program_serves_only_what_fits(programs):
    model, target = compiled_target(programs, "qwen2")
    step = target.program
    from clover_cli.target import TreeKVCache

    bare = TreeKVCache(len(target.cache.layers), step.capacity, step.capacity)
    assert not step.fits(bare, 1)  # a cache without buffers (attach_program made the target's)
    target.forward(torch.tensor([5]))
    target.reset(0)
    assert step.fits(target.cache, 1) and step.fits(target.cache, step.capacity - 1)
    assert not step.fits(target.cache, step.capacity)  # the buffer full: the program is built for less
    target.cache.length = step.capacity - 5
    assert step.fits(target.cache, 4) and not step.fits(target.cache, 5)
    # near the end of the context the engine's last steps run eager, and the output stays exact
    target.cache.length = 0
    prompt = [7, 8, 9] * 160
    reference = hf_greedy(model, prompt, 30)
    engine = Engine(target, drafter_for("ngram", model, target, random.Random(0), [], 0), budget=16,
                    auto_budget=False)
    out, _ = run_engine(engine, prompt, StopCheck(30))
    assert out == reference


def test_a_wrong_program_is_refused(programs, monkeypatch):
    """build_for checks a package against the eager forward before writing it: one that computes something else is
    refused (here a built package whose logits are made slightly off)."""
    model, path, _ = programs["llama"]
    target = Target(model)
    target.forward(torch.tensor([5]))  # the buffers the check writes into
    step = Package.find(path).load()
    aot_export.check(step, target)
    real = aot.CompiledStep.__call__

    def off_by_a_bit(self, *args):
        pre, logits = real(self, *args)
        return pre, logits + 0.01 * logits.abs().max()

    monkeypatch.setattr(aot.CompiledStep, "__call__", off_by_a_bit)
    with pytest.raises(aot_export.CloverError, match="disagrees with the eager one"):
        aot_export.check(step, target)


def test_a_failed_build_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with aot_export.building(tmp_path / "pkg") as tmp:
            (tmp / "half.pt2").write_bytes(b"x")
            raise RuntimeError("the compiler failed")
    assert list(tmp_path.iterdir()) == []
    with aot_export.building(tmp_path / "pkg") as tmp:
        (tmp / "whole.pt2").write_bytes(b"x")
    assert [p.name for p in (tmp_path / "pkg").iterdir()] == ["whole.pt2"]


def test_stored_costs_spare_the_calibration(programs, tmp_path, monkeypatch):
    """A second engine for the same model and step sizes its trees from the stored verify costs: no forward is
    spent measuring them."""
    monkeypatch.setenv("CLOVER_COMPILE_CACHE", str(tmp_path))
    model, _, _ = programs["llama"]
    target = Target(model)
    costs = StepCosts(tmp_path / "model", torch.device("cpu"), torch.float32, None)
    forwards = {"n": 0}
    real = target.forward

    def counted(*args, **kwargs):
        forwards["n"] += 1
        return real(*args, **kwargs)

    target.forward = counted
    first = Engine(target, drafter_for("ngram", model, target, random.Random(0), [], 0), budget=8, cost_store=costs)
    first.policy.calibrate(first.target, 5)
    measured = forwards["n"]
    assert measured >= 5 and costs.load() == first.policy.cost_model.verify_s
    forwards["n"] = 0
    second = Engine(target, drafter_for("ngram", model, target, random.Random(0), [], 0), budget=8, cost_store=costs)
    second.policy.calibrate(second.target, 5)
    assert forwards["n"] == 0 and second.policy.cost_model.verify_s == first.policy.cost_model.verify_s
    # real forwards of the sizes in the table refresh it, and the refreshed table is saved after the reply
    _, events = run_engine(second, [5, 6, 7, 5, 6, 7, 5, 6], StopCheck(20))
    assert {ev.proposed + 1 for ev in events if not ev.prefill} & set(first.policy.cost_model.verify_s)
    assert not second.policy.cost_model.refreshed  # saved
    assert costs.load() == second.policy.cost_model.verify_s != first.policy.cost_model.verify_s


def test_a_stale_stored_table_follows_the_builds_costs(programs, tmp_path, monkeypatch):
    """With the compiled step active, the costs its build measured are the shape the stored table's untimed sizes
    follow: a size stored far too dear comes back to the build's cost, scaled as the sizes in use are."""
    monkeypatch.setenv("CLOVER_COMPILE_CACHE", str(tmp_path))
    model, _, _ = programs["llama"]

    class Built:  # what StepCosts reads of an active StepCompiler
        active = True
        verify_s = {1: 1.0e-3, 4: 1.3e-3, 8: 2.0e-3}
        weights = "float"

    assert StepCosts(tmp_path / "model", torch.device("cpu"), torch.float32, None).reference() is None
    costs = StepCosts(tmp_path / "model", torch.device("cpu"), torch.float32, Built())
    assert costs.padded and costs.reference() == Built.verify_s
    costs.save({1: 1.2e-3, 4: 1.6e-3, 8: 5.0e-3})  # stored on a busy afternoon
    target = Target(model)
    engine = Engine(target, drafter_for("ngram", model, target, random.Random(0), [], 0), budget=8, cost_store=costs)
    engine.policy.calibrate(engine.target, 5)
    assert (engine.policy.cost_model.verify_s[8] == pytest.approx(5.0e-3)
            and engine.policy.cost_model.shape == Built.verify_s)
    for _ in range(3):
        engine.policy.cost_model.refresh(1, 1.1e-3)
    assert (engine.policy.cost_model.verify_s[8] == pytest.approx(2.2e-3)
            and engine.policy.cost_model.verify_s[4] == pytest.approx(1.43e-3))


def test_compiler_falls_back_to_eager_with_one_warning(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CLOVER_COMPILE_CACHE", str(tmp_path))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    target = Target(model)
    warnings = []

    class FailingBuilder:
        def __init__(self, *args):
            pass

        def wait(self, timeout=600.0):
            pass

        def done(self):
            return True

        def error(self):
            return "compiling failed: RuntimeError: no luck"

    monkeypatch.setattr(manager, "Builder", FailingBuilder)
    comp = StepCompiler("on", target, llama_dir, torch.float32, torch.device("cpu"), warn=warnings.append)
    assert comp.state == "missing"
    comp.start(background=False)
    assert comp.state == "failed" and not comp.active and target.program is None
    assert warnings == ["no compiled step (compiling failed: RuntimeError: no luck); running eager"]
    assert comp.describe().startswith("eager (")
    # a model the compiled step cannot serve: one line with --compile on, nothing with auto
    warnings.clear()
    comp = StepCompiler("on", target, llama_dir, torch.float16, torch.device("cpu"), warn=warnings.append)
    assert comp.state == "eager" and len(warnings) == 1 and "float32" in warnings[0]
    warnings.clear()
    comp = StepCompiler("auto", target, llama_dir, torch.float16, torch.device("cpu"), warn=warnings.append)
    comp.start(background=True)
    assert comp.state == "eager" and warnings == []


def test_background_build_swaps_in_and_the_cli_reuses_it(llama_dir, tmp_path, monkeypatch, run_cli):
    """chat's path: the package is built by a child process while the session runs eager, then swapped in;
    `clover compile` and `clover generate` find it in the cache afterwards."""
    monkeypatch.setenv("CLOVER_COMPILE_CACHE", str(tmp_path / "cache"))
    # one program per package (the target's, the draft model's), for every step size: the swap, the cache and the CLI
    # are what this tests; the fixed-size programs are tested above
    monkeypatch.setenv("CLOVER_COMPILE_SIZES", "")
    from clover_cli.session import Options, Session

    s = Session(Options(model=str(llama_dir), draft="ngram", compile="auto"), quiet=True)
    assert s.compiler.state == "missing"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    s.compiler.start(background=True)
    assert s.compiler.state == "building" and s.target.program is None
    assert torch.get_num_threads() == 1  # replies meanwhile: one thread, not two waiting on the build's core
    prompt = s.encode_raw("The quick brown fox")
    eager_out = [t for ev in s.generate(prompt, 20, Sampling()) for t in ev.tokens]
    s.compiler.builder.wait(300)
    assert s.compiler.poll() and s.compiler.active and s.target.program is not None
    assert s.compiler.just_activated and torch.get_num_threads() == 2
    torch.set_num_threads(threads)
    compiled_out = [t for ev in s.generate(prompt, 20, Sampling()) for t in ev.tokens]
    assert compiled_out == eager_out == hf_greedy(s.model, prompt, 20, eos=sorted(s.eos_ids)[0])[:len(eager_out)]

    code, out, err = run_cli("compile", str(llama_dir))
    assert code == 0, err
    assert "already compiled" in out and "package: " in out and "verify forward: 1 token" in out
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("Hello! How can I help")
    results = {}
    for mode in ("auto", "off"):
        code, out, err = run_cli("generate", str(llama_dir), "-f", str(prompt_file), "-n", "16", "--json",
                                 "--compile", mode, "--stats-file", "off")
        assert code == 0, err
        results[mode] = json.loads(out)
    assert results["auto"]["compiled"] is True and results["off"]["compiled"] is False
    assert results["auto"]["text"] == results["off"]["text"]
    for r in results.values():
        assert r["tokens_per_s_e2e"] > 0 and r["decode_s"] >= 0 and r["load_s"] > 0
    # run as a program, `clover` leaves with os._exit, where no destructor runs: the loaded programs' unpacked
    # libraries (a directory each under TMPDIR, ~0.3 GB a process for the bundled model) must not stay behind
    import os
    import subprocess

    from helpers import clover_command

    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    p = subprocess.run([*clover_command(), "generate", str(llama_dir), "-f", str(prompt_file), "-n", "8",
                        "--json", "--compile", "on", "--stats-file", "off"], env=dict(os.environ, TMPDIR=str(tmpdir)),
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["compiled"] is True
    assert not list(tmpdir.glob("aotinductor_*")), sorted(tmpdir.iterdir())

    # --draft model: the draft model's own step is compiled too (after the target's); the output does not change
    from test_draft_model import small_draft

    draft = small_draft(tmp_path / "draft", llama_dir)
    runs = {}
    for mode in ("on", "off"):
        code, out, err = run_cli("generate", str(llama_dir), "-f", str(prompt_file), "-n", "16", "--json",
                                 "--compile", mode, "--draft", "model", "--draft-model", str(draft),
                                 "--stats-file", "off")
        assert code == 0, err
        runs[mode] = json.loads(out)
    assert runs["on"]["step"] == "compiled step active; draft model compiled", runs["on"]["step"]
    assert runs["off"]["step"].startswith("eager")
    assert runs["on"]["text"] == runs["off"]["text"] == results["off"]["text"]
    # `clover compile --draft-model` finds the package the session built: the same key
    code, out, err = run_cli("compile", str(llama_dir), "--draft-model", str(draft))
    assert code == 0, err
    assert "is already compiled" in out and "draft package: " in out, out

    # EAGLE heads have no compiled programs: they run eager beside the compiled step, and `clover compile` says so
    from clover_cli.drafters.registry import save_heads

    save_heads(random_heads(s.model, "eagle", 0, 4, 1), tmp_path / "eagle", "card\n")
    code, out, err = run_cli("compile", str(llama_dir), "--heads", str(tmp_path / "eagle"))
    assert code == 0 and "already compiled" in out and "EAGLE heads run eager" in err, err
    code, out, err = run_cli("generate", str(llama_dir), "-f", str(prompt_file), "-n", "16", "--json",
                             "--heads", str(tmp_path / "eagle"), "--compile", "auto", "--stats-file", "off")
    assert code == 0, err
    eagle = json.loads(out)
    assert eagle["compiled"] is True and eagle["draft"] == "eagle+ngram" and eagle["text"] == results["off"]["text"]


@pytest.mark.parametrize("args,env", [(["--compile", "sometimes"], {}), ([], {"CLOVER_COMPILE": "always"})])
def test_bad_compile_mode_is_one_line(llama_dir, tmp_path, monkeypatch, run_cli, args, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    p = tmp_path / "p.txt"
    p.write_text("hi")
    code, out, err = run_cli("generate", str(llama_dir), "-f", str(p), *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "must be auto, on or off" in err


@pytest.mark.parametrize("command", ["generate", "compile"])
def test_bad_compile_sizes_is_one_line(llama_dir, tmp_path, monkeypatch, run_cli, command):
    monkeypatch.setenv("CLOVER_COMPILE_SIZES", "1,two")
    monkeypatch.setenv("CLOVER_COMPILE_CACHE", str(tmp_path / "cache"))
    p = tmp_path / "p.txt"
    p.write_text("hi")
    extra = ["-f", str(p), "--compile", "auto"] if command == "generate" else []
    code, out, err = run_cli(command, str(llama_dir), *extra)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "CLOVER_COMPILE_SIZES must list step sizes" in err
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing built


def test_package_lookup_ignores_incomplete_builds(tmp_path):
    d = tmp_path / "pkg"
    d.mkdir()
    assert Package.find(d) is None  # no metadata
    ranges = {name: {"n": [1, 4], "past": [0, 3]} for name, *_ in aot_export.PROGRAMS}
    files = {name: {"bytes": 0, "crc32": 0} for name in ranges}  # what an empty file's are
    meta = {"program": store.PROGRAM_VERSION, "capacity": 8, "ranges": ranges, "files": files}
    (d / aot.META).write_text(json.dumps(meta))
    assert Package.find(d) is None  # no program files
    for name, *_ in aot_export.PROGRAMS[:-1]:
        (d / name).write_bytes(b"")
    assert Package.find(d) is None  # one missing
    (d / aot_export.PROGRAMS[-1][0]).write_bytes(b"")
    assert Package.find(d) is not None and aot.damage(d) is None
    (d / aot_export.PROGRAMS[0][0]).write_bytes(b"x")
    assert Package.find(d) is None  # a file of another size than it was built with
    assert "1 bytes, not 0" in aot.damage(d)
    (d / aot_export.PROGRAMS[0][0]).write_bytes(b"")
    (d / aot.META).write_text(json.dumps({**meta, "program": store.PROGRAM_VERSION - 1}))
    assert Package.find(d) is None  # built by an older clover


def test_static_sizes_route_small_steps_to_their_own_programs(monkeypatch):
    """A step runs the smallest fixed-size program that holds it, else the program for any size at a padded size,
    else at its own size where padding would not fit in the buffers; CLOVER_COMPILE_SIZES picks the fixed sizes."""
    from clover_cli.errors import CloverError

    monkeypatch.delenv("CLOVER_COMPILE_SIZES")
    assert contract.static_sizes() == contract.STATIC == (1, 2, 4, 8, 16)
    # each program holds a copy of the weights: a larger model gets fewer programs
    assert contract.static_sizes(36 << 20) == contract.STATIC
    assert contract.static_sizes(1 << 30) == contract.FEW_STATIC == (1, 4)
    for text, sizes in (("1,4", (1, 4)), (" 4, 1,4 ", (1, 4)), ("", ())):
        monkeypatch.setenv("CLOVER_COMPILE_SIZES", text)
        assert contract.static_sizes() == contract.static_sizes(1 << 30) == sizes  # what is asked for, any size
    for bad in ("0", "1,x", "81", "-1"):
        monkeypatch.setenv("CLOVER_COMPILE_SIZES", bad)
        with pytest.raises(CloverError, match="CLOVER_COMPILE_SIZES"):
            contract.static_sizes()
    names = [(name, lo, hi) for name, lo, hi, *_ in aot_export.program_table((1, 4))]
    assert names == [("step-1.pt2", 1, 1), ("step-4.pt2", 4, 4), ("step.pt2", 5, None)]
    assert [name for name, *_ in aot_export.program_table(())] == ["step.pt2"]

    step = CompiledStep.__new__(CompiledStep)
    step.capacity = 100
    one, four, more = object(), object(), object()
    step.programs = [(1, 1, 0, 98, one), (4, 4, 0, 95, four), (5, 99, 0, 94, more)]
    routes = {(n, past): step._route(n, past) for n, past in
              ((1, 0), (1, 98), (2, 10), (3, 10), (4, 95), (5, 10), (17, 10), (6, 93), (7, 93), (2, 96), (1, 99))}
    assert routes == {(1, 0): (1, one), (1, 98): (1, one), (2, 10): (4, four), (3, 10): (4, four),
                      (4, 95): (4, four), (5, 10): (8, more), (17, 10): (24, more),
                      (6, 93): (6, more),  # 8 rows would not fit after 93
                      (7, 93): None,  # past 93 + 7 tokens leave no room in 100
                      (2, 96): None, (1, 99): None}


def test_narrow_weights_are_chosen_only_where_exact_and_compute_the_linear(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8, bias=False))
    monkeypatch.setattr(aot_export, "NARROW_MIN_BYTES", 0)
    assert aot_export.narrow_dtype(model) is None  # float32 values
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.copy_(layer.weight.half().float())
    assert aot_export.narrow_dtype(model) == torch.float16
    size = 4 * (16 * 24 + 24 * 8)
    monkeypatch.setattr(aot_export, "NARROW_MIN_BYTES", size)  # weights that small stay cached: not narrowed
    assert aot_export.narrow_dtype(model) is None
    monkeypatch.setattr(aot_export, "NARROW_MIN_BYTES", size - 1)
    assert aot_export.narrow_dtype(model) == torch.float16
    assert aot_export.NARROW_MIN_BYTES > 0 and aot_export.last_level_cache_bytes() >= 1 << 20
    with torch.no_grad():  # bfloat16 values, and one float16 cannot hold (above its largest)
        for layer in (model[0], model[2]):
            layer.weight.copy_(layer.weight.bfloat16().float())
        assert aot_export.narrow_dtype(model) == torch.float16  # small bfloat16 values: float16 holds them too
        model[2].weight[0, 0] = 2.0 ** 20
    assert aot_export.narrow_dtype(model) == torch.bfloat16
    with torch.no_grad():
        model[0].weight[0, 0] = 1.0 + 2.0 ** -20  # neither holds it
    assert aot_export.narrow_dtype(model) is None
    assert aot_export.narrow_dtype(torch.nn.Sequential(torch.nn.ReLU())) is None
    with torch.no_grad():
        model[0].weight[0, 0] = 1.0
    x = torch.randn(3, 16)
    want = model(x)
    originals = [model[0], model[2]]
    with aot_export.narrow_linears(model, torch.bfloat16) as swapped:
        assert swapped == 2 and all(isinstance(model[i], aot_export.NarrowLinear) for i in (0, 2))
        assert model[0].weight.dtype == torch.bfloat16 and model[0].bias is originals[0].bias
        assert torch.allclose(model(x), want, rtol=1e-5, atol=1e-5)
    assert [model[0], model[2]] == originals  # put back, the very modules
    with pytest.raises(RuntimeError), aot_export.narrow_linears(model, torch.bfloat16):
        raise RuntimeError("a failed export")
    assert [model[0], model[2]] == originals


def test_build_timings_take_turns_between_sizes():
    """measure times every size once per round (a busy spell on the machine then slows all alike), warm-up first."""
    target = Target(make_model("llama", seed=0))
    target.forward(torch.tensor([5]))  # the cache's buffers

    class Step:
        capacity, calls = 512, []

        def _route(self, n, past):
            return (n, None) if n <= 8 else None

        def __call__(self, cache, tokens, positions, tree, rows):
            assert cache.length + tokens.numel() < self.capacity and tree.shape == (tokens.numel(),) * 2
            self.calls.append(tokens.numel())

    step = Step()
    out = aot_export.measure(step, target, repeats=3)
    assert step.calls == [1, 2, 4, 8] * 4
    assert sorted(out, key=int) == ["1", "2", "4", "8"] and all(0 < v < 1 for v in out.values())


def test_register_blocking_narrows_inductors_table_only_while_it_runs():
    import torch._inductor.compile_fx  # noqa: F401
    from torch._inductor.codegen import cpp_micro_gemm
    from torch._inductor.cpu_vec_isa import VecAVX512

    table = cpp_micro_gemm.micro_gemm_configs

    def fp32_avx512():
        return sorted(tuple(c.register_blocking)[:2] for configs in table.values() for c in configs
                      if c.vec_isa_cls is VecAVX512 and c.input_dtype == torch.float
                      and c.input2_dtype == torch.float)

    def everything():
        return {cls: list(configs) for cls, configs in table.items()}

    before, blockings = everything(), fp32_avx512()
    assert (16, 16) in blockings and len(set(blockings)) > 1  # what the programs choose among (torch 2.13)
    with aot_export.register_blocking((16, 16)):
        assert fp32_avx512() == [(16, 16)]
        # other instruction sets and types are left alone
        assert sum(map(len, table.values())) == sum(map(len, before.values())) - len(blockings) + 1
    assert everything() == before
    with pytest.raises(RuntimeError), aot_export.register_blocking((16, 16)):
        raise RuntimeError("a failed build")
    assert everything() == before
    with aot_export.register_blocking((3, 5)):  # a blocking inductor does not have: nothing changes
        assert everything() == before
    with aot_export.register_blocking(None):
        assert everything() == before


# kind -> (drafter, heads architecture); "clover-normed": Clover-2 heads that norm the hidden state first (their
# programs are Clover-2's, with the norm in the augmenting block's graph)
DRAFTERS = {"clover": (CloverDrafter, "clover2"), "clover-normed": (CloverDrafter, "clover2"),
            "medusa": (MedusaDrafter, "medusa")}


def program_kind(kind: str) -> str:
    """The heads programs' kind of a DRAFTERS kind ("clover" or "medusa")."""
    return kind.split("-")[0]


@pytest.fixture(scope="module")
def heads_programs(programs, tmp_path_factory):
    """kind -> (heads, programs directory, metadata): random heads of the llama model, their programs built."""
    model, _, capacity = programs["llama"]
    root = tmp_path_factory.mktemp("heads_programs")
    out = {}
    for kind, (cls, arch) in DRAFTERS.items():
        heads = random_heads(model, arch, seed=3, num_heads=4, num_layers=1, feature_norm=kind == "clover-normed")
        if kind == "clover":  # a draft-vocabulary shortlist, mapped back to token ids inside the program
            heads.draft_vocab = torch.randperm(96, generator=torch.Generator().manual_seed(0))[:40]
        meta = build_heads_for(cls(heads, Target(model)), capacity, root / kind, log=lambda text: None,
                               autotune=AUTOTUNE[program_kind(kind)])
        assert meta["kind"] == program_kind(kind) and meta["topk"] == 8 and meta["capacity"] == capacity
        out[kind] = (heads, root / kind, meta)
    return out


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("seed", range(3))
def test_compiled_heads_propose_what_eager_heads_propose(programs, heads_programs, kind, seed):
    """The heads' programs draft the same trees as their eager modules, and decoding with both compiled (the step
    and the heads) stays identical to transformers' greedy generate."""
    check_compiled_heads(programs, heads_programs[kind], kind, seed)


@pytest.fixture(scope="module")
def published_programs(programs, tmp_path_factory):
    """kind -> (heads, programs directory, metadata): Medusa heads in their published layout (two residual blocks and
    a vocabulary projection of its own per head: another graph than the native heads above). The Clover-2 authors'
    layout changes no graph, only what the programs freeze (the lm_head copy as the token table, RoPE base 10000, the
    file's norm epsilon), so its programs are those of the native heads above with other constants; its mapping is
    checked eager against the reference (tests/test_layouts.py). Not built again here: five programs, ~100 s."""
    from clover_cli.drafters.registry import load
    from test_layouts import medusa_authors_files

    model, _, capacity = programs["llama"]
    root = tmp_path_factory.mktemp("published")
    medusa_authors_files(root / "medusa", model, num_heads=4, n_blocks=2)
    heads = load(root / "medusa", model)
    # the layout's mapping is what is tested here, not the kernels: built without autotuning
    meta = build_heads_for(MedusaDrafter(heads, Target(model)), capacity, root / "medusa-programs",
                           log=lambda text: None, autotune=False)
    return {"medusa": (heads, root / "medusa-programs", meta)}


def test_compiled_published_medusa_heads_propose_what_eager_heads_propose(programs, published_programs):
    check_compiled_heads(programs, published_programs["medusa"], "medusa", seed=7)


def check_compiled_heads(programs, entry, kind, seed):
    rng = random.Random(seed)
    model, target = compiled_target(programs, "llama")
    heads, path, meta = entry
    cls = DRAFTERS[kind][0]
    eager, compiled_drafter = cls(heads, Target(model)), cls(heads, target)
    compiled_drafter.attach_programs(HeadsPrograms(path, program_kind(kind), meta["capacity"], meta["augment_ranges"]))
    for _ in range(3):
        prompt = [rng.randrange(3, 96) for _ in range(rng.randint(2, 25))]
        context = prompt + [rng.randrange(3, 96)]
        target.reset(0)
        with torch.inference_mode():
            hidden, _ = target.forward(torch.tensor(prompt))
        target.cache.append(len(prompt))
        for d in (eager, compiled_drafter):
            d.reset(0)
            d.observe(hidden, torch.tensor(context[1:]))
            d.curve = None  # the same scores on both sides: not the chances an earlier engine run taught one of them
        a, b = eager.propose(context, 24), compiled_drafter.propose(context, 24)
        assert (a.tokens, a.parents) == (b.tokens, b.parents) and len(a) > 1
        assert a.scores == pytest.approx(b.scores, rel=1e-3, abs=1e-6)
        target.reset(0)
        n = rng.randint(5, 40)
        reference = hf_greedy(model, prompt, n)
        engine = Engine(target, compiled_drafter, budget=rng.choice([4, 16, 40]), auto_budget=False)
        out, _ = run_engine(engine, prompt, StopCheck(n))
        assert out == reference


def eager_clover_and_programs(programs, heads_programs):
    """(model, an eager Clover drafter with its cache buffers at the programs' capacity, the heads' programs)."""
    model, _, _ = programs["llama"]
    heads, path, meta = heads_programs["clover"]
    drafter = CloverDrafter(heads, Target(model))
    drafter.cache.grow_to(meta["capacity"])
    drafter.observe(torch.zeros(1, model.config.hidden_size), torch.zeros(1, dtype=torch.long))
    drafter._catch_up()  # the heads' cache buffers
    programs_ = HeadsPrograms(path, "clover", meta["capacity"], meta["augment_ranges"])
    return model, drafter, programs_


def test_wrong_heads_programs_are_refused(programs, heads_programs, monkeypatch):
    _, drafter, programs_ = eager_clover_and_programs(programs, heads_programs)
    aot_export.check_heads(programs_, drafter)
    real = HeadsPrograms.augment
    monkeypatch.setattr(HeadsPrograms, "augment", lambda self, *args: real(self, *args) + 0.01)
    with pytest.raises(aot_export.CloverError, match="heads disagree"):
        aot_export.check_heads(programs_, drafter)


def test_few_rows_run_the_small_heads_programs(programs, heads_programs, monkeypatch):
    """A catch-up of up to SMALL_ROWS positions runs the fixed-size augment program of the smallest size >= n, a
    level of up to SMALL_ROWS nodes the autotuned small level program, more rows the programs for any size; each
    gives what the eager module gives."""
    model, drafter, programs_ = eager_clover_and_programs(programs, heads_programs)
    ran = []
    real = aot.Program.__call__
    monkeypatch.setattr(aot.Program, "__call__",
                        lambda self, *inputs: ran.append(self.name) or real(self, *inputs))
    H, g, small = model.config.hidden_size, torch.Generator().manual_seed(5), aot.SMALL_ROWS
    with torch.inference_mode():
        # the tests' CLOVER_COMPILE_SIZES=1,4: fixed-size augment programs for 1 and 4 positions (2 and 3 padded to 4)
        assert aot_export.augment_sizes() == (1, 4) and small == 4
        for n, want in ((1, "augment-1.pt2"), (2, "augment-4.pt2"), (small, "augment-4.pt2"),
                        (small + 1, "augment.pt2")):
            keys, values = drafter.cache.buffers()
            mine = type(drafter.cache).over([k.clone() for k in keys], [v.clone() for v in values], 10)
            drafter.cache.length = 10
            hidden, tokens = torch.randn(n, H, generator=g), torch.randint(0, 96, (n,), generator=g)
            ran.clear()
            got = programs_.augment(hidden, tokens, torch.arange(10, 10 + n), mine)
            assert ran == [want]
            assert torch.allclose(got, drafter.augment_block(hidden, tokens, torch.arange(10, 10 + n), drafter.cache),
                                  atol=1e-4)
        for rows, want in ((1, "level-small.pt2"), (small, "level-small.pt2"), (small + 1, "level.pt2")):
            states, tokens = torch.randn(rows, H, generator=g), torch.randint(0, 96, (rows,), generator=g)
            ran.clear()
            got, eager = programs_.levels[1](states, tokens), drafter.levels[1](states, tokens)
            assert ran == [want]
            assert all(torch.allclose(a.float(), b.float(), atol=1e-4) for a, b in zip(got, eager))


def test_a_fresh_drafter_catches_up_on_the_prompt_compiled(programs, heads_programs, monkeypatch):
    """attach_programs makes the heads' cache buffers, so the first catch-up (the prompt, the longest) runs the
    compiled program too, not the eager block."""
    from clover_cli.drafters.clover2 import CloverAugment

    model, target = compiled_target(programs, "llama")
    heads, path, meta = heads_programs["clover"]
    drafter = CloverDrafter(heads, target)
    drafter.attach_programs(HeadsPrograms(path, "clover", meta["capacity"], meta["augment_ranges"]))
    eager_runs = []
    real = CloverAugment.forward
    monkeypatch.setattr(CloverAugment, "forward", lambda self, *args: eager_runs.append(1) or real(self, *args))
    prompt = [(7 * i) % 90 + 3 for i in range(20)]
    target.reset(0)
    with torch.inference_mode():
        hidden, _ = target.forward(torch.tensor(prompt))
    target.cache.append(len(prompt))
    drafter.reset(0)
    drafter.observe(hidden, torch.tensor(prompt[1:] + [5]))
    assert len(drafter.propose(prompt + [5], 16)) > 1
    assert not eager_runs and drafter.cache.length == len(prompt)


def test_the_default_drafters_choice_is_kept_between_processes(llama_dir, tmp_path, monkeypatch):
    """What --draft auto learns about when a step pays for the heads is stored beside the step costs after each
    reply and restored by the next session of the same model, heads and step; a damaged file only starts the
    learning over."""
    import json

    from clover_cli.drafters.common import HeadsConfig
    from clover_cli.drafters.registry import build_heads, save_heads
    from clover_cli.decode.verify import Sampling
    from clover_cli.session import Options, Session
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("CLOVER_COMPILE_CACHE", str(tmp_path / "cache"))
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    torch.manual_seed(0)
    heads = build_heads(HeadsConfig.for_target(model.config, architecture="clover2", num_heads=3, num_layers=1), model)
    heads.init_from_target(model)
    save_heads(heads, tmp_path / "heads", "test heads")

    def session():
        return Session(Options(model=str(llama_dir), heads=str(tmp_path / "heads"), compile="off"), quiet=True)

    first = session()
    prompt = first.encode_raw("the cat sat on the mat. the cat sat on the mat. the dog")
    out_first = [t for ev in first.generate(prompt, 24, Sampling()) for t in ev.tokens]
    learned = first.drafter.choices.state()
    assert sum(learned["decisions"].values()) >= 2
    stored = first.engine.policy.cost_store.choices_path(first.heads_path)
    assert json.loads(stored.read_text()) == learned
    second = session()
    assert second.drafter.choices.state()["decisions"] == {}
    second._stored_choices()
    assert second.drafter.choices.state() == learned
    assert [t for ev in second.generate(prompt, 24, Sampling()) for t in ev.tokens] == out_first
    assert sum(second.drafter.choices.state()["decisions"].values()) > sum(learned["decisions"].values())
    assert json.loads(stored.read_text()) == second.drafter.choices.state()
    # other heads (files changed) are another file; a damaged file is ignored and written anew
    assert second.engine.policy.cost_store.choices_path(llama_dir) != stored
    stored.write_text('{"sums": {"alone/0": [1.0, ')
    third = session()
    assert [t for ev in third.generate(prompt, 24, Sampling()) for t in ev.tokens] == out_first
    assert json.loads(stored.read_text()) == third.drafter.choices.state()
    assert sum(third.drafter.choices.state()["decisions"].values()) < sum(learned["decisions"].values()) * 2
    # a reply under a repetition penalty learns (and keeps) a choice of its own: the unpenalised one is untouched
    unpenalised = third.drafter.choices
    before = json.loads(stored.read_text())
    list(third.generate(prompt, 24, Sampling(repetition_penalty=1.5)))
    penalised = third.engine.policy.cost_store.choices_path(third.heads_path, 1.5)
    assert penalised != stored and json.loads(stored.read_text()) == before
    assert json.loads(penalised.read_text()) == third.drafter.choices.state() and third.drafter.choices is not unpenalised
    assert sum(third.drafter.choices.state()["decisions"].values()) >= 1
    list(third.generate(prompt, 24, Sampling()))
    assert third.drafter.choices is unpenalised and json.loads(stored.read_text()) == unpenalised.state()
    # and a sampled reply likewise: a temperature's choice is its own
    before = json.loads(stored.read_text())
    list(third.generate(prompt, 24, Sampling(temperature=0.8, seed=1)))
    sampled = third.engine.policy.cost_store.choices_path(third.heads_path, 1.0, 0.8)
    assert sampled not in (stored, penalised) and json.loads(stored.read_text()) == before
    assert json.loads(sampled.read_text()) == third.drafter.choices.state() and third.drafter.choices is not unpenalised
    at_08 = third.drafter.choices
    list(third.generate(prompt, 24, Sampling(temperature=0.80000001, seed=1)))  # the same choice, to two decimals
    assert third.drafter.choices is at_08 and json.loads(sampled.read_text()) == at_08.state()
    list(third.generate(prompt, 24, Sampling()))
    assert third.drafter.choices is unpenalised


def test_clover_compile_builds_the_heads_programs_for_the_tree_rule_a_session_grows():
    """`clover compile` names (and makes) the heads' programs for the children per node their drafter expands: the
    config's tree rule (the shipped smollm2 heads: EAGLE-2's, 10), else the grower's default, as a session's drafter
    asks for them (registry.drafter_for)."""
    import json

    from clover_cli.aliases import PACKAGE_FILES
    from clover_cli.drafters.common import TreeGrower
    from clover_cli.step.ahead import heads_topk

    smollm2 = PACKAGE_FILES / "smollm2" / "heads"
    assert heads_topk(smollm2) == json.loads((smollm2 / "config.json").read_text())["tree"]["topk"] == 10
    assert heads_topk(PACKAGE_FILES / "tiny" / "heads") == TreeGrower().topk
