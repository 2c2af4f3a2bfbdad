"""The README's commands as written: every command of a fenced `bash` block is run here (with the bundled, offline
`tiny` model in place of `smollm2` and of the default model, and replies cut to a few tokens), or is listed in
NOT_RUN with why it cannot run in a test (it installs, reaches the network, or is run by another test). A command
that is neither fails test_every_readme_command_is_run_or_listed; so does an entry of NOT_RUN that the README no
longer holds. The flags of the "Coming from Ollama / llama.cpp" table and the commands of the Commands table are
checked against the command line itself.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import clover_command, offline

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

# command (as the README writes it, comments dropped) -> why no test here runs it
NOT_RUN = {
    "git clone REPO_URL clover && cd clover": "network: clones the repository the tests run from",
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 . && clover chat":
        "installs from the package index; its last part, `clover chat`, runs here as `clover chat smollm2 ...`",
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[test]" && python -m pytest -q '
    "-n 2": "the test command itself: .ci/run runs it (the suite cannot run itself)",
    "python3 -m venv .venv && . .venv/bin/activate": "makes a virtual environment: the tests run inside one",
    "pip install torch --index-url https://download.pytorch.org/whl/cu128": "network, and a GPU to be of use",
    'pip install ".[kernels]"': "network (Triton, for a GPU)",
    'curl -N http://127.0.0.1:8000/v1/chat/completions -H "Content-Type: application/json" -d \'{"model": '
    '"smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 64, '
    '"stream": true}\'': "run as written against a live server by tests/test_serve.py::test_readme_examples",
}

MODEL = "tiny"  # in place of smollm2 and of the default model: bundled, no network
MAX_TOKENS = "4"


def readme_commands(text: str) -> list[str]:
    """Each command of the fenced bash blocks of `text`, as written: lines continued by a backslash, or by a quoted
    string still open, joined."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        pending = ""
        for line in block.splitlines():
            pending = f"{pending}\n{line}" if pending else line
            if pending.endswith("\\"):
                continue
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # a quotation still open: the command goes on on the next line
                continue
            if words:
                commands.append(pending)
            pending = ""
        assert not pending, f"an unfinished command in a README bash block: {pending}"
    return commands


def _normal(command: str) -> str:
    """A command as shlex reads it, comments dropped and spacing made single: how NOT_RUN's keys are matched."""
    return " ".join(shlex.join(shlex.split(command.replace("\\\n", " "), comments=True)).split())


NOT_RUN_NORMAL = {_normal(c): why for c, why in NOT_RUN.items()}


def runnable(command: str) -> list[str] | None:
    """The arguments of `clover ...` as a test runs them (the model swapped, replies cut short), else None."""
    words = shlex.split(command.replace("\\\n", " "), comments=True)
    if not words or words[0] != "clover" or any(w in ("|", "&&", ";", ">", "<") for w in words):
        return None
    args = [MODEL if w == "smollm2" else w for w in words[1:]]
    for i, word in enumerate(args[:-1]):
        if word in ("-n", "--max-new-tokens"):
            args[i + 1] = MAX_TOKENS
    return args


def classify(command: str) -> str:
    """'run' or 'listed'; a command that is neither raises AssertionError."""
    if _normal(command) in NOT_RUN_NORMAL:
        return "listed"
    assert runnable(command) is not None, (f"README command neither run by tests/test_readme.py nor listed in its "
                                           f"NOT_RUN with a reason: {command}")
    return "run"


def test_every_readme_command_is_run_or_listed():
    commands = readme_commands(README.read_text())
    assert len(commands) >= 10
    kinds = {c: classify(c) for c in commands}
    stale = set(NOT_RUN_NORMAL) - set(map(_normal, commands))
    assert not stale, f"NOT_RUN lists commands the README no longer has: {stale}"
    assert sum(k == "run" for k in kinds.values()) >= 6


def test_a_command_neither_run_nor_listed_fails():
    text = "```bash\nclover models\nrm -rf build   # something new\n```\n"
    assert readme_commands(text) == ["clover models", "rm -rf build   # something new"]
    assert classify("clover models") == "run"
    with pytest.raises(AssertionError, match="rm -rf build"):
        classify("rm -rf build")
    assert runnable("clover generate smollm2 -p 'a b' -n 128") == ["generate", MODEL, "-p", "a b", "-n", MAX_TOKENS]


