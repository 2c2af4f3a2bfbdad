"""The statistics of decoding: `Stats`, the one aggregator of steps (a reply's, a session's, the stream's), and the
stats stream: per-step records that chat, generate and serve append, read back here for `clover stats`
(dashboard.py shows them).

Each record is one JSON line written with a single append (O_APPEND), so lines from concurrent sessions never
interleave; the file is private (0600) and is rotated to `<file>.1` when it grows past ROTATE_BYTES.

Records:

    {"kind":"session","session":sid,"t":..,"command":"chat","pid":..,"model":..,"draft":..,"device":..}
    {"kind":"step","session":sid,"t":..,"model":..,"draft":..,"tokens":n,"accepted":a,"proposed":p,"depth":d,
     "elapsed_s":..,"draft_s":..,"verify_s":..[,"prefill":true]}

`tokens` is what the step added to the reply, `accepted` how many drafted tokens the target accepted, `proposed`
how many drafted nodes it verified, `depth` how deep the draft tree reached. The prefill step (the prompt, and the
reply's first token) is marked and left out of the decoding figures.

Definitions used by `clover stats` (and chat's /stats), over the decoding steps (every step but the prefill):

    acceptance rate  accepted drafted tokens / generated tokens: the share of the tokens after each reply's first
                     that the draft proposed and the target accepted (the rest are the target's own, one per step)
    tau              generated tokens / steps: tokens per target forward pass
    hit rate at d    of the steps whose draft tree reached depth d, the share whose accepted path reached depth d
    tokens/s         generated tokens / time of the steps (draft + verify)
    est. speedup     the time plain decoding would need for the same tokens / the time the steps took, where plain
                     decoding costs one target forward per token, timed as the median verify time of the session's
                     (last PLAIN_SAMPLES) steps that verified no drafted token (a one-token forward). Equivalently
                     tau * t_plain / t_step. Without MIN_PLAIN_STEPS such steps in a session there is no honest
                     estimate: n/a. Overall: the sessions with an estimate, sum of plain times / sum of step times.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import uuid
from collections import deque
from pathlib import Path

from . import atomic
from .errors import CloverError
from .options import env

ROTATE_BYTES = 8 * 1024 * 1024
MAX_LINE = 1 << 20  # longer "lines" are not ours: skipped
MIN_PLAIN_STEPS = 3
PLAIN_SAMPLES = 50_000  # the most recent plain-step times kept per session


def default_path() -> Path:
    path = env("CLOVER_STATS_FILE")
    if path:
        return Path(path).expanduser()
    return cache_dir() / "stats.jsonl"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "clover"


def stats_path(arg: str | None) -> Path | None:
    if arg == "off":
        return None
    return Path(arg).expanduser() if arg else default_path()


def step_record(sid: str | None, ev, model: str | None = None, draft: str | None = None) -> dict:
    rec = {"kind": "step", "session": sid, "t": round(time.time(), 3)}
    if model is not None:
        rec["model"] = model
    if draft is not None:
        rec["draft"] = draft
    rec.update({"tokens": len(ev.tokens), "accepted": ev.accepted, "proposed": ev.proposed, "depth": ev.tree_depth,
                "elapsed_s": round(ev.elapsed_s, 6), "draft_s": round(ev.draft_s, 6),
                "verify_s": round(ev.verify_s, 6)})
    if ev.prefill:
        rec["prefill"] = True
    return rec


def _stderr_warning(text: str):
    sys.stderr.write(f"clover: warning: {text}\n")
    sys.stderr.flush()


class StatsWriter:
    """Appends records to the stream. A stream that cannot be written never interrupts a session: it is said once
    (through `warn`: a chat says it between replies), and the session goes on without it."""

    def __init__(self, path: Path, warn=_stderr_warning):
        self.path = path
        self.meta: dict[str, dict] = {}  # session id -> model and drafter, stamped on each of its steps
        self.warn = warn
        self.failed = False

    @staticmethod
    def check(arg: str | None) -> None:
        """Judge a --stats-file before the model loads (a directory, a device, a place where no file can be made
        fails at once, in one line), creating nothing: `open`, after loading, makes the file, so that a run that
        fails to start leaves no record. The default location is not judged: it never fails a run."""
        path = stats_path(arg)
        if path is None or not arg:
            return
        try:
            atomic.check_append(path)
        except OSError as e:
            raise CloverError(f"cannot write the stats file {path}: {e.strerror or e}")

    @staticmethod
    def open(arg: str | None) -> "StatsWriter | None":
        """The writer of the stream (a regular file, a FIFO or /dev/null; see atomic.open_append), its file
        created (0600) if it is not there; None for 'off'."""
        path = stats_path(arg)
        if path is None:
            return None
        try:
            if path.is_dir():
                raise IsADirectoryError(21, "Is a directory")
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.close(atomic.open_append(path, 0o600))
        except OSError as e:
            if arg:
                raise CloverError(f"cannot write the stats file {path}: {e.strerror or e}")
            # the default location is a convenience: never fail a chat over it
            _stderr_warning(f"cannot write the stats stream {path}: {e.strerror or e}; this session's statistics "
                            f"are not recorded (--stats-file chooses another file, 'off' says nothing)")
            return None
        return StatsWriter(path)

    def _open(self) -> int:
        return atomic.open_append(self.path, 0o600)  # private when made here; an existing file keeps its mode

    def _rotate(self, fd: int) -> int:
        """Move a full file aside to <file>.1 (once, even with several writers) and open the new one."""
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock, the race only costs an early rotation
            fcntl = None
        st = os.fstat(fd)
        try:
            if fcntl:
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                # nobody rotated it while we waited (lstat: a symbolic link, a FIFO or /dev/null is not rotated)
                if os.lstat(self.path).st_ino == st.st_ino:
                    os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            except FileNotFoundError:
                pass
        finally:
            if fcntl:
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        return self._open()

    def write(self, record: dict):
        line = (json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
        try:
            fd = self._open()
            try:
                if os.fstat(fd).st_size + len(line) > ROTATE_BYTES:
                    fd = self._rotate(fd)
                os.write(fd, line)  # one write of one whole line, O_APPEND: never interleaved
            finally:
                os.close(fd)
        except OSError as e:  # statistics must never interrupt a conversation
            if not self.failed:
                self.failed = True
                self.warn(f"cannot write the stats stream {self.path}: {e.strerror or e}; statistics of this "
                          f"session may be incomplete")

    def new_session(self, command: str, session) -> str:
        sid = uuid.uuid4().hex[:8]
        self.meta[sid] = {"model": session.resolved.name, "draft": session.draft_name}
        self.write({"kind": "session", "session": sid, "t": round(time.time(), 3), "command": command,
                    "pid": os.getpid(), "model": session.resolved.name, "draft": session.draft_name,
                    "device": str(session.device)})
        return sid

    def step(self, sid: str, ev, draft: str | None = None):
        meta = self.meta.get(sid, {})
        if draft:
            meta["draft"] = draft
        self.write(step_record(sid, ev, meta.get("model"), meta.get("draft")))


# ----------------------------------------------------------------------------------------------- aggregation


def _count(rec: dict, key: str, default=None) -> int:
    v = rec.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > 1_000_000_000:
        raise ValueError(key)
    return v


def _seconds(rec: dict, key: str, default=None) -> float:
    v = rec.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or v > 1e7:
        raise ValueError(key)
    return float(v)


def _text(rec: dict, key: str) -> str | None:
    v = rec.get(key)
    return v[:200] if isinstance(v, str) else None


class Stats:
    """Totals of decoding steps: of one reply (generate's --json and the line under each chat reply, a served
    response's figures), of one session (chat's /stats, a session in the stream) or of several (`merge`).

    Steps come as the engine's StepEvents (add: the reply loop, bench, train's evaluation) or as records read back
    from the stream (add_record: each one checked first)."""

    def __init__(self, sid: str = "", command: str | None = None, model: str | None = None,
                 draft: str | None = None, device: str | None = None, started: float | None = None):
        self.id, self.command, self.model, self.draft, self.device = sid, command, model, draft, device
        self.drafts: list[str] = [draft] if draft else []
        self.started = started
        self.last = started
        self.finish: str | None = None  # the last step's "eos", "stop" or "length" (add)
        self.replies = 0  # prefill steps: one per reply
        self.prefill_s = 0.0
        self.new_tokens = 0  # every token generated, each reply's first (the prefill's) included
        self.steps = 0  # target forward passes after prefill
        self.tokens = 0  # generated by decoding steps (after each reply's first token)
        self.accepted = 0  # accepted drafted tokens that were emitted (at most the step's tokens)
        self.proposed = 0
        self.decode_s = 0.0  # time of the decoding steps (draft + verify)
        self.draft_s = 0.0
        self.verify_s = 0.0
        self.depth_tries: list[int] = []  # depth_tries[d-1]: steps whose tree reached depth d
        self.depth_hits: list[int] = []  # depth_hits[d-1]: steps whose accepted path reached depth d
        self.hist: list[int] = []  # hist[a]: steps that accepted a drafted tokens
        self.plain_verify = deque(maxlen=PLAIN_SAMPLES)  # verify times of steps that verified no drafted token

    def note_draft(self, draft: str | None):
        if draft:
            self.draft = draft
            if draft not in self.drafts:
                self.drafts.append(draft)

    def add(self, ev):
        """Add one step as the engine yields it (a StepEvent), its times unrounded."""
        self.finish = ev.finish or self.finish
        self._count(len(ev.tokens), ev.accepted, ev.proposed, ev.tree_depth, ev.elapsed_s, ev.draft_s, ev.verify_s,
                    ev.prefill)

    def add_record(self, rec: dict):
        """Add one step record (a dict as StatsWriter writes it); ValueError if it is not a valid one."""
        tokens = _count(rec, "tokens")
        accepted = _count(rec, "accepted", 0)
        proposed = _count(rec, "proposed", 0)
        depth = _count(rec, "depth", 0)
        elapsed = _seconds(rec, "elapsed_s")
        draft_s = _seconds(rec, "draft_s", 0.0)
        verify_s = _seconds(rec, "verify_s", 0.0)
        if depth > 4096 or accepted > 4096:
            raise ValueError("depth")
        t = rec.get("t")
        if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t):
            self.last = max(self.last or t, t)
            self.started = min(self.started or t, t)
        if self.model is None:
            self.model = _text(rec, "model")
        self.note_draft(_text(rec, "draft"))
        self._count(tokens, accepted, proposed, depth, elapsed, draft_s, verify_s, rec.get("prefill") is True)

    def _count(self, tokens: int, accepted: int, proposed: int, depth: int, elapsed: float, draft_s: float,
               verify_s: float, prefill: bool):
        self.new_tokens += tokens
        if prefill:
            self.replies += 1
            self.prefill_s += elapsed
            return
        self.steps += 1
        self.tokens += tokens
        self.accepted += min(accepted, tokens)
        self.proposed += proposed
        self.decode_s += elapsed
        self.draft_s += draft_s
        self.verify_s += verify_s
        while len(self.depth_tries) < depth:
            self.depth_tries.append(0)
            self.depth_hits.append(0)
        for d in range(1, depth + 1):
            self.depth_tries[d - 1] += 1
            self.depth_hits[d - 1] += accepted >= d
        while len(self.hist) <= accepted:
            self.hist.append(0)
        self.hist[accepted] += 1
        if proposed == 0 and verify_s > 0:
            self.plain_verify.append(verify_s)

    # figures (see the module docstring)
    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.tokens if self.tokens else None

    @property
    def tau(self) -> float | None:
        """Mean tokens per target forward after prefill (accepted drafted tokens + the target's own)."""
        return self.tokens / self.steps if self.steps else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.decode_s if self.decode_s > 0 else None

    @property
    def hit_rates(self) -> list[float]:
        return [h / t if t else 0.0 for h, t in zip(self.depth_hits, self.depth_tries)]

    @property
    def plain_step_s(self) -> float | None:
        if len(self.plain_verify) < MIN_PLAIN_STEPS:
            return None
        return statistics.median(self.plain_verify)

    @property
    def plain_equivalent_s(self) -> float | None:
        """What plain decoding would have taken for this session's generated tokens (None: no estimate)."""
        t = self.plain_step_s
        return None if t is None else self.tokens * t

    @property
    def speedup(self) -> float | None:
        plain = self.plain_equivalent_s
        if plain is None or self.decode_s <= 0:
            return None
        return plain / self.decode_s

    def summary(self) -> dict:
        def r(x, n=4):
            return None if x is None else round(x, n)

        return {
            "session": self.id or None,
            "command": self.command,
            "model": self.model,
            "draft": self.draft,
            "drafts": list(self.drafts),
            "device": self.device,
            "started": self.started,
            "last": self.last,
            "replies": self.replies,
            "steps": self.steps,
            "tokens": self.tokens,
            "accepted": self.accepted,
            "proposed": self.proposed,
            "acceptance_rate": r(self.acceptance_rate),
            "tau": r(self.tau),
            "tokens_per_s": r(self.tokens_per_s, 3),
            "plain_step_s": r(self.plain_step_s, 6),
            "speedup": r(self.speedup, 3),
            "hit_rate_by_depth": [round(x, 4) for x in self.hit_rates],
            "accepted_hist": list(self.hist),
            "decode_s": round(self.decode_s, 6),
            "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6),
            "prefill_s": round(self.prefill_s, 6),
        }


def merge(parts: list[Stats]) -> dict:
    """Overall figures: sums of the sessions' counts. The speedup is over the sessions that have an estimate:
    their plain-decoding-equivalent time over their measured time."""
    total = Stats()
    for s in parts:
        total.replies += s.replies
        total.prefill_s += s.prefill_s
        total.steps += s.steps
        total.tokens += s.tokens
        total.accepted += s.accepted
        total.proposed += s.proposed
        total.new_tokens += s.new_tokens
        total.decode_s += s.decode_s
        total.draft_s += s.draft_s
        total.verify_s += s.verify_s
        for name, src in (("depth_tries", s.depth_tries), ("depth_hits", s.depth_hits), ("hist", s.hist)):
            dst = getattr(total, name)
            while len(dst) < len(src):
                dst.append(0)
            for i, v in enumerate(src):
                dst[i] += v
        for d in s.drafts:
            total.note_draft(d)
    out = total.summary()
    plain = [(s.plain_equivalent_s, s.decode_s) for s in parts if s.plain_equivalent_s is not None]
    spent = sum(e for _, e in plain)
    out["speedup"] = round(sum(p for p, _ in plain) / spent, 3) if spent > 0 else None
    out["plain_step_s"] = None
    for key in ("session", "command", "model", "draft", "device", "started", "last"):
        out.pop(key)
    out["sessions"] = len(parts)
    return out


class Aggregate:
    """Everything read from a stream so far, by session; foreign or broken lines are counted in `skipped`."""

    def __init__(self):
        self.sessions: dict[str, Stats] = {}
        self.lines = 0
        self.skipped = 0

    def feed(self, line: bytes | str):
        self.lines += 1
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not an object")
            sid = rec.get("session")
            if not isinstance(sid, str) or not sid or len(sid) > 64:
                raise ValueError("session")
            kind = rec.get("kind")
            if kind == "session":
                s = self._get(sid)
                s.command = _text(rec, "command") or s.command
                s.model = _text(rec, "model") or s.model
                s.device = _text(rec, "device") or s.device
                s.note_draft(_text(rec, "draft"))
                t = rec.get("t")
                if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t):
                    s.started = t if s.started is None else min(s.started, t)
                    s.last = t if s.last is None else max(s.last, t)
            elif kind == "step":
                s = self.sessions.get(sid)
                fresh = s is None
                if fresh:
                    s = Stats(sid)
                s.add_record(rec)  # validates before it changes anything
                if fresh:
                    self.sessions[sid] = s
            else:
                raise ValueError("kind")
        except (ValueError, TypeError, RecursionError):  # json.JSONDecodeError and UnicodeDecodeError included
            self.skipped += 1

    def _get(self, sid: str) -> Stats:
        if sid not in self.sessions:
            self.sessions[sid] = Stats(sid)
        return self.sessions[sid]

    def select(self, session: str | None) -> list[Stats]:
        if not session:
            return list(self.sessions.values())
        return [s for sid, s in self.sessions.items() if sid.startswith(session)]

    def snapshot(self, path: Path | None = None, session: str | None = None) -> dict:
        chosen = self.select(session)
        snap = merge(chosen)
        snap = {"stats_file": str(path) if path else None, "lines": self.lines, "skipped_lines": self.skipped,
                **snap, "by_session": [s.summary() for s in sorted(chosen, key=lambda s: s.started or 0)]}
        return snap


