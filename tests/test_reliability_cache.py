"""Issue #45: the compile cache and the child processes, hardened. The background build imports nothing from the
working directory; every cache clover reads (compiled packages, step-cost tables, learned choices, learned early
stops, self-draft choices) is untrusted and disposable: checked on load, rebuilt or ignored with one line, never
fatal; a cache that cannot be written runs eager with one warning; two builders build once; SIGTERM and SIGHUP
clean up as Ctrl-C does (nothing of clover's left in TMPDIR).

The tests that need a compiled package share one, built once for the file (`built`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import clover_command, offline

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Stats and caches go to a private directory; the Hub is offline (no test may touch the network)."""
    monkeypatch.setenv("CLOVER_COMPILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CLOVER_COMPILE_SIZES", "")  # one program a package: the shortest build
    monkeypatch.delenv("CLOVER_DEBUG", raising=False)
    return offline(tmp_path, monkeypatch)


def package_of(model_dir: Path) -> Path:
    """Where the package of `model_dir`'s step is kept under the current CLOVER_COMPILE_CACHE (as `clover compile`
    keys it)."""
    from transformers import AutoConfig

    from clover_cli.step import capacity_for
    from clover_cli.store import package_dir
    from clover_cli.target import context_limit

    return package_dir(Path(model_dir), torch.float32, capacity_for(context_limit(AutoConfig.from_pretrained(
        model_dir))))


def clover_lines(err: str, *needles: str) -> list[str]:
    """The lines of `err` that hold every one of `needles` (case-insensitive)."""
    return [line for line in err.splitlines() if all(n.lower() in line.lower() for n in needles)]


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    p = tmp_path / "prompt.txt"
    p.write_text("Hello! How can I help")
    return p


# --- 3. the background build is started isolated from the working directory ------------------------------------


