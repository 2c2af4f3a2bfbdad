"""Issue #14: the defects an adversarial audit found, one test each, and the guards that keep their kind away."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import build_model
from helpers import chats_file, offline, save_small_heads, train_in_process

ROOT = Path(__file__).resolve().parent.parent
CONVERSATIONS = [
    {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Tell me about the number {i}."},
        {"from": "gpt", "value": f"The number {i} comes after {i - 1} and before {i + 1}."},
    ]}
    for i in range(24)
]
TRAIN = ["--heads", "2", "--layers", "1", "--batch-tokens", "2048", "--max-len", "256", "--eval-every", "2"]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Stats and caches go to a private directory; the Hub is offline (no test may touch the network)."""
    monkeypatch.delenv("CLOVER_DEBUG", raising=False)
    return offline(tmp_path, monkeypatch)


def one_line_error(result, *needles, code=2, alone=True):
    """The command failed with one `clover: error:` line holding `needles`, last on stderr, and no traceback; with
    `alone`, nothing else on stderr (progress lines of a run that got under way are allowed otherwise)."""
    rc, out, err = result
    assert rc == code, result
    assert "Traceback" not in err, err
    lines = err.splitlines()
    errors = [line for line in lines if line.startswith("clover: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0] and (len(lines) == 1 or not alone), err
    for n in needles:
        assert n.lower() in errors[0].lower(), (n, errors[0])
    return errors[0]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return chats_file(tmp_path_factory, CONVERSATIONS)


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory, llama_dir, data_file):
    """A training run of 2 steps with its checkpoint (copied per test: tests change it)."""
    out = train_in_process(llama_dir, data_file, tmp_path_factory.mktemp("run") / "h", "--max-steps", "2", *TRAIN)
    assert (out / "checkpoint" / "optimizer.pt").is_file()
    return out


@pytest.fixture
def run_dir(checkpointed, tmp_path):
    out = tmp_path / "h"
    shutil.copytree(checkpointed, out)
    return out


def train(run_cli, model, data, out, *extra):
    return run_cli("train", str(model), "--data", str(data), "--out", str(out), *TRAIN, *extra)


# --- 1. train --resume must not run code from a checkpoint ------------------------------------------------------


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_resume_refuses_a_pickle_that_runs_code(run_cli, llama_dir, data_file, run_dir, tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"opt": _Payload(marker), "sched": {}}, run_dir / "checkpoint" / "optimizer.pt")
    one_line_error(train(run_cli, llama_dir, data_file, run_dir, "--max-steps", "4", "--resume"), "optimizer.pt",
                   "posix.system", alone=False)
    assert not marker.exists(), "the checkpoint ran code"


def test_resume_loads_a_real_optimizer_state(run_cli, llama_dir, data_file, run_dir):
    code, _, err = train(run_cli, llama_dir, data_file, run_dir, "--max-steps", "4", "--resume")
    assert code == 0, err
    assert "resumed from step 2" in err


def test_every_torch_load_goes_through_the_one_helper():
    """Nothing in the project unpickles with weights_only off, and torch.load is called in one place only."""
    unsafe = "weights_only=" + "False"  # spelled apart so that grep finds it nowhere in the project
    offenders = []
    for path in [*ROOT.glob("clover_cli/**/*.py"), *ROOT.glob("scripts/**/*.py"), *ROOT.glob("clover_kernels/**/*.py")]:
        text = path.read_text()
        rel = path.relative_to(ROOT).as_posix()
        if unsafe in text or ("torch.load(" in text and rel != "clover_cli/torchload.py"):
            offenders.append(rel)
    assert offenders == []


def test_torchload_reads_tensors_and_refuses_the_rest(tmp_path):
    from clover_cli import torchload
    from clover_cli.errors import CloverError

    good = tmp_path / "good.pt"
    torch.save({"t": torch.arange(3), "step": 4, "betas": (0.9, 0.95)}, good)
    assert torchload.load(good, "optimizer state")["step"] == 4
    (tmp_path / "cut.pt").write_bytes(good.read_bytes()[:60])
    (tmp_path / "garbage.pt").write_bytes(b"\x07" * 4096)
    marker = tmp_path / "pwned"
    torch.save({"opt": _Payload(marker)}, tmp_path / "evil.pt")
    for name, needle in [("cut.pt", "damaged"), ("garbage.pt", "not a torch.save file"), ("missing.pt", "missing"),
                         ("evil.pt", "refusing")]:
        with pytest.raises(CloverError, match=needle) as e:
            torchload.load(tmp_path / name, "optimizer state")
        message = str(e.value)
        assert "\n" not in message and "optimizer state" in message and str(tmp_path / name) in message, message
    assert not marker.exists(), "the pickle ran code"


