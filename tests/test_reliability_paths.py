"""Issue #45: the paths a user names for clover to write (`/save`, `--plot`, `--stats-file`, `--history-file`) and
the text a user or a file brings to the terminal.

No test here writes to, opens or chmods a real device: devices are judged through `os.stat` (which reads nothing)
or with the calls that could change them replaced, and FIFOs and symbolic links made in tmp_path stand in for them
end to end."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from clover_cli import atomic
from clover_cli.errors import CloverError
from test_reliability import isolated  # noqa: F401 (an autouse fixture: private caches, the Hub offline)


def one_line_error(result, *needles, code=2):
    rc, out, err = result
    assert rc == code, result
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("clover: error: ")]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err
    for n in needles:
        assert n.lower() in errors[0].lower(), (n, errors[0])
    return errors[0]


def nodes(tmp_path: Path):
    """A FIFO, a symbolic link to a regular file, and that file (0644, with content)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o644)
    os.chmod(fifo, 0o644)
    target = tmp_path / "target.txt"
    target.write_text("keep me\n")
    target.chmod(0o644)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    return fifo, link, target


# --- 1. replacing writes: a regular file or a new name, nothing else ------------------------------------------------


def test_replacing_writes_judge_what_is_at_the_path(tmp_path):
    fifo, link, target = nodes(tmp_path)
    assert atomic.check_replace(tmp_path / "new.json") is None
    assert stat.S_ISREG(atomic.check_replace(target).st_mode)
    for path, kind in [(fifo, "FIFO"), (link, "symbolic link"), (tmp_path, "directory"),
                       (Path("/dev/null"), "character device")]:  # lstat only: nothing is opened
        with pytest.raises(OSError, match=f"not a regular file.*{kind}"):
            atomic.check_replace(path)
    with pytest.raises(OSError, match="not a regular file"):
        atomic.write_text(fifo, "x")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.lstat(link).st_mode and link.is_symlink()
    assert target.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.json", "target.txt"]  # no temporary left


def test_a_replaced_file_keeps_its_mode_and_a_new_one_gets_the_mode_asked_for(tmp_path):
    from clover_cli.chat.conversation import Conversation

    conv = Conversation("be brief")
    conv.messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    shared = tmp_path / "shared.json"
    shared.write_text("{}")
    shared.chmod(0o644)
    conv.save(str(shared))
    assert stat.S_IMODE(shared.stat().st_mode) == 0o644 and json.loads(shared.read_text())["system"] == "be brief"
    new = conv.save(str(tmp_path / "new.json"))
    assert stat.S_IMODE(new.stat().st_mode) == 0o600


def test_save_refuses_a_fifo_and_a_symlink(tmp_path):
    from clover_cli.chat.conversation import Conversation

    fifo, link, target = nodes(tmp_path)
    conv = Conversation()
    conv.messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(CloverError, match=r"cannot save to .*fifo: not a regular file \(a FIFO\)"):
        conv.save(str(fifo))
    with pytest.raises(CloverError, match=r"cannot save to .*link.json: not a regular file \(a symbolic link"):
        conv.save(str(link))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink() and target.read_text() == "keep me\n"


def test_save_in_a_chat_refuses_what_is_not_a_file_and_the_chat_goes_on(llama_dir, tmp_path, run_cli, one_thread):
    fifo, link, target = nodes(tmp_path)
    good = tmp_path / "good.json"
    lines = ["Hello there", f"/save {fifo}", f"/save {link}", "again", f"/save {good}"]
    code, out, err = run_cli("chat", str(llama_dir), "-n", "4", "--stats-file", "off", stdin="\n".join(lines) + "\n")
    assert code == 0, err
    assert f"error: cannot save to {fifo}: not a regular file (a FIFO)" in err
    assert f"error: cannot save to {link}: not a regular file (a symbolic link" in err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and stat.S_IMODE(os.lstat(fifo).st_mode) == 0o644
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_text() == "keep me\n"
    saved = json.loads(good.read_text())  # the conversation was kept whole through the failed saves
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == ["Hello there", "again"]


def test_plot_to_a_fifo_is_refused_before_the_runs(tmp_path, run_cli):
    pytest.importorskip("matplotlib")
    fifo_png = tmp_path / "fifo.png"
    os.mkfifo(fifo_png)
    one_line_error(run_cli("bench", str(tmp_path / "no-such-model"), "--plot", str(fifo_png)), "plot",
                   "not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo_png).st_mode)


# --- 2. appending: never a chmod of a file clover did not create; /dev/null is a sink -------------------------------


def test_appending_judges_what_was_opened(tmp_path):
    import socket

    fifo, link, target = nodes(tmp_path)
    for path in (target, link, fifo, Path("/dev/null")):  # stat reads nothing and opens nothing
        atomic.check_appendable(os.stat(path), path)  # a file, or a sink: a FIFO, a character device
    with pytest.raises(IsADirectoryError):
        atomic.check_appendable(os.stat(tmp_path), tmp_path)
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "sock"))
        with pytest.raises(OSError, match="socket"):
            atomic.check_appendable(os.stat(tmp_path / "sock"), tmp_path / "sock")
    finally:
        sock.close()
    # the early check (before a model loads) creates nothing and refuses a directory
    atomic.check_append(tmp_path / "new" / "stats.jsonl")
    assert not (tmp_path / "new").exists()
    with pytest.raises(IsADirectoryError):
        atomic.check_append(tmp_path)
    with pytest.raises(NotADirectoryError):
        atomic.check_append(target / "x.jsonl")


