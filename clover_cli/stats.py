"""The stats stream: per-step records that chat and generate append, and `clover stats`, which reads them.

Each record is one JSON line written with a single append (O_APPEND), so lines from concurrent sessions never
interleave; the file is private (0600) and is rotated to `<file>.1` when it grows past ROTATE_BYTES.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from .errors import CloverError

ROTATE_BYTES = 8 * 1024 * 1024


def default_path() -> Path:
    env = os.environ.get("CLOVER_STATS_FILE")
    if env:
        return Path(env).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "clover" / "stats.jsonl"


def stats_path(arg: str | None) -> Path | None:
    if arg == "off":
        return None
    return Path(arg).expanduser() if arg else default_path()


class StatsWriter:
    def __init__(self, path: Path):
        self.path = path

    @staticmethod
    def open(arg: str | None) -> "StatsWriter | None":
        path = stats_path(arg)
        if path is None:
            return None
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.close(fd)
        except OSError as e:
            if arg:
                raise CloverError(f"cannot write the stats file {path}: {e.strerror}")
            return None  # the default location is a convenience: never fail a chat over it
        return StatsWriter(path)

    def write(self, record: dict):
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        try:
            if self.path.exists() and self.path.stat().st_size + len(line) > ROTATE_BYTES:
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError:
            pass  # statistics must never interrupt a conversation

    def new_session(self, command: str, session) -> str:
        sid = uuid.uuid4().hex[:8]
        self.write({"kind": "session", "session": sid, "t": time.time(), "command": command, "pid": os.getpid(),
                    "model": session.resolved.name, "draft": session.draft_name, "device": str(session.device)})
        return sid

    def step(self, sid: str, ev, draft: str | None = None):
        rec = {"kind": "step", "session": sid, "t": round(time.time(), 3), "tokens": len(ev.tokens),
               "accepted": ev.accepted, "proposed": ev.proposed, "depth": ev.tree_depth,
               "elapsed_s": round(ev.elapsed_s, 6), "draft_s": round(ev.draft_s, 6),
               "verify_s": round(ev.verify_s, 6)}
        if ev.prefill:
            rec["prefill"] = True
        if draft:
            rec["draft"] = draft
        self.write(rec)


def run_stats(stats_file, once, json_out, session, interval):
    raise CloverError("clover stats is not available yet")