def test_allow_pickle_model_weights_cannot_run_code(run_cli, tmp_path):
    """--allow-pickle reads a model's pickled .bin weights; a pickle there that would run code is refused in one
    line (transformers loads it with weights_only=True), while real tensors in a .bin still load."""
    from safetensors.torch import load_file

    good = build_model(tmp_path / "good", "llama", seed=1)
    state = load_file(str(good / "model.safetensors"))
    (good / "model.safetensors").unlink()
    torch.save(state, good / "pytorch_model.bin")
    evil = tmp_path / "evil"
    shutil.copytree(good, evil)
    marker = tmp_path / "pwned"
    torch.save({**state, "model.embed_tokens.weight": _Payload(marker)}, evil / "pytorch_model.bin")
    prompt = tmp_path / "p.txt"
    prompt.write_text("Hello")
    one_line_error(run_cli("generate", str(evil), "--allow-pickle", "-f", str(prompt), "-n", "2"), "refusing",
                   str(evil), "posix.system")
    assert not marker.exists(), "the model's weights ran code"
    code, out, err = run_cli("generate", str(good), "--allow-pickle", "-f", str(prompt), "-n", "2", "--draft", "none")
    assert code == 0, err


# --- 7. an option only --regenerate uses is checked only with --regenerate ---------------------------------------


def test_max_len_below_the_unused_regen_default_is_accepted(tmp_path):
    from clover_cli.errors import CloverError
    from clover_cli.train import TrainConfig, validate

    validate(TrainConfig(model="tiny", out=tmp_path / "o", max_len=256))  # --regen-max-tokens 256 is unused
    with pytest.raises(CloverError, match="--regen-max-tokens"):
        validate(TrainConfig(model="tiny", out=tmp_path / "o", max_len=256, regenerate=True))


# --- 2. the engine never asks the cache for room the context lacks ----------------------------------------------


@pytest.fixture(scope="module")
def short_dir(tmp_path_factory):
    """A tiny Llama with a context of 256 positions."""
    return build_model(tmp_path_factory.mktemp("short"), "llama", seed=4, max_position_embeddings=256)


@pytest.mark.parametrize("room", [1, 2, 5, 17, 40])
def test_calibration_and_drafting_stay_inside_the_context(short_dir, monkeypatch, room):
    """Auto budget, nothing stored: the first reply measures verify costs; with little room left it must measure
    (and draft) only what fits."""
    from transformers import AutoModelForCausalLM

    from clover_cli.drafters.ngram import NgramDrafter
    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import StopCheck
    from clover_cli.target import Target, TreeKVCache
    from helpers import run_engine

    asked = []
    reserve = TreeKVCache.reserve
    monkeypatch.setattr(TreeKVCache, "reserve", lambda self, n: (asked.append(self.length + n), reserve(self, n)))
    target = Target(AutoModelForCausalLM.from_pretrained(short_dir))
    stored = []
    store = type("Store", (), {"padded": False, "load": lambda self: None, "save": lambda self, t: stored.append(t),
                               "reference": lambda self: None})
    engine = Engine(target, NgramDrafter(), budget=64, auto_budget=True, cost_store=store())
    prompt = ([5, 6, 7, 8, 9] * 60)[:256 - room]  # a repeating prompt: lookup drafts deep chains
    out, _ = run_engine(engine, prompt, StopCheck(room))
    assert len(out) == room and max(asked) <= 256
    cost = engine.policy.cost_model
    assert cost is None or max(cost.verify_s) <= room  # one token of room: no step, no measuring
    assert stored == [], "a table cut short by the context must not stand for this device in later processes"


def test_generate_near_the_end_of_the_context_with_the_default_budget(run_cli, short_dir, tmp_path):
    prompt = tmp_path / "long.txt"
    prompt.write_text("The quick brown fox jumps over the lazy dog. " * 24)  # about 245 of the 256 tokens, raw
    code, out, err = run_cli("generate", str(short_dir), "-f", str(prompt), "--raw", "--draft", "ngram",
                             "-n", "8", "--json", "--stats-file", "off")
    assert code == 0, err
    result = json.loads(out)
    assert 230 < result["prompt_tokens"] < 256 and result["prompt_tokens"] + result["new_tokens"] <= 256


def test_chat_after_loading_a_long_conversation(run_cli, short_dir, tmp_path):
    """-n 16 keeps 16 of the 256 positions for the reply: a loaded conversation fills the rest (the oldest exchanges
    left out), and every message still gets its reply."""
    conv = tmp_path / "long.json"
    exchange = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."},
                {"role": "assistant", "content": "The quick brown fox jumps over the lazy dog."}]
    conv.write_text(json.dumps({"messages": exchange * 6}))
    code, out, err = run_cli("chat", str(short_dir), "-n", "16", "--draft", "ngram", "--stats-file", "off",
                             stdin=f"/load {conv}\nThe quick brown fox\nThe lazy dog\n")
    assert code == 0, err
    assert "error" not in err and err.count(" tokens · τ") == 2


# --- 3. a damaged model file ------------------------------------------------------------------------------------


@pytest.fixture
def model_copy(llama_dir, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(llama_dir, out)
    return out


@pytest.fixture
def prompt_file(tmp_path):
    p = tmp_path / "prompt.txt"
    p.write_text("Hello! What is the capital of France?")
    return p


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_damaged_model_weights(run_cli, model_copy, prompt_file, damage):
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncate": data[:len(data) // 2], "garbage": b"\x07" * 4096, "empty": b""}[damage])
    one_line_error(run_cli("generate", str(model_copy), "-f", str(prompt_file), "--stats-file", "off"),
                   "cannot load the model", "safetensors weights are damaged")


# --- 4. heads whose tensors or config are wrong -----------------------------------------------------------------


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory, llama_dir):
    return save_small_heads(llama_dir, tmp_path_factory.mktemp("heads") / "h", "test\n")