def test_appending_to_an_existing_file_leaves_its_mode(tmp_path):
    from clover_cli.chat.repl import _history
    from clover_cli.stats import StatsWriter

    history = tmp_path / "history"
    history.write_text("\n# 2026-01-01 00:00:00\n+an old prompt\n")
    history.chmod(0o644)
    h, shown = _history(str(history))
    h.store_string("a new prompt")
    assert shown == history and stat.S_IMODE(history.stat().st_mode) == 0o644
    assert list(h.load_history_strings()) == ["a new prompt", "an old prompt"]

    stats = tmp_path / "stats.jsonl"
    stats.write_text("")
    stats.chmod(0o640)
    w = StatsWriter.open(str(stats))
    w.write({"kind": "step"})
    assert stat.S_IMODE(stats.stat().st_mode) == 0o640 and stats.read_text() == '{"kind":"step"}\n'

    created = tmp_path / "sub" / "new.jsonl"
    old = os.umask(0o022)
    try:
        StatsWriter.open(str(created)).write({"kind": "step"})
    finally:
        os.umask(old)
    assert stat.S_IMODE(created.stat().st_mode) == 0o600  # a file clover makes is private


def test_a_fifo_is_a_sink_for_stats_and_is_not_chmodded(tmp_path):
    from clover_cli.stats import StatsWriter

    fifo = tmp_path / "stats.fifo"
    os.mkfifo(fifo, 0o644)
    os.chmod(fifo, 0o644)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader is there: opening to write does not wait
    try:
        w = StatsWriter.open(str(fifo))
        w.write({"kind": "step"})
        assert os.read(reader, 1 << 16) == b'{"kind":"step"}\n'
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and stat.S_IMODE(os.lstat(fifo).st_mode) == 0o644


def test_dev_null_is_accepted_for_history_and_stats_and_never_chmodded(monkeypatch):
    """The calls that could change /dev/null are replaced by ones that record and refuse: safe on any build."""
    from clover_cli.chat.repl import _history
    from clover_cli.stats import StatsWriter

    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise PermissionError(1, "refused by the test")

    for name in ("chmod", "fchmod", "lchmod", "chown", "fchown", "replace", "rename", "unlink"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)
    before = os.stat("/dev/null")
    _, shown = _history("/dev/null")
    w = StatsWriter.open("/dev/null")
    w.write({"kind": "step"})
    assert shown == Path("/dev/null") and w is not None and not w.failed and calls == []
    assert os.stat("/dev/null").st_mode == before.st_mode


def test_a_directory_is_refused_in_one_line_before_the_model_loads(tmp_path, run_cli):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hi")
    nowhere = str(tmp_path / "no-such-model")
    one_line_error(run_cli("generate", nowhere, "-f", str(prompt), "--stats-file", str(tmp_path)),
                   "stats file", "directory")
    one_line_error(run_cli("chat", nowhere, "--stats-file", str(tmp_path), stdin="hi\n"), "stats file", "directory")
    one_line_error(run_cli("serve", nowhere, "--port", "0", "--stats-file", str(tmp_path)), "stats file",
                   "directory")
    # a run that fails to start leaves no record: the check made no file
    one_line_error(run_cli("generate", nowhere, "-f", str(prompt), "--stats-file", str(tmp_path / "s.jsonl")),
                   "no-such-model")
    assert not (tmp_path / "s.jsonl").exists()


# --- 11. text from a user or a file reaches the terminal as text ---------------------------------------------------


HOSTILE = "be brief\x1b[2J\x1b]0;pwned\x07\x9b2J"


def test_system_message_of_a_loaded_conversation_is_shown_inert(llama_dir, tmp_path, run_cli, one_thread):
    conv = tmp_path / f"conv\x1b[31m.json"
    conv.write_text(json.dumps({"system": HOSTILE, "messages": [{"role": "user", "content": "hi\x1b[2J"},
                                                                {"role": "assistant", "content": "hello"}]}))
    lines = [f"/load {conv}", "/system", "/system --clear", f"/system {HOSTILE}", "/system"]
    code, out, err = run_cli("chat", str(llama_dir), "-n", "4", "--stats-file", "off", stdin="\n".join(lines) + "\n")
    assert code == 0, err
    assert "system message: be brief^[[2J^[]0;pwned^G" in err and "loaded 2 message(s)" in err
    for bad in ("\x1b", "\x07", "\x9b"):
        assert bad not in out and bad not in err


def test_stats_dashboard_shows_a_file_s_strings_inert(tmp_path, run_cli):
    stats = tmp_path / "s.jsonl"
    stats.write_text(json.dumps({"kind": "session", "session": "ab\x1b[2J", "t": 1.0, "command": "chat\x07",
                                 "model": HOSTILE, "draft": "none\x1b]0;x\x07"}) + "\n")
    code, out, err = run_cli("stats", "--stats-file", str(stats), "--once")
    assert code == 0, err
    for bad in ("\x1b", "\x07", "\x9b"):
        assert bad not in out and bad not in err


def test_an_error_line_shows_a_path_inert(tmp_path, run_cli):
    result = run_cli("generate", "-f", str(tmp_path / "no\x1b[2J\x07.txt"))
    line = one_line_error(result, "no^[[2J^G.txt")
    assert "\x1b" not in result[2] and "\x07" not in result[2], line
