"""Issue #14: every command, given a corrupt input of each kind it reads, fails the same way: a non-zero exit status,
exactly one line on standard error, and no traceback.

The inputs: a model directory (damaged, garbage or empty weights, a config.json that is not JSON, not UTF-8, missing,
a directory or unreadable, a damaged tokenizer, the directory itself missing), draft heads (damaged weights, a bad
config), a prompt file, training data, bench prompts, a stats stream and a training checkpoint (each: not UTF-8,
not what it should hold, missing, a directory, unreadable). Everything runs in-process on the tiny test model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import offline, save_small_heads, train_in_process


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Stats and caches go to a private directory; the Hub is offline; no compiled step is built."""
    offline(tmp_path, monkeypatch)
    monkeypatch.delenv("CLOVER_DEBUG", raising=False)
    monkeypatch.setenv("CLOVER_COMPILE", "off")


@pytest.fixture(scope="module")
def heads_src(tmp_path_factory, llama_dir):
    return save_small_heads(llama_dir, tmp_path_factory.mktemp("heads") / "h", "card\n")


TRAIN = ["--heads", "2", "--layers", "1", "--batch-tokens", "2048", "--max-len", "256", "--eval-every", "2"]
CONVERSATIONS = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Tell me about {i}."},
                                                   {"from": "gpt", "value": f"{i} is a number."}]} for i in range(8)]


@pytest.fixture(scope="module")
def run_src(tmp_path_factory, llama_dir):
    """A training run of 2 steps with its checkpoint, and its data (copied per test)."""
    root = tmp_path_factory.mktemp("run")
    data = root / "chats.json"
    data.write_text(json.dumps(CONVERSATIONS))
    train_in_process(llama_dir, data, root / "h", "--max-steps", "2", *TRAIN)
    return root


@pytest.fixture
def inputs(tmp_path, llama_dir, heads_src, run_src):
    """Good inputs of every kind, private to the test (it damages one of them)."""
    shutil.copytree(llama_dir, tmp_path / "model")
    shutil.copytree(heads_src, tmp_path / "heads")
    shutil.copytree(run_src, tmp_path / "run")
    (tmp_path / "prompt.txt").write_text("Hello! What is the capital of France?")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "What is 2 + 3?"}) + "\n")
    (tmp_path / "stats.jsonl").write_text(json.dumps({"kind": "session", "session": "s", "command": "chat"}) + "\n")
    return tmp_path


def _unreadable(path: Path, monkeypatch):
    """Make `path` unreadable to this process: mode 000, and opening it refused too (root reads anything)."""
    import builtins
    import io

    path.chmod(0)
    real = builtins.open

    def guarded(file, *a, **k):
        if isinstance(file, (str, bytes, os.PathLike)) and Path(os.fsdecode(file)) == path:
            raise PermissionError(13, "Permission denied", str(path))
        return real(file, *a, **k)

    monkeypatch.setattr(builtins, "open", guarded)
    monkeypatch.setattr(io, "open", guarded)  # what pathlib opens with


