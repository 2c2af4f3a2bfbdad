"""The stats stream and `clover stats`: figures from a recorded stream, skipped lines, the writer's guarantees
(private file, whole lines, rotation) and the live dashboard in a pseudo-terminal."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import stat
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from clover_cli import stats as st


def step(sid, tokens, accepted=0, proposed=0, depth=0, elapsed=0.01, verify=None, draft="ngram", prefill=False,
         t=1000.0):
    rec = {"kind": "step", "session": sid, "t": t, "model": "m", "draft": draft, "tokens": tokens,
           "accepted": accepted, "proposed": proposed, "depth": depth, "elapsed_s": elapsed, "draft_s": 0.001,
           "verify_s": elapsed if verify is None else verify}
    if prefill:
        rec["prefill"] = True
    return json.dumps(rec)


def recorded_stream(path: Path):
    """Two sessions with known figures, and lines that must be skipped."""
    lines = [
        json.dumps({"kind": "session", "session": "s1", "t": 1000.0, "command": "chat", "pid": 1, "model": "m",
                    "draft": "ngram", "device": "cpu"}),
        step("s1", 1, elapsed=0.5, verify=0.0, prefill=True),
        *[step("s1", 1, elapsed=0.010, verify=0.010) for _ in range(4)],  # plain steps: t_plain = 0.010
        step("s1", 3, accepted=2, proposed=5, depth=3, elapsed=0.020, verify=0.018),
        "this is not json",
        step("s1", 4, accepted=3, proposed=6, depth=4, elapsed=0.020, verify=0.018),
        "[1, 2, 3]",
        step("s1", 1, accepted=0, proposed=4, depth=2, elapsed=0.015, verify=0.013),
        json.dumps({"kind": "step", "session": "s1", "tokens": -3, "elapsed_s": 0.1}),  # impossible value
        json.dumps({"kind": "heartbeat", "session": "s1"}),  # not ours
        json.dumps({"kind": "session", "session": "s2", "t": 1001.0, "command": "generate", "model": "m",
                    "draft": "none"}),
        step("s2", 1, elapsed=0.4, verify=0.0, draft="none", prefill=True),
        step("s2", 1, elapsed=0.01, draft="none"),
        step("s2", 1, elapsed=0.01, draft="none"),  # only two plain steps: no speedup estimate
        '{"kind":"step","session":"s2","tokens":1,"acc',  # a writer that died mid-line, then more lines
    ]
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1] + "\n" + step("s2", 1, elapsed=0.01, draft="none")[:30])
    return 6  # skipped lines: not json, list, impossible value, foreign kind, two truncated lines


S1 = dict(tokens=12, steps=7, accepted=5, tau=12 / 7, rate=5 / 12, elapsed=0.095, speedup=12 * 0.010 / 0.095,
          hits=[2 / 3, 2 / 3, 1 / 2, 0.0], hist=[5, 0, 1, 1])


def test_snapshot_numbers(tmp_path, run_cli):
    f = tmp_path / "stats.jsonl"
    skipped = recorded_stream(f)
    code, out, err = run_cli("stats", "--stats-file", str(f), "--json")
    assert code == 0, err
    snap = json.loads(out)
    assert snap["skipped_lines"] == skipped
    assert snap["sessions"] == 2
    assert snap["tokens"] == 12 + 2 and snap["steps"] == 7 + 2 and snap["accepted"] == 5
    assert snap["acceptance_rate"] == pytest.approx(5 / 14, abs=1e-4)
    assert snap["tau"] == pytest.approx(14 / 9, abs=1e-4)
    assert snap["speedup"] == pytest.approx(S1["speedup"], abs=1e-3)  # only s1 has an estimate
    assert snap["accepted_hist"] == [7, 0, 1, 1]
    s1, s2 = snap["by_session"]
    assert (s1["session"], s1["command"], s1["model"], s1["draft"]) == ("s1", "chat", "m", "ngram")
    assert s1["replies"] == 1 and s1["tokens"] == S1["tokens"] and s1["steps"] == S1["steps"]
    assert s1["acceptance_rate"] == pytest.approx(S1["rate"], abs=1e-4)
    assert s1["tau"] == pytest.approx(S1["tau"], abs=1e-4)
    assert s1["tokens_per_s"] == pytest.approx(S1["tokens"] / S1["elapsed"], rel=1e-3)
    assert s1["plain_step_s"] == pytest.approx(0.010)
    assert s1["speedup"] == pytest.approx(S1["speedup"], abs=1e-3)
    assert s1["hit_rate_by_depth"] == pytest.approx(S1["hits"], abs=1e-4)
    assert s1["accepted_hist"] == S1["hist"]
    assert s2["draft"] == "none" and s2["speedup"] is None and s2["tau"] == 1.0 and s2["acceptance_rate"] == 0.0

    code, out, _ = run_cli("stats", "--stats-file", str(f), "--json", "--session", "s1")
    one = json.loads(out)
    assert one["sessions"] == 1 and one["tau"] == pytest.approx(S1["tau"], abs=1e-4)
    assert one["acceptance_rate"] == pytest.approx(S1["rate"], abs=1e-4)
    assert one["hit_rate_by_depth"] == pytest.approx(S1["hits"], abs=1e-4)


def _dashboard(tmp_path, run_cli, monkeypatch, columns: int) -> str:
    """`clover stats --once` over the recorded stream, on a terminal `columns` wide."""
    monkeypatch.setenv("COLUMNS", str(columns))
    f = tmp_path / "stats.jsonl"
    recorded_stream(f)
    code, out, err = run_cli("stats", "--stats-file", str(f), "--once")
    assert code == 0, err
    return out


def test_dashboard_text(tmp_path, run_cli, monkeypatch):
    out = _dashboard(tmp_path, run_cli, monkeypatch, 200)
    assert "\x1b[" not in out  # not a terminal: plain
    assert "35.7%" in out and "1.56" in out  # overall acceptance rate and τ
    assert f"{S1['speedup']:.2f}×" in out  # estimated speedup
    assert "41.7%" in out and "1.71" in out  # session s1
    assert "6 skipped" in out
    for d, rate in enumerate(S1["hits"], 1):
        assert f"depth {d}" in out and f"{100 * rate:5.1f}%" in out
    assert "3 accepted" in out and "n/a" in out  # histogram rows; s2 has no speedup estimate
    assert "█" in out


def test_session_table_fits_a_narrow_terminal(tmp_path, run_cli, monkeypatch):
    """At 80 columns the per-session table keeps its most important figures whole and drops the rest."""
    out = _dashboard(tmp_path, run_cli, monkeypatch, 80)
    assert max(len(line) for line in out.splitlines()) <= 80
    header = next(line for line in out.splitlines() if "session" in line and "draft" in line)
    for col in ("accept", "τ", "tok/s"):
        assert col in header, header
    assert "…" not in header
    row = next(line for line in out.splitlines() if line.lstrip().startswith("s1"))
    assert "41.7%" in row and "1.71" in row


def test_bad_invocations(tmp_path, run_cli):
    code, _, err = run_cli("stats", "--stats-file", str(tmp_path / "none.jsonl"), "--once")
    assert code == 2 and err.startswith("clover: error: no stats file") and err.count("\n") == 1
    f = tmp_path / "s.jsonl"
    recorded_stream(f)
    code, _, err = run_cli("stats", "--stats-file", str(f), "--json", "--session", "zz")
    assert code == 2 and "no session 'zz'" in err
    code, _, err = run_cli("stats", "--stats-file", "off", "--once")
    assert code == 2
    code, _, err = run_cli("stats", "--stats-file", str(f), "--interval", "0")
    assert code == 2 and "--interval" in err
    code, _, err = run_cli("stats", "--help")
    assert code == 0


def test_help_defines_the_figures(run_cli):
    code, out, _ = run_cli("stats", "--help")
    text = " ".join(out.split())
    assert "acceptance rate" in text and "τ" in text and "speedup" in text


def fake_event(tokens=3, accepted=2, prefill=False):
    return SimpleNamespace(tokens=[5] * tokens, depths=[1, 2, 0][:tokens], accepted=accepted, proposed=4,
                           tree_depth=3, elapsed_s=0.02, draft_s=0.001, verify_s=0.019, prefill=prefill)


def fake_session(draft="ngram"):
    return SimpleNamespace(resolved=SimpleNamespace(name="m"), draft_name=draft, device="cpu")


def test_writer_private_whole_lines(tmp_path):
    f = tmp_path / "sub" / "stats.jsonl"
    w = st.StatsWriter.open(str(f))
    sid = w.new_session("generate", fake_session())
    w.step(sid, fake_event(prefill=True))
    w.step(sid, fake_event(), draft="none")
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    recs = [json.loads(x) for x in f.read_text().splitlines()]
    assert [r["kind"] for r in recs] == ["session", "step", "step"]
    assert recs[1]["prefill"] is True and recs[1]["model"] == "m" and recs[1]["draft"] == "ngram"
    assert recs[2]["draft"] == "none" and recs[2]["tokens"] == 3 and recs[2]["accepted"] == 2
    assert st.StatsWriter.open("off") is None
    (tmp_path / "blocker").write_text("")
    with pytest.raises(st.CloverError):
        st.StatsWriter.open(str(tmp_path / "blocker" / "x.jsonl"))


def _hammer(path: str, n: int, who: int):
    w = st.StatsWriter(Path(path))
    for i in range(n):
        w.write({"kind": "step", "session": f"p{who}", "tokens": 1, "elapsed_s": 0.01, "pad": "x" * (i * 17 % 4000)})


def test_concurrent_writers_and_rotation(tmp_path, monkeypatch):
    monkeypatch.setattr(st, "ROTATE_BYTES", 1_000_000)  # ~1.8 MB written: one rotation
    f = tmp_path / "stats.jsonl"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_hammer, args=(str(f), 300, i)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    agg = st.Aggregate()
    for line in st.read_all(f.with_name(f.name + ".1")) + st.read_all(f):
        agg.feed(line)
    assert agg.skipped == 0 and agg.lines == 900  # every line whole, none lost by the rotation
    assert f.with_name(f.name + ".1").exists()
    assert stat.S_IMODE(f.stat().st_mode) == 0o600


def test_follower(tmp_path):
    f = tmp_path / "s.jsonl"
    fol = st.Follower(f)
    assert fol.poll() == []  # no file yet
    f.write_bytes(b'{"a":1}\n{"b"')
    assert fol.poll() == [b'{"a":1}']  # the unfinished line waits
    with open(f, "ab") as h:
        h.write(b':2}\n')
    assert fol.poll() == [b'{"b":2}']
    with open(f, "ab") as h:
        h.write(b'{"c":3}\n')
    os.replace(f, tmp_path / "s.jsonl.1")  # rotation: the old file's tail, then the new file
    f.write_bytes(b'{"d":4}\n')
    assert fol.poll() == [b'{"c":3}', b'{"d":4}']
    f.write_bytes(b"")  # truncated in place (same inode), then written again
    assert fol.poll() == []
    f.write_bytes(b'{"e":5}\n')
    assert fol.poll() == [b'{"e":5}']
    with open(f, "ab") as h:
        h.write(b"y" * (st.MAX_LINE + 10) + b'\n{"f":6}\n')
    assert fol.poll() == [b'{"f":6}'] and fol.broken == 1


def test_live_dashboard_follows(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    f = tmp_path / "stats.jsonl"
    recorded_stream(f)
    clover = shutil.which("clover") or str(Path(sys.executable).parent / "clover")
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    env.update(TERM="xterm-256color", COLUMNS="200", LINES="60", XDG_CACHE_HOME=str(tmp_path / "cache"))
    child = pexpect.spawn(clover, ["stats", "--stats-file", str(f), "--interval", "0.2"], env=env,
                          encoding="utf-8", timeout=30, dimensions=(60, 200))
    try:
        child.expect("following the stream")
        child.expect("41.7%")
        with open(f, "a") as h:  # finish the half-written line, then a new session
            h.write("\n" + json.dumps({"kind": "session", "session": "live1234", "t": time.time(),
                                       "command": "chat", "model": "m2", "draft": "clover"}) + "\n")
            h.write(step("live1234", 1, prefill=True, draft="clover", t=time.time()) + "\n")
            for _ in range(3):
                h.write(step("live1234", 5, accepted=4, proposed=8, depth=5, draft="clover", t=time.time()) + "\n")
        child.expect("live1234")
        child.expect("80.0%")  # the new session's acceptance rate: 12 of 15
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