def test_the_background_build_runs_no_code_from_the_working_directory(tmp_path, monkeypatch):
    """A folder holding a `clover_cli` package of its own: starting a build there must not import it (the child
    runs clover's own code, found where the parent found it: an editable install here)."""
    from clover_cli.step import aot_build

    evil = tmp_path / "evil"
    (evil / "clover_cli").mkdir(parents=True)
    marker = tmp_path / "pwned"
    (evil / "clover_cli" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (evil / "clover_cli" / "step").mkdir()
    (evil / "clover_cli" / "step" / "aot_build.py").write_text("raise SystemExit(3)\n")
    monkeypatch.chdir(evil)
    (evil / "model").mkdir()  # a relative model path: the child, started elsewhere, must still find it
    job = aot_build.Job(Path("model"), tmp_path / "cache" / "pkg", 64)
    builder = aot_build.Builder(job)
    builder.wait(180)
    assert builder.done()
    assert not marker.exists(), "the build imported code from the working directory"
    assert all(Path(arg).is_absolute() for arg in (job.argv()[0], job.argv()[job.argv().index("--out") + 1]))
    reason = builder.error()
    # clover's own one-line reason for a directory holding no model, not a crash of a foreign module
    assert "ModuleNotFoundError" not in reason and "Traceback" not in reason, reason
    assert str(evil / "model") in reason, reason


def test_every_child_clover_starts_is_isolated():
    """Every subprocess in clover_cli that runs Python runs it isolated (-I) from a fixed directory."""
    offenders = []
    for path in ROOT.glob("clover_cli/**/*.py"):
        text = path.read_text()
        if "sys.executable" in text and ("Popen(" in text or "subprocess.run(" in text):
            if "child_command(" not in text:
                offenders.append(path.name)
    assert not offenders, offenders


# --- 4. a compile cache that cannot be written: eager, with one warning ----------------------------------------


def unwritable(tmp_path, monkeypatch, how: str, model_dir: Path):
    if how == "xdg-file":  # XDG_CACHE_HOME names a file: nothing under it can be made
        (tmp_path / "xdg-file").write_text("")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-file"))
        monkeypatch.delenv("CLOVER_COMPILE_CACHE")
    elif how == "cache-under-file":
        (tmp_path / "plain").write_text("")
        monkeypatch.setenv("CLOVER_COMPILE_CACHE", str(tmp_path / "plain" / "compiled"))
    else:  # the build's log or lock cannot be opened (a directory stands where it goes)
        out = package_of(model_dir)
        Path(f"{out}.{how}").mkdir(parents=True)


@pytest.mark.parametrize("how", ["xdg-file", "cache-under-file", "log", "lock"])
def test_chat_with_an_unwritable_compile_cache_runs_eager_with_one_warning(llama_dir, tmp_path, monkeypatch,
                                                                          run_cli, how):
    unwritable(tmp_path, monkeypatch, how, llama_dir)
    monkeypatch.setenv("CLOVER_COMPILE", "auto")
    code, out, err = run_cli("chat", str(llama_dir), "--draft", "ngram", "-n", "8", "--stats-file", "off",
                             stdin="Hello!\n")
    assert code == 0, err
    assert out.strip(), "no reply"
    assert "error" not in err.lower(), err
    # one warning (the banner's line on the step says why it is eager too)
    assert len(clover_lines(err, "compile cache", "running eager")) == 1, err
    assert len([line for line in err.splitlines() if line.startswith(("clover: ", "("))]) == 1, err


def test_generate_and_serve_with_an_unwritable_compile_cache_run_eager(llama_dir, tmp_path, monkeypatch, run_cli,
                                                                       prompt_file, capsys):
    unwritable(tmp_path, monkeypatch, "cache-under-file", llama_dir)
    code, out, err = run_cli("generate", str(llama_dir), "-f", str(prompt_file), "-n", "8", "--compile", "on",
                             "--json", "--stats-file", "off")
    assert code == 0, err
    assert json.loads(out)["compiled"] is False
    # what `clover serve` does before it listens (as chat does): the session, then the background build
    from clover_cli.session import Options, Session

    s = Session(Options(model=str(llama_dir), draft="ngram", compile="auto"))
    s.compiler.start(background=True)
    assert s.compiler.builder is None and not s.compiler.active
    err = capsys.readouterr().err
    assert len(clover_lines(err, "compile cache", "eager")) == 1, err


# --- 12. damaged packages and cache files -----------------------------------------------------------------------


def fake_package(d: Path, meta) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "step.pt2").write_bytes(b"PK\x03\x04 not really a package")
    (d / "meta.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    return d


def good_meta(capacity=512):
    from clover_cli import store

    return {"program": store.PROGRAM_VERSION, "capacity": capacity,
            "ranges": {"step.pt2": {"n": [1, capacity - 1], "past": [0, capacity - 2]}}, "verify_s": {"1": 0.001}}


def damaged_metas():
    base = good_meta()
    yield "capacity-not-a-number", {**base, "capacity": "x"}
    yield "capacity-a-list", {**base, "capacity": [512]}
    yield "ranges-a-list", {**base, "ranges": ["step.pt2"]}
    yield "ranges-outside-the-package", {**base, "ranges": {"../../outside.pt2": base["ranges"]["step.pt2"]}}
    yield "range-not-numbers", {**base, "ranges": {"step.pt2": {"n": ["a", "b"], "past": [0, 1]}}}
    yield "costs-not-numbers", {**base, "verify_s": {"1": "fast"}}
    yield "costs-a-list", {**base, "verify_s": [1]}
    yield "not-json", "{\"program\": "
    yield "a-list", "[1, 2]"
    yield "deeply-nested", "[" * 100000 + "]" * 100000
    yield "not-utf8", b"\xff\xfe\x00".decode("latin-1")


@pytest.mark.parametrize("name,meta", list(damaged_metas()), ids=[n for n, _ in damaged_metas()])
def test_a_damaged_package_meta_is_found_damaged_never_raises(tmp_path, name, meta):
    from clover_cli.step import aot

    d = fake_package(tmp_path / "pkg", meta)
    assert aot.Package.find(d) is None
    why = aot.damage(d)
    assert why and "\n" not in why, why
    heads = fake_package(tmp_path / "heads", meta)
    assert aot.find_heads(heads) is None
    assert aot.heads_damage(heads)


@pytest.mark.parametrize("meta", [json.dumps({**good_meta(), "capacity": "x"}), "{not json"],
                         ids=["capacity-x", "not-json"])
def test_generate_discards_a_damaged_package_with_one_line(llama_dir, run_cli, prompt_file, meta):
    d = fake_package(package_of(llama_dir), meta)
    code, out, err = run_cli("generate", str(llama_dir), "-f", str(prompt_file), "-n", "8", "--compile",
                             "auto", "--stats-file", "off")
    assert code == 0, err
    assert len(clover_lines(err, "damaged")) == 1, err
    assert "error" not in err.lower(), err
    assert not d.exists(), "the damaged package was kept"


def test_the_background_build_rebuilds_a_damaged_package(llama_dir, monkeypatch):
    """chat's path: a damaged package is discarded and built again in the background."""
    from clover_cli.step import manager
    from clover_cli.session import Options, Session

    d = fake_package(package_of(llama_dir), {**good_meta(), "ranges": 7})
    started = []

    class Recording:
        def __init__(self, job, *args, **kwargs):
            started.append(job)
            self.other = False

        def done(self):
            return False

    monkeypatch.setattr(manager, "Builder", Recording)
    s = Session(Options(model=str(llama_dir), draft="ngram", compile="auto"), quiet=True)
    assert not d.exists() and s.compiler.state == "missing"
    s.compiler.start(background=True)
    assert [job.out for job in started] == [d] and s.compiler.state == "building"


GARBAGE = ["", "\xff", "null", "[]", "7", "\"text\"", "{\"1\": [1]}", "{\"1\": \"x\"}", "{\"x\": 1}",
           "{\"1\": NaN}", "{\"1\": -1}", "{\"1\": Infinity}", "{\"1\": 1" + "0" * 400 + "}",
           "[" * 100000 + "]" * 100000, "{\"version\": 1, \"sums\": {\"alone/1\": [1, 1e999]}}",
           "{\"decisions\": {\"1\": 1" + "0" * 400 + "}}", "{\"skip\": [1, 2], \"layers\": \"8\"}",
           "{\"skip\": [\"x\"], \"layers\": 8}",
           "{\"features\": 5, \"w\": null, \"x\": [], \"y\": [], \"recent\": 0.5}"]


def test_cache_files_tolerate_any_garbage(tmp_path, capsys):
    """Step-cost tables, the default drafter's learned choice, the learned early stop and --draft self's choice:
    garbage in any of them (valid JSON of the wrong shape included) is ignored, with one line at most."""
    from clover_cli.step.costs import StepCosts
    from clover_cli.drafters.merged import ChoiceStats
    from clover_cli.drafters.early_stop import EarlyStop
    from clover_cli.drafters.self_draft import load_choice

    for i, text in enumerate(GARBAGE):
        costs = StepCosts(tmp_path / f"model{i}", torch.device("cpu"), torch.float32, None)
        path = costs._path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        table = costs.load()
        assert table is None or (all(isinstance(k, int) and k > 0 for k in table)
                                 and all(0 < v < float("inf") for v in table.values())), (text[:40], table)
        choices = ChoiceStats()
        before = choices.state()
        StepCosts.load_choices(choices, path)
        assert choices.state() == before, text[:40]
        stop = EarlyStop()
        assert stop.load(path) is False and stop.w is None, text[:40]
        assert load_choice(path, 8) is None, text[:40]
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert len(err.splitlines()) <= 1 and all(line.startswith("clover: ") for line in err.splitlines()), err


def test_a_damaged_cached_gguf_is_written_again(llama_dir, tmp_path, capsys):
    """The GGUF clover bench converts a model to for llama.cpp: a cached one cut short is written again, with one
    line, instead of failing llama.cpp's load on every run."""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clover_cli import llamacpp
    from clover_cli.hub import ResolvedModel

    model, tok = AutoModelForCausalLM.from_pretrained(llama_dir), AutoTokenizer.from_pretrained(llama_dir)
    resolved = ResolvedModel(name="some/model", path=llama_dir, spec=None)
    path = llamacpp.gguf_for(resolved, model, tok, tmp_path, quiet=True)
    whole = path.read_bytes()
    path.write_bytes(whole[:len(whole) // 2])
    assert llamacpp.gguf_for(resolved, model, tok, tmp_path, quiet=True) == path
    assert path.read_bytes() == whole
    err = capsys.readouterr().err
    assert len(clover_lines(err, "damaged", "writing it again")) == 1, err


# --- 17. the first run of a dtype with no compiled step -----------------------------------------------------------


def test_the_first_calibration_of_a_slow_step_is_bounded(llama_dir, monkeypatch):
    """Without stored step costs (the first run of float16 or bfloat16 on a CPU: no compiled step, whose build
    measured them), the engine times its own forwards: 5 of each of 8 tree sizes. However slow a forward is (a
    narrow type without the CPU's products for it, a busy machine: ~20 s here), that takes about CALIBRATE_S; the
    sizes it did not reach follow the ones it did, and all are stored (their costs refreshed as they run)."""
    from transformers import AutoModelForCausalLM

    from clover_cli.step.costs import StepCosts
    from clover_cli.decode import budget, engine
    from clover_cli.drafters.ngram import NgramDrafter
    from clover_cli.target import Target

    clock = {"t": 0.0}

    class Clock:  # a forward takes 0.25 s of it
        @staticmethod
        def perf_counter():
            return clock["t"]

    target = Target(AutoModelForCausalLM.from_pretrained(llama_dir).eval())
    real, forwards = target.forward, []

    def slow(*args, **kwargs):
        forwards.append(1)
        clock["t"] += 0.25
        return real(*args, **kwargs)

    target.forward = slow
    monkeypatch.setattr(budget, "time", Clock)
    costs = StepCosts(llama_dir, torch.device("cpu"), torch.float16, None)
    e = engine.Engine(target, NgramDrafter(), budget=64, cost_store=costs)
    e.policy.calibrate(e.target, 5)
    assert len(forwards) <= 8, len(forwards)
    assert sorted(e.policy.cost_model.verify_s) == [1, 2, 4, 8, 16, 32, 64, 65]
    assert costs.load() == e.policy.cost_model.verify_s


# --- 13. two builders at once -----------------------------------------------------------------------------------


def test_a_build_under_way_elsewhere_is_said_in_one_line(llama_dir, monkeypatch, capsys):
    """Another process holds the build lock (its lock file still empty: just created): this session says so in one
    line and runs eager meanwhile, waiting for that build instead of starting its own or taking the lock."""
    from filelock import FileLock

    from clover_cli.session import Options, Session

    out = package_of(llama_dir)
    out.parent.mkdir(parents=True)
    held = FileLock(f"{out}.lock")
    ready, release = threading.Event(), threading.Event()

    def hold():  # another thread stands for the other process: flock locks are per open file
        with held:
            ready.set()
            release.wait(60)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        ready.wait(10)
        s = Session(Options(model=str(llama_dir), draft="ngram", compile="auto"))
        s.compiler.start(background=True)
        assert s.compiler.state == "building" and s.compiler.builder.proc is None
        assert Path(f"{out}.lock").exists()  # not taken for stale and replaced
        err = capsys.readouterr().err
        assert len(clover_lines(err, "another process", "eager")) == 1, err
    finally:
        release.set()
        thread.join()
    s.compiler.builder.wait(10)
    assert s.compiler.builder.done()
    assert not s.compiler.poll() and not s.compiler.active  # that build made no package: eager, with one line


# --- slow: with a compiled package ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(llama_dir, tmp_path_factory):
    """The package of llama_dir's step (one program for every size), built once for the file by `clover compile`."""
    root = tmp_path_factory.mktemp("built")
    env = {**os.environ, "CLOVER_COMPILE_CACHE": str(root), "CLOVER_COMPILE_SIZES": "", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([*clover_command(), "compile", str(llama_dir), "--no-heads"], env=env, capture_output=True,
                       text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CLOVER_COMPILE_CACHE", str(root))
        mp.setenv("CLOVER_COMPILE_SIZES", "")
        out = package_of(llama_dir)
    assert (out / "meta.json").is_file()
    return out


def install(built: Path, llama_dir) -> Path:
    """A copy of the built package where this test's cache keeps it."""
    out = package_of(llama_dir)
    shutil.copytree(built, out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "bytes-changed"])
def test_a_damaged_program_is_discarded_and_rebuilt(built, llama_dir, run_cli, prompt_file, monkeypatch, damage):
    from clover_cli.step import aot_build

    out = install(built, llama_dir)
    program = out / "step.pt2"
    data = bytearray(program.read_bytes())
    if damage == "truncated":
        data = data[:len(data) // 2]
    else:
        middle = len(data) // 2
        data[middle:middle + 64] = bytes(64)
    program.write_bytes(bytes(data))
    # `clover compile` builds it again instead of saying "already compiled"
    builds = []

    def rebuild(job, log=print, **kwargs):
        builds.append(job.out)
        shutil.rmtree(job.out, ignore_errors=True)
        shutil.copytree(built, job.out)
        return {"step": {}}

    monkeypatch.setattr(aot_build, "build_locked", rebuild)
    code, stdout, err = run_cli("compile", str(llama_dir), "--no-heads")
    assert code == 0, err
    assert builds == [out] and "already compiled" not in stdout, stdout
    assert len(clover_lines(err, "damaged")) == 1, err
    # a session finds it damaged: one line, discarded, eager (chat would build it again)
    program.write_bytes(bytes(data))
    code, stdout, err = run_cli("generate", str(llama_dir), "-f", str(prompt_file), "-n", "8", "--compile",
                                "auto", "--json", "--stats-file", "off")
    assert code == 0, err
    assert json.loads(stdout)["compiled"] is False
    assert not out.exists(), "the damaged package was kept"


@pytest.mark.slow
def test_two_builders_started_together_build_once(llama_dir, tmp_path):
    """Two `clover compile` at once: one builds, the other waits for it; both succeed."""
    env = {**os.environ}
    procs = [subprocess.Popen([*clover_command(), "compile", str(llama_dir), "--no-heads"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
             for _ in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert "package: " in out, out
    exports = sum(err.count("exporting the step") for _, err in results)
    assert exports == 1, results


def signalled(command: list[str], ready: str | None, sig: int, tmpdir: Path, env: dict, **popen):
    """Start `command` with its own TMPDIR; once it is ready (a line of standard error holding `ready`, or its
    first compiled program unpacked), send `sig`; its exit status and standard error."""
    proc = subprocess.Popen(command, env={**env, "TMPDIR": str(tmpdir)}, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, **popen)
    lines = []
    try:
        if ready is not None:
            while True:
                line = proc.stderr.readline()
                assert line, "".join(lines)
                lines.append(line)
                if ready in line:
                    break
        else:  # generate: stopped as soon as it has unpacked a program (it is mid-load or mid-reply then)
            deadline = time.monotonic() + 120
            while not list(tmpdir.glob("aotinductor_*")) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            proc.send_signal(signal.SIGSTOP)
            assert proc.poll() is None, "it ended before the signal"
        assert list(tmpdir.glob("aotinductor_*")), "no compiled program was loaded"
        proc.send_signal(sig)
        if ready is None:
            proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(lines) + err


@pytest.mark.slow
@pytest.mark.parametrize("command,sig", [("generate", signal.SIGTERM), ("chat", signal.SIGHUP),
                                         ("serve", signal.SIGTERM), ("serve", signal.SIGHUP)])
def test_sigterm_and_sighup_leave_nothing_in_tmpdir(built, llama_dir, tmp_path, prompt_file, command, sig):
    install(built, llama_dir)
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = {**os.environ, "CLOVER_COMPILE": "auto"}
    base = [*clover_command(), command, str(llama_dir), "--draft", "ngram", "--stats-file", "off"]
    if command == "generate":
        code, err = signalled([*base, "-f", str(prompt_file), "-n", "400"], None, sig, tmpdir, env)
    elif command == "chat":
        code, err = signalled(base, "compiled step active", sig, tmpdir, env, stdin=subprocess.PIPE)
    else:
        code, err = signalled([*base, "--port", "0"], "OpenAI API at", sig, tmpdir, env)
    assert code == 128 + sig, err
    assert "Traceback" not in err, err
    left = sorted(p.name for p in tmpdir.iterdir())
    assert not [name for name in left if name.startswith("aotinductor_")], left