def _half(p: Path):
    data = p.read_bytes()
    p.write_bytes(data[:len(data) // 2])


def _directory(p: Path):
    p.unlink()
    p.mkdir()


DAMAGE = {  # what can happen to a file: (kind, how)
    "damaged": _half,
    "garbage": lambda p: p.write_bytes(b"\x07" * 4096),
    "empty": lambda p: p.write_bytes(b""),
    "not json": lambda p: p.write_text("{this is not json"),
    "json of another shape": lambda p: p.write_text("[1, 2, 3]"),
    "not utf-8": lambda p: p.write_bytes(b"\xff\xfe\xfa not text \x80\x81"),
    "missing": lambda p: p.unlink(),
    "a directory": _directory,
    "unreadable": None,  # _unreadable, which needs monkeypatch
}

# command -> its arguments, with {model} {heads} {prompt} {prompts} {data} {run} {stats} filled in
COMMANDS = {
    "generate": ["generate", "{model}", "-f", "{prompt}", "-n", "4", "--stats-file", "off"],
    "generate --heads": ["generate", "{model}", "-f", "{prompt}", "--heads", "{heads}", "--draft", "clover",
                         "-n", "4", "--stats-file", "off"],
    "chat": ["chat", "{model}", "-n", "4", "--stats-file", "off"],
    "chat --heads": ["chat", "{model}", "--heads", "{heads}", "--draft", "clover", "-n", "4", "--stats-file", "off"],
    "bench": ["bench", "{model}", "--prompts", "{prompts}", "--methods", "plain", "--max-new-tokens", "4",
              "--repeats", "1"],
    "train": ["train", "{model}", "--data", "{data}", "--out", "{out}", "--max-steps", "1", *TRAIN],
    "train --resume": ["train", "{model}", "--data", "{data}", "--out", "{run}/h", "--max-steps", "4", "--resume",
                       *TRAIN],
    "compile": ["compile", "{model}"],
    "compile --heads": ["compile", "{model}", "--heads", "{heads}"],
    "stats": ["stats", "--stats-file", "{stats}", "--once"],
    "serve": ["serve", "{model}", "--port", "0", "--stats-file", "off"],
}

# which input of a command gets damaged: (command, the file, the kinds of damage)
MODEL_FILES = [("model.safetensors", ["damaged", "garbage", "empty", "missing", "a directory"]),
               ("config.json", ["not json", "json of another shape", "not utf-8", "missing", "a directory",
                                "unreadable"]),
               ("tokenizer.json", ["garbage", "not json", "a directory"])]
HEADS_FILES = [("model.safetensors", ["damaged", "garbage", "empty", "missing"]),
               ("config.json", ["not json", "json of another shape", "not utf-8", "missing", "unreadable"])]
CASES = (
    [(cmd, f"model/{f}", kind) for cmd in ("generate", "chat", "bench", "train", "compile", "serve")
     for f, kinds in MODEL_FILES for kind in kinds]
    + [(cmd, f"heads/{f}", kind) for cmd in ("generate --heads", "chat --heads", "compile --heads")
       for f, kinds in HEADS_FILES for kind in kinds]
    + [("generate", "prompt.txt", kind) for kind in ("not utf-8", "empty", "missing", "a directory", "unreadable")]
    + [("bench", "prompts.jsonl", kind) for kind in ("not json", "not utf-8", "empty", "missing", "a directory",
                                                     "unreadable")]
    + [("train", "run/chats.json", kind) for kind in ("not json", "json of another shape", "not utf-8", "empty",
                                                      "missing", "a directory", "unreadable")]
    + [("train --resume", f"run/h/checkpoint/{f}", kind)
       for f, kinds in [("state.json", ["not json", "json of another shape", "not utf-8", "missing"]),
                        ("optimizer.pt", ["damaged", "garbage", "empty", "missing"]),
                        ("heads.safetensors", ["damaged", "garbage", "missing"])] for kind in kinds]
    + [("stats", "stats.jsonl", kind) for kind in ("missing", "a directory", "unreadable")]
    + [(cmd, "model", "missing") for cmd in ("generate", "chat", "bench", "train", "compile")]
    + [(cmd, "heads", "missing") for cmd in ("generate --heads", "chat --heads", "compile --heads")]
)


@pytest.mark.parametrize("command, target, kind", CASES, ids=[f"{c}-{t}-{k}" for c, t, k in CASES])
def test_a_corrupt_input_is_one_line(run_cli, inputs, monkeypatch, command, target, kind):
    path = inputs / target
    if target in ("model", "heads"):
        shutil.rmtree(path)
    elif kind == "unreadable":
        _unreadable(path, monkeypatch)
    else:
        DAMAGE[kind](path)
    names = dict(model=inputs / "model", heads=inputs / "heads", prompt=inputs / "prompt.txt",
                 prompts=inputs / "prompts.jsonl", data=inputs / "run" / "chats.json", run=inputs / "run",
                 stats=inputs / "stats.jsonl", out=inputs / "out")
    argv = [a.format(**names) for a in COMMANDS[command]]
    from clover_cli.step import aot_build

    monkeypatch.setattr(aot_build, "build_for", lambda *a, **k: pytest.fail("a corrupt input got as far as compiling"))
    code, out, err = run_cli(*argv, stdin="Hello\n" if command.startswith("chat") else None)
    assert code != 0, (code, err)
    assert "Traceback" not in err, err
    assert "unexpected" not in err, err  # the boundary's catch-all is a safety net: each input has its own words
    assert len(err.splitlines()) == 1 and err.startswith("clover: error: "), err
    named = [p for p in (path, *path.parents) if inputs in p.parents]  # the file, or a directory it is in
    assert any(str(p) in err for p in named), err  # it says which input is at fault
    assert out == "" or command.startswith("chat"), out  # chat prints its banner... only once loaded


def test_every_command_that_reads_input_is_walked(run_cli):
    """A command added to clover is added here too (models, download, list and ps read no local input; rm takes a
    name `clover list` shows, never a path)."""
    from clover_cli.cli import app
    import typer.main

    commands = set(typer.main.get_command(app).commands)
    walked = {c.split()[0] for c in COMMANDS}
    assert commands - walked == {"models", "download", "list", "rm", "ps"}