def _set_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _set_tensor(path, name, tensor):
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "model.safetensors"))
    state[name] = tensor
    save_file(state, str(path / "model.safetensors"))


HEADS_DAMAGE = {
    "head0 of the wrong shape": lambda p: _set_tensor(p, "head0.weight", torch.zeros(64, 32)),
    "num_heads a word": lambda p: _set_config(p, num_heads="five"),
    "num_heads a fraction": lambda p: _set_config(p, num_heads=2.5),
    "num_gate_heads that do not divide": lambda p: _set_config(p, num_gate_heads=3),
    "num_gate_heads zero": lambda p: _set_config(p, num_gate_heads=0),
    "num_layers negative": lambda p: _set_config(p, num_layers=-1),
    "rms_norm_eps a word": lambda p: _set_config(p, rms_norm_eps="tiny"),
    "target a list": lambda p: _set_config(p, target=[1, 2]),
    "config a list": lambda p: (p / "config.json").write_text("[1, 2]"),
    "tree a list": lambda p: _set_config(p, tree=[10, 10]),
    "tree with an unknown setting": lambda p: _set_config(p, tree={"depth": 3}),
    "tree's topk zero": lambda p: _set_config(p, tree={"topk": 0}),
    "tree's width a fraction": lambda p: _set_config(p, tree={"width": 2.5}),
    "tree's top_p a word": lambda p: _set_config(p, tree={"top_p": "all"}),
    "tree's min_ratio above 1": lambda p: _set_config(p, tree={"min_ratio": 1.5}),
}


@pytest.mark.parametrize("damage", list(HEADS_DAMAGE))
def test_heads_that_disagree_with_their_config(run_cli, llama_dir, heads_dir, prompt_file, tmp_path, damage):
    heads = tmp_path / "heads"
    shutil.copytree(heads_dir, heads)
    HEADS_DAMAGE[damage](heads)
    result = run_cli("generate", str(llama_dir), "-f", str(prompt_file), "--heads", str(heads), "--draft",
                     "clover", "--stats-file", "off", "-n", "8")
    assert result[1] == "", "nothing is printed before the heads are known to be good"
    one_line_error(result, str(heads))


def test_good_heads_still_load(run_cli, llama_dir, heads_dir, prompt_file):
    code, out, err = run_cli("generate", str(llama_dir), "-f", str(prompt_file), "--heads", str(heads_dir),
                             "--draft", "clover", "--stats-file", "off", "-n", "8", "--json")
    assert code == 0, err
    assert json.loads(out)["draft"] == "clover"


def test_heads_draft_with_their_configs_tree_rule(run_cli, llama_dir, heads_dir, prompt_file, tmp_path):
    """A config's `tree` is the drafter's tree rule (over its family's); the output stays plain decoding's."""
    from transformers import AutoModelForCausalLM

    from clover_cli.drafters.registry import drafter_for, load
    from clover_cli.target import Target

    heads = tmp_path / "heads"
    shutil.copytree(heads_dir, heads)
    _set_config(heads, tree={"topk": 3, "width": 2, "min_ratio": 0, "top_p": 1})
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    target = Target(model)
    grower = drafter_for(load(heads, model), target).grower
    assert (grower.topk, grower.width, grower.min_ratio, grower.top_p) == (3, 2, 0, 1)
    assert drafter_for(load(heads, model), target, topk=5).grower.topk == 5  # a caller's setting wins
    assert drafter_for(load(heads_dir, model), target).grower.topk == 8  # no tree: Clover-2's own rule
    outs = [run_cli("generate", str(llama_dir), "-f", str(prompt_file), "--draft", *draft, "--stats-file", "off",
                    "-n", "12", "--json") for draft in (["none"], ["clover", "--heads", str(heads)])]
    assert [code for code, _, _ in outs] == [0, 0], outs
    plain, drafted = (json.loads(out) for _, out, _ in outs)
    assert drafted["draft"] == "clover" and drafted["text"] == plain["text"]


# --- 5. a stats stream that cannot be read or written -----------------------------------------------------------


def _unreadable(path: Path, monkeypatch):
    """Make `path` unreadable to this process: mode 000, and (root reads anything) opening it refused as well."""
    import builtins
    import io

    path.chmod(0)
    real = builtins.open

    def guarded(file, *a, **k):
        if Path(os.fsdecode(file)) == path if isinstance(file, (str, bytes, os.PathLike)) else False:
            raise PermissionError(13, "Permission denied", str(path))
        return real(file, *a, **k)

    monkeypatch.setattr(builtins, "open", guarded)
    monkeypatch.setattr(io, "open", guarded)  # what pathlib opens with


@pytest.mark.parametrize("which", ["stream", "rotated part"])
def test_stats_on_an_unreadable_stream(run_cli, tmp_path, monkeypatch, which):
    f = tmp_path / "s.jsonl"
    f.write_text('{"kind": "session", "session": "abc", "command": "chat"}\n')
    (tmp_path / "s.jsonl.1").write_text("")
    _unreadable(f if which == "stream" else tmp_path / "s.jsonl.1", monkeypatch)
    for mode in (["--once"], ["--json"]):
        one_line_error(run_cli("stats", "--stats-file", str(f), *mode), "cannot read", "permission denied")