class Follower:
    """Reads whole new lines from a file that others append to, across rotation (rename) and truncation."""

    def __init__(self, path: Path):
        self.path = path
        self.f = None
        self.ino = None
        self.buf = b""
        self.discard = False  # inside an over-long line: drop until its end
        self.broken = 0  # over-long and unfinished lines

    def _open(self) -> bool:
        try:
            self.f = open(self.path, "rb")
        except OSError:
            self.f = None
            return False
        self.ino = os.fstat(self.f.fileno()).st_ino
        self.buf, self.discard = b"", False
        return True

    def _drain(self) -> list[bytes]:
        out = []
        while True:
            data = self.f.read(1 << 20)
            if not data:
                return out
            self.buf += data
            *lines, self.buf = self.buf.split(b"\n")
            for line in lines:
                if self.discard:
                    self.discard = False
                    continue
                if len(line) > MAX_LINE:
                    self.broken += 1
                elif line.strip():
                    out.append(line)
            if len(self.buf) > MAX_LINE:
                self.buf, self.discard = b"", True
                self.broken += 1

    def _finish(self) -> list[bytes]:
        """The end of a file nobody will append to: an unfinished last line is a broken one."""
        out = self._drain()
        if self.buf.strip() and not self.discard:
            out.append(self.buf)
        self.buf = b""
        self.f.close()
        self.f = None
        return out

    def poll(self) -> list[bytes]:
        """New complete lines since the last call."""
        if self.f is None and not self._open():
            return []
        out = self._drain()
        try:
            st = os.stat(self.path)
        except OSError:
            st = None
        if st is None or st.st_ino != self.ino:  # rotated (or removed): finish the old file, go on with the new
            out += self._finish()
            if st is not None and self._open():
                out += self._drain()
        elif st.st_size < self.f.tell():  # truncated in place
            self.f.seek(0)
            self.buf, self.discard = b"", False
            out += self._drain()
        return out

    def close(self, final: bool = True) -> list[bytes]:
        if self.f is None:
            return []
        return self._finish() if final else []


def read_all(path: Path, agg: "Aggregate | None" = None) -> list[bytes]:
    """Every line of a file as it stands, an unfinished last line included (it counts as a broken one when it
    does not parse). With `agg`, the lines are fed to it, and over-long ones counted as skipped."""
    f = Follower(path)
    lines = f._finish() if f._open() else []
    if agg is not None:
        for line in lines:
            agg.feed(line)
        agg.lines += f.broken
        agg.skipped += f.broken
    return lines