def test_the_test_command_is_ci_s():
    """.ci/run runs the line after the test-command marker: it is still there, and one of NOT_RUN's."""
    text = README.read_text()
    line = text.split("<!-- test-command", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    assert _normal(line) in NOT_RUN_NORMAL and "pytest" in line


@pytest.fixture
def cli_env(tmp_path, monkeypatch):
    """Offline, caches in tmp_path, the default model `tiny`, no compiled step built behind a chat."""
    offline(tmp_path, monkeypatch)
    monkeypatch.setenv("CLOVER_MODEL", MODEL)
    monkeypatch.setenv("CLOVER_COMPILE", "off")
    monkeypatch.setenv("CLOVER_STATS_FILE", str(tmp_path / "stats.jsonl"))
    return tmp_path


RUN = list({_normal(c): c for c in readme_commands(README.read_text())
             if _normal(c) not in NOT_RUN_NORMAL and runnable(c)})  # each command once (clover models is there twice)


@pytest.mark.parametrize("command", [c for c in RUN if runnable(c)[0] != "serve"], ids=str)
def test_readme_command_runs(command, run_cli, cli_env):
    import torch

    args = runnable(command)
    threads = torch.get_num_threads()
    try:
        code, out, err = run_cli(*args, stdin="Hello\n" if args[0] == "chat" else None)
    finally:
        torch.set_num_threads(threads)  # -t N sets them for the process
    assert code == 0, (command, err)
    assert "Traceback" not in err and "error" not in err.lower(), err
    if args[0] in ("chat", "generate"):
        assert out.strip(), "a reply"


@pytest.mark.parametrize("command", [c for c in RUN if runnable(c)[0] == "serve"], ids=str)
def test_readme_serve_command_serves(command, cli_env):
    """`clover serve ...` as written, on a free port (--port 0) instead of the README's: it comes up and answers."""
    args = runnable(command)
    if "--port" in args:
        args[args.index("--port") + 1] = "0"
    else:
        args += ["--port", "0"]
    pytest.importorskip("uvicorn")
    env = {**os.environ, "HF_HUB_CACHE": str(cli_env / "hf-cache")}
    proc = subprocess.Popen([*clover_command(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cli_env)
    try:
        lines, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            found = re.search(r"OpenAI API at (http://\S+)/v1", line)
            if found:
                with urllib.request.urlopen(found.group(1) + "/health", timeout=30) as r:
                    assert r.status == 200
                break
        else:
            pytest.fail(f"no server within 120 s: {''.join(lines)}")
        assert found, "".join(lines)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _section(text: str, heading: str) -> str:
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def test_commands_table_lists_every_command():
    from typer.main import get_command

    from clover_cli.cli import app

    table = _section(README.read_text(), "## Commands")
    listed = re.findall(r"^\| `clover (\w+)", table, flags=re.M)
    assert sorted(listed) == sorted(get_command(app).commands)


def test_ollama_llama_cpp_table_flags_are_clover_s():
    """Every flag in the clover column of "Coming from Ollama / llama.cpp" is an option of chat or generate (serve's
    and download's where the row names them), and every command it names is one."""
    from typer.main import get_command

    from clover_cli.cli import app

    commands = get_command(app).commands
    flags = {opt for name in ("chat", "generate") for p in commands[name].params for opt in p.opts}
    rows = [row for row in re.findall(r"^\| (.*?) \| (.*?) \|$", _section(README.read_text(),
                                      "## Coming from Ollama / llama.cpp"), flags=re.M) if row[1] != "clover"]
    assert len(rows) >= 15
    for theirs, ours in rows:
        for code in re.findall(r"`([^`]+)`", ours):
            words = code.split()
            if words[0] == "clover":
                assert words[1] in commands, code
                own = {opt for p in commands[words[1]].params for opt in p.opts}
                assert all(w in own for w in words[2:] if w[:1] == "-" and w != "-"), code
            else:
                assert all(w in flags for w in words if w[:1] == "-" and w != "-"), (code, ours)


# flags the README names that are other programs' -> whose
FOREIGN_FLAGS = {"--dist": "pytest-xdist's", "--index-url": "pip's", "--multi_gpu": "accelerate launch's",
                 "--num_processes": "accelerate launch's", "--repeat-penalty": "llama.cpp's (beside clover's own)"}


def test_every_long_flag_in_the_readme_is_an_option_of_clover():
    """Each --flag the README names is an option of clover or of one of its commands, or another program's listed in
    FOREIGN_FLAGS (which holds none that clover has, and none the README no longer names)."""
    from typer.main import get_command

    from clover_cli.cli import app

    root = get_command(app)
    params = list(root.params) + [p for command in root.commands.values() for p in command.params]
    options = {"--help"} | {opt for p in params for opt in [*p.opts, *p.secondary_opts]}
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", README.read_text()))
    assert named - options == set(FOREIGN_FLAGS), "README flags that are no option of clover's (or stale entries)"
    assert not options & set(FOREIGN_FLAGS)