def test_a_session_that_cannot_write_its_stream_says_so(run_cli, llama_dir, prompt_file, tmp_path, monkeypatch):
    (tmp_path / "blocked").write_text("")  # the default cache directory cannot be made: a file is in the way
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "blocked"))
    code, out, err = run_cli("generate", str(llama_dir), "-f", str(prompt_file), "--draft", "none", "-n", "4",
                             "--json")
    assert code == 0, err
    assert err.count("\n") == 1 and err.startswith("clover: warning: cannot write the stats stream"), err
    json.loads(out)


def test_a_stream_that_fails_mid_session_is_reported_once(run_cli, llama_dir, prompt_file, tmp_path, monkeypatch):
    from clover_cli import stats

    real, calls = stats.StatsWriter._open, []

    def full(self):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real(self)

    monkeypatch.setattr(stats.StatsWriter, "_open", full)
    code, out, err = run_cli("generate", str(llama_dir), "-f", str(prompt_file), "--draft", "none", "-n", "6",
                             "--stats-file", str(tmp_path / "s.jsonl"))
    assert code == 0, err
    assert len(calls) > 3, "several records were attempted"
    warnings = [line for line in err.splitlines() if line.startswith("clover: warning:")]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], err
    calls.clear()  # a chat says it once, between replies
    code, out, err = run_cli("chat", str(llama_dir), "--draft", "none", "-n", "6", "--stats-file",
                             str(tmp_path / "s.jsonl"), stdin="Hello\nAgain\n")
    assert code == 0, err
    assert err.count("cannot write the stats stream") == 1 and err.count(" tokens · τ") == 2, err


# --- 6. a tiny positive temperature -----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-5])
def test_warp_is_a_distribution_at_any_temperature(temperature):
    from clover_cli.decode.verify import Sampling, warp

    logits = torch.tensor([[3.0, 1.0, 3.0 - 1e-3, -50.0]])
    for top_p in (1.0, 0.5):
        p = warp(logits, Sampling(temperature, top_p))
        assert torch.isfinite(p).all() and abs(float(p.sum()) - 1.0) < 1e-5
        assert int(p.argmax()) == 0


def test_tiny_temperature_samples_what_greedy_picks(run_cli, llama_dir, prompt_file):
    texts = {}
    for t in ("0", "1e-40"):
        code, out, err = run_cli("generate", str(llama_dir), "-f", str(prompt_file), "--temp", t, "--seed", "3",
                                 "--draft", "ngram", "-n", "24", "--json", "--stats-file", "off")
        assert code == 0, err
        texts[t] = json.loads(out)["text"]
    assert texts["1e-40"] == texts["0"]
    code, out, err = run_cli("chat", str(llama_dir), "-n", "8", "--stats-file", "off",
                             stdin="/temp 1e-40\nHello\nAgain\n")
    assert code == 0 and "error" not in err and err.count(" tokens · τ") == 2, err


# --- 8. more train inputs: unreadable data, a checkpoint made with other settings ----------------------------------


def test_unreadable_training_data(run_cli, llama_dir, data_file, tmp_path, monkeypatch):
    data = tmp_path / "chats.json"
    shutil.copy(data_file, data)
    _unreadable(data, monkeypatch)
    one_line_error(train(run_cli, llama_dir, data, tmp_path / "o", "--max-steps", "1"), str(data),
                   "permission denied")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("other, needle, recorded", [
    (["--layers", "2"], "--arch clover --heads 2 --layers 1", True), (["--arch", "medusa"], "--arch clover", True),
    (["--heads", "3"], "--heads 2", True),
    # a checkpoint that does not record its options (made before they were): refused when its tensors do not fit
    (["--layers", "2"], "does not fit these options", False), (["--arch", "medusa"], "does not fit", False)])
def test_resume_with_other_settings(run_cli, llama_dir, data_file, run_dir, other, needle, recorded):
    if not recorded:
        state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
        del state["settings"]
        (run_dir / "checkpoint" / "state.json").write_text(json.dumps(state))
    before = {p.name: p.read_bytes() for p in (run_dir / "checkpoint").iterdir()}
    one_line_error(train(run_cli, llama_dir, data_file, run_dir, "--max-steps", "4", "--resume", *other), needle,
                   alone=False)
    assert {p.name: p.read_bytes() for p in (run_dir / "checkpoint").iterdir()} == before, "the checkpoint is kept"


# --- 9. fitting a long conversation into the context is linear --------------------------------------------------


def _conversation(n_exchanges: int, seed: int = 0, system: str | None = "be brief"):
    import random

    from clover_cli.chat.conversation import Conversation

    rng = random.Random(seed)
    conv = Conversation(system)
    for i in range(n_exchanges):
        conv.messages += [{"role": "user", "content": "u" * rng.randint(1, 30)},
                          {"role": "assistant", "content": "a" * rng.randint(1, 30)}]
    conv.messages.append({"role": "user", "content": "last question"})
    return conv


def _counting_encode(seen: list):
    def encode(messages):
        seen.append(len(messages))
        return [0] * (sum(len(m["content"]) + 3 for m in messages) + 5)
    return encode


def test_fit_context_leaves_out_the_fewest_exchanges():
    """The window it finds is the one leaving out exchanges one at a time finds: the first (whole exchanges) whose
    rest fits."""
    from clover_cli.chat.conversation import fit_context

    for seed in range(30):
        for limit in (40, 90, 200, 400, 10_000):
            conv, seen = _conversation(12, seed), []
            encode = _counting_encode(seen)
            want = conv.window
            while len(encode(conv.for_model()[:1] + conv.messages[want:])) > limit and len(conv.messages) - want > 1:
                want += 2
            try:
                ids, dropped = fit_context(conv, encode, limit)
            except Exception:
                assert len(encode(conv.for_model()[:1] + conv.messages[-1:])) > limit  # the last message alone
                continue
            assert (conv.window, dropped, len(ids)) == (want, want, len(encode(conv.for_model())))


def test_fit_context_work_is_linear_in_the_conversation():
    from clover_cli.chat.conversation import fit_context

    for n in (500, 1000, 2000):
        conv, seen = _conversation(n // 2), []
        ids, dropped = fit_context(conv, _counting_encode(seen), limit=300)
        assert len(ids) <= 300 and dropped > n - 40
        assert sum(seen) <= 3 * n + 200, f"{n} messages: {len(seen)} encodes of {sum(seen)} messages in all"
        seen.clear()
        conv.messages += [{"role": "assistant", "content": "a" * 30}, {"role": "user", "content": "u" * 30}]
        fit_context(conv, _counting_encode(seen), limit=300)  # the next reply slides on from where the window is
        assert sum(seen) <= 200


# --- 10. output streams and prompt sources; the one error boundary ----------------------------------------------


CLOVER = [sys.executable, "-m", "clover_cli"]  # this checkout's clover, whichever one is installed
CHILD_ENV = {"CLOVER_COMPILE": "off", "PYTHONPATH": str(ROOT)}


def clover(*args, stdout=subprocess.PIPE, stdin=None, input=None, timeout=120):
    """Run clover in a child process (for real pipes and devices); returns the CompletedProcess."""
    return subprocess.run([*CLOVER, *map(str, args)], stdout=stdout, stderr=subprocess.PIPE, stdin=stdin,
                          input=input, env={**os.environ, **CHILD_ENV}, timeout=timeout, cwd=ROOT)


GEN = ("--draft", "none", "--stats-file", "off")


def test_a_reader_that_goes_away_ends_the_run_quietly(llama_dir, prompt_file):
    """`clover generate ... | head -1`: the pipe's reader is gone before the reply is written."""
    proc = subprocess.Popen([*CLOVER, "generate", str(llama_dir), "-f", str(prompt_file), "-n", "64", *GEN],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env={**os.environ, **CHILD_ENV})
    proc.stdout.close()  # the reader went away
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 0, err
    assert "Traceback" not in err and "Exception ignored" not in err and "error" not in err, err


def test_a_full_output_device_is_one_line(llama_dir, prompt_file):
    with open("/dev/full", "w") as full:
        for mode in ([], ["--json"]):
            r = clover("generate", llama_dir, "-f", prompt_file, "-n", "8", *GEN, *mode, stdout=full)
            err = r.stderr.decode()
            assert r.returncode == 1 and "Traceback" not in err and "Exception ignored" not in err, err
            assert err.count("\n") == 1 and err.startswith("clover: error:") and "No space left" in err, err


def test_prompts_from_pipes_and_devices(llama_dir, tmp_path, run_cli):
    """A FIFO, standard input as "-" and as /dev/stdin (a real pipe: a child process), and a missing file."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    feeder = subprocess.Popen(["sh", "-c", f"printf 'Hello there' > {fifo}"])
    code, out, err = run_cli("generate", str(llama_dir), "-f", str(fifo), "-n", "4", "--json", *GEN)
    feeder.wait(30)
    assert code == 0, err
    assert json.loads(out)["prompt_tokens"] > 3
    code, out, err = run_cli("generate", str(llama_dir), "-f", "-", "-n", "4", "--json", *GEN,
                             stdin="Hello there")
    assert code == 0, err
    assert json.loads(out)["prompt_tokens"] > 3
    r = clover("generate", llama_dir, "-f", "/dev/stdin", "-n", "4", "--json", *GEN, input=b"Hello there")
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["prompt_tokens"] > 3
    code, out, err = run_cli("generate", str(llama_dir), "-f", str(tmp_path / "nope.txt"), "-n", "4", *GEN)
    assert code == 2 and err.strip().endswith("prompt file not found: " + str(tmp_path / "nope.txt")), err


def test_an_unexpected_error_is_one_line_and_debug_shows_it(run_cli, llama_dir, prompt_file, monkeypatch):
    from clover_cli import session

    def broken(*a, **k):
        raise TypeError("something nobody expected\nwith a second line")

    monkeypatch.setattr(session.Session, "_drafter", broken)
    args = ("generate", str(llama_dir), "-f", str(prompt_file), *GEN)
    line = one_line_error(run_cli(*args), "TypeError", "something nobody expected", "--debug", code=1)
    assert "second line" not in line
    for debug_args, env in ((("--debug", *args), None), (args, "1")):
        if env:
            monkeypatch.setenv("CLOVER_DEBUG", env)
        code, out, err = run_cli(*debug_args)
        assert code == 1 and "Traceback" in err and "something nobody expected" in err
        assert err.rstrip().splitlines()[-1].startswith("clover: error:")


# --- 12. a prompt file's trailing newline -----------------------------------------------------------------------


def test_a_prompt_files_trailing_newline_is_not_part_of_the_prompt(run_cli, llama_dir, tmp_path):
    def run(text: str, *extra):
        p = tmp_path / "p.txt"
        p.write_bytes(text.encode())
        code, out, err = run_cli("generate", str(llama_dir), "-f", str(p), "-n", "12", "--json", *GEN, *extra)
        assert code == 0, err
        return json.loads(out)

    for raw in ([], ["--raw"]):
        typed = run("What is the capital of France?", *raw)
        for ending in ("\n", "\r\n"):
            assert _untimed(run("What is the capital of France?" + ending, *raw)) == _untimed(typed)
        kept = run("What is the capital of France?\n", "--keep-newline", *raw)
        assert kept["prompt_tokens"] > typed["prompt_tokens"]
    # only one newline goes: the rest is the prompt's
    assert run("Two lines\n\n")["prompt_tokens"] > run("Two lines\n")["prompt_tokens"]


def _untimed(result: dict) -> dict:
    return {k: v for k, v in result.items() if not (k.endswith("_s") or k.startswith("tokens_per_s"))}


# --- 11. smaller: bounded stats output, private history, --overwrite, piped chat status, atomic writes ----------


def test_stats_of_a_deep_step_prints_a_bounded_dashboard(run_cli, tmp_path, monkeypatch):
    """A step whose tree reached depth 4096 (the largest a record may say) printed a row per depth and per accepted
    length (~4,100 lines); the dashboard shows the first depths and lengths and sums up the rest."""
    monkeypatch.setenv("COLUMNS", "120")
    f = tmp_path / "stats.jsonl"
    rec = {"kind": "step", "session": "s", "t": 1.0, "model": "m", "draft": "ngram", "tokens": 4097,
           "accepted": 4096, "proposed": 4096, "depth": 4096, "elapsed_s": 0.5, "draft_s": 0.1, "verify_s": 0.4}
    small = {**rec, "tokens": 3, "accepted": 2, "proposed": 4, "depth": 3}
    f.write_text(json.dumps(small) + "\n" + json.dumps(rec) + "\n")
    code, out, err = run_cli("stats", "--stats-file", str(f), "--once")
    assert code == 0, err
    assert len(out.splitlines()) < 60, len(out.splitlines())
    assert "depth 1 " in out and "depth 4096" not in out and "depths 17–4096" in out
    assert "16+ accepted" in out  # the longer accepted lengths, counted together: both steps ...
    row = next(line for line in out.splitlines() if "16+ accepted" in line)
    assert row.rstrip(" │").endswith(" 1"), row  # ... but only the deep one accepted 16 or more
    code, out, err = run_cli("stats", "--stats-file", str(f), "--once", "--json")
    snap = json.loads(out)
    assert len(snap["hit_rate_by_depth"]) == 4096  # --json keeps every depth


def test_piped_chat_fails_when_no_message_got_a_reply(run_cli, llama_dir):
    """Every message failing (here: too long for the context) exited 0, so a script could not tell; one reply
    among failures is still a success."""
    too_long = "word " * 2000
    code, out, err = run_cli("chat", str(llama_dir), "-n", "4", "--stats-file", "off", stdin=f"{too_long}\n" * 2)
    assert code == 2, err
    assert err.count("error: the message is too long") == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == "clover: error: all 2 messages failed (see the errors above): no reply was given"
    code, out, err = run_cli("chat", str(llama_dir), "-n", "4", "--stats-file", "off", stdin=f"{too_long}\nHello\n")
    assert code == 0, err
    assert "error: the message is too long" in err and "clover: error" not in err
    code, out, err = run_cli("chat", str(llama_dir), "-n", "4", "--stats-file", "off", stdin="/help\n")
    assert code == 0, err  # no message at all: nothing failed


def _dead_pid() -> int:
    """The pid of a process that has ended."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_trained_heads_files_are_all_readable_by_all(checkpointed):
    """model.safetensors was 0600 (safetensors' own temporary file) while config.json was 0644."""
    for name in ("model.safetensors", "config.json", "README.md"):
        assert (checkpointed / name).stat().st_mode & 0o777 == 0o644, name


def test_heads_files_are_replaced_never_rewritten_in_place(heads_dir, llama_dir, tmp_path):
    """A reader holding the old config.json / README.md / weights (here: a hard link to each) keeps the old file
    whole: saving writes a new file and renames it over the old one. A lone surrogate in the model card cannot be
    written at all: the old card stays, and no temporary file is left."""
    from transformers import AutoModelForCausalLM

    from clover_cli.drafters.common import HeadsConfig

    from clover_cli.drafters.registry import build_heads, save_heads

    out = tmp_path / "h"
    shutil.copytree(heads_dir, out)
    names = ("model.safetensors", "config.json", "README.md")
    before = {n: (out / n).read_bytes() for n in names}
    for n in names:
        os.link(out / n, tmp_path / f"held-{n}")
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    heads = build_heads(HeadsConfig.for_target(model.config, num_heads=2, num_layers=1, name="other"), model)
    save_heads(heads, out, "another card\n")
    for n in names:
        assert (tmp_path / f"held-{n}").read_bytes() == before[n], n
    assert (out / "README.md").read_text() == "another card\n" and json.loads((out / "config.json").read_text())
    with pytest.raises(UnicodeEncodeError):
        save_heads(heads, out, "a card with a lone surrogate \ud800\n")
    assert (out / "README.md").read_text() == "another card\n"
    assert sorted(p.name for p in out.iterdir()) == sorted(names)


def test_the_regenerated_data_repair_is_atomic(tmp_path):
    """A row cut short by a crash is dropped from regenerated.jsonl by writing the good rows to a new file, not by
    truncating the old one in place (a crash while repairing lost every row)."""
    from clover_cli.train.data import _read_jsonl

    path = tmp_path / "regenerated.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"messages": [{"ro')
    os.link(path, tmp_path / "held")
    assert _read_jsonl(path) == rows
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in rows)
    assert (tmp_path / "held").read_text().endswith('{"messages": [{"ro')  # the old file was not cut in place
    assert path.stat().st_mode & 0o777 == 0o644


def test_what_a_crashed_writer_left_is_cleaned(heads_dir, llama_dir, tmp_path):
    """Temporary files and directories of a writer that died are removed by the next write of the same name; those
    of a live process stay (it may still rename them into place)."""
    from clover_cli.step import aot_export

    out = tmp_path / "h"
    shutil.copytree(heads_dir, out)
    dead, live = _dead_pid(), os.getppid()
    stale = [out / f".model.safetensors.clover-{dead}-k2x9_q.tmp", out / f".config.json.clover-{dead}-abc.tmp"]
    kept = out / f".README.md.clover-{live}-abc.tmp"
    for p in [*stale, kept]:
        p.write_bytes(b"half a file")
    stale_dir = tmp_path / f".pkg.clover-{dead}.tmp"
    (stale_dir / "inner").mkdir(parents=True)
    save_small_heads(llama_dir, out, "card\n")
    assert not any(p.exists() for p in stale) and kept.exists()
    with aot_export.building(tmp_path / "pkg") as tmp:
        (tmp / "whole.pt2").write_bytes(b"x")
    assert not stale_dir.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".pkg")) == []


WRITES = re.compile(r"""\bopen\((?:[^\n]*?,\s*)?(?:mode=)?["'][rbt]*[wax+][rwabxt+]*["']|\.write_(text|bytes)\(|\bsave_file\(|torch\.save\(|"""
                    r"""json\.dump\(|\.savefig\(|\.save_pretrained\(|\bO_CREAT\b|GGUFWriter\(|mkstemp\(|"""
                    r"""shutil\.copy\w*\(|np\.save\w*\(""")


def test_every_file_the_project_writes_goes_through_atomic():
    """A call that writes a file is allowed outside clover_cli/atomic.py only on a line that hands the writing to
    atomic (`atomic.write_with(path, lambda tmp: ...)`), writes the temporary path atomic gave (`tmp`, or `tmp_file` opened on it), or says why
    it cannot be atomic (`# not atomic: ...`: a lock, a log being streamed, a directory transformers writes)."""
    offenders = []
    for path in sorted([*ROOT.glob("clover_cli/**/*.py"), *ROOT.glob("scripts/**/*.py"),
                        *ROOT.glob("clover_kernels/**/*.py")]):
        if path.name == "atomic.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if WRITES.search(line) and not re.search(r"\batomic\.|\btmp(_\w+)?\b|# not atomic: \S", line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []


def test_atomic_writes_have_the_mode_asked_for_and_leave_nothing_on_failure(tmp_path):
    from clover_cli import atomic

    old = os.umask(0o077)
    try:
        atomic.write_text(tmp_path / "a.json", "{}")
        atomic.write_bytes(tmp_path / "b", b"x", mode=0o600)
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b").stat().st_mode & 0o777 == 0o600

    def half(tmp):
        tmp.write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic.write_with(tmp_path / "a.json", half)
    assert (tmp_path / "a.json").read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b"]
    # a file of another name that merely starts like this one's is not taken for its leftover
    other = tmp_path / f".a.json.5.clover-{_dead_pid()}-x.tmp"
    other.write_bytes(b"")
    atomic.write_text(tmp_path / "a.json", "{}")
    assert other.exists()


def test_resuming_from_checkpoint_old_keeps_it_until_the_new_one_is_in_place(run_cli, llama_dir, data_file,
                                                                             run_dir, monkeypatch):
    """A crash between moving `checkpoint` aside and moving the new one in leaves only `checkpoint-old`. Resuming
    from it, the next save deleted it before the new checkpoint was in place: a second crash there left none."""
    from clover_cli.train.output import _checkpoint_dir

    os.replace(run_dir / "checkpoint", run_dir / "checkpoint-old")
    replace = os.replace

    def crash_before_the_new_one_is_in_place(src, dst, *a, **k):
        if Path(src).name == "checkpoint-new":
            raise OSError(5, "Input/output error")
        return replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", crash_before_the_new_one_is_in_place)
    code, _, err = train(run_cli, llama_dir, data_file, run_dir, "--max-steps", "4", "--resume")
    assert code != 0 and "resumed from step 2" in err and "Traceback" not in err
    monkeypatch.setattr(os, "replace", replace)
    assert _checkpoint_dir(run_dir) == run_dir / "checkpoint-old"
    code, _, err = train(run_cli, llama_dir, data_file, run_dir, "--max-steps", "4", "--resume")
    assert code == 0 and "resumed from step 2" in err, err
    assert _checkpoint_dir(run_dir) == run_dir / "checkpoint" and not (run_dir / "checkpoint-old").exists()
    assert json.loads((run_dir / "checkpoint" / "state.json").read_text())["step"] == 4


def test_overwrite_refuses_a_directory_that_is_not_clovers(run_cli, llama_dir, data_file, tmp_path):
    """--overwrite on a directory of someone's own files (here a README.md and a config.json that are not a heads
    config) trained into it and replaced them; it replaces only what clover made."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "README.md").write_text("my notes\n")
    (mine / "config.json").write_text('{"my": "settings"}\n')
    one_line_error(train(run_cli, llama_dir, data_file, mine, "--max-steps", "1", "--overwrite"), str(mine),
                   "not a heads directory")
    assert sorted(p.name for p in mine.iterdir()) == ["README.md", "config.json"]
    assert (mine / "README.md").read_text() == "my notes\n"
    assert (mine / "config.json").read_text() == '{"my": "settings"}\n'


def test_a_history_file_keeps_its_mode_when_prompts_go_into_it(tmp_path):
    """An existing --history-file was chmodded to 0600 (issue #45: as root every file is "ours", and
    `--history-file /dev/null` locked other users out of /dev/null). Only a file clover creates is made private;
    an existing one keeps its mode while the prompts typed are appended to it."""
    from clover_cli.chat.repl import _history

    path = tmp_path / "history"
    path.write_text("\n# 2026-01-01 00:00:00\n+an old prompt\n")
    path.chmod(0o644)
    history, shown = _history(str(path))
    assert shown == path and path.stat().st_mode & 0o777 == 0o644
    history.store_string("a secret\nin two lines")
    assert path.stat().st_mode & 0o777 == 0o644
    assert list(history.load_history_strings()) == ["a secret\nin two lines", "an old prompt"]
    new = tmp_path / "new-history"
    history, _ = _history(str(new))
    history.store_string("private")
    assert new.stat().st_mode & 0o777 == 0o600


# --- the soak (scripts/soak.py): memory of a long chat stays flat ----------------------------------------------


def test_a_long_prompt_adds_no_new_kernel_row_counts():
    """oneDNN keeps a compiled kernel per row count it meets, in a cache that is never emptied: each new prompt
    length through a packed linear left ~0.2 MiB behind (a 200-turn chat grew by hundreds of MiB). Many rows go
    through in pieces of the row counts already kept, with the same result bit for bit."""
    from clover_cli import packed

    if not packed.supported():
        pytest.skip("this torch build has no oneDNN prepacked linear")
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64, bias=False))
    assert packed.pack_linears(mlp) == 2
    seen = []
    real = packed._linear
    try:
        packed._linear = lambda x, w, b: seen.append(x.numel() // x.shape[-1]) or real(x, w, b)
        for n in (7, 64, 65, 600, 1990, 5000):
            x = torch.randn(1, n, 64)
            with torch.inference_mode():
                with packed.packed_linears():
                    got = mlp(x)
                # the unsplit product, also without autograd: with a bias that requires grad the op takes another
                # kernel on some CPUs (AVX2: ~2e-7 apart), which is not what the packed path ever runs
                whole = real(real(x, mlp[0].packed, mlp[0].bias), mlp[1].packed, None)
            assert torch.equal(got, whole), n
    finally:
        packed._linear = real
    assert set(seen) <= {*packed.PIECE_ROWS, *range(1, packed.WARM_ROWS + 1)}, sorted(set(seen))


def test_each_reply_gives_freed_memory_back(run_cli, llama_dir, monkeypatch):
    """The C allocator kept what a reply freed (a 200-turn chat's RSS grew by a third); after each reply that got as
    far as generating (one that fails there too), clover hands it back (malloc_trim on glibc)."""
    from clover_cli import reply

    calls = []
    monkeypatch.setattr(reply, "_malloc_trim", lambda pad: calls.append(pad) or 1)
    code, _, err = run_cli("chat", str(llama_dir), "-n", "4", "--stats-file", "off",
                           stdin="Hello\n" + "word " * 2000 + "\nHow are you?\n")
    assert code == 0, err
    assert calls == [0, 0], calls  # two replies (the message that was too long never got to generate)


def test_the_checkout_puts_no_kernels_package_on_the_import_path():
    """bitsandbytes (and transformers from 5.25) import a top-level `kernels` package when one is found: a checkout
    folder of that name, on the import path whenever Python runs from the checkout (`python -m pytest`, `python -m
    clover_cli`), was imported in its place and broke --load-in-8bit. clover's kernels are clover_kernels/."""
    # a namespace package (origin None: a folder of leftover bytecode) has nothing to import and is left out
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s and s.origin else '')"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    found = p.stdout.strip()
    assert not found or not Path(found).resolve().is_relative_to(ROOT.resolve()), found
