"""The registry of running sessions (`clover ps`): each chat, generate or serve writes one small file,
store.sessions_dir()/<pid>.json, when its model is loaded, and removes it at exit.

    {"pid": .., "command": "chat", "model": .., "path": .., "started": .., "session": sid, "stats": .., "boot": ..}

`path` is the model's directory (what `clover rm` will not remove while a session runs it), `session` and `stats` the
session's id and stream in the stats stream (its tokens so far are counted from there; none when the stream is off),
`boot` the process's start time as the system tells it (Linux), so that a pid used again by another process is not
taken for the session. A process that ended without removing its file (killed) leaves a stale entry: skipped, and
removed when found.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path

from . import atomic
from .store import sessions_dir

_MINE: list[Path] = []


def _boot(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux's /proc), or None where unknown."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after the command name, which may hold spaces and parentheses
    return fields[19] if len(fields) > 19 else None


def alive(pid: int, boot: str | None = None) -> bool:
    """Whether process `pid` runs (and is the one that started at `boot`, when that is known)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    except OSError:
        return False
    return boot is None or _boot(pid) in (None, boot)


def register(command: str, session, sid: str | None, writer) -> None:
    """Note this process's session (never fails: a registry that cannot be written only hides it from ps)."""
    pid = os.getpid()
    uses = [getattr(session, name, None) for name in ("heads_path", "draft_model_path")]  # what it loaded beside
    entry = {"pid": pid, "command": command, "model": session.resolved.name,
             "path": str(Path(session.resolved.path).absolute()),
             "uses": [str(Path(p).absolute()) for p in uses if p is not None], "started": round(time.time(), 3),
             "session": sid, "stats": str(writer.path) if writer is not None else None, "boot": _boot(pid)}
    path = sessions_dir() / f"{pid}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path, json.dumps(entry) + "\n")
    except OSError:
        return
    if not _MINE:
        atexit.register(unregister)
    _MINE.append(path)


def unregister() -> None:
    while _MINE:
        try:
            _MINE.pop().unlink()
        except OSError:
            pass


def _entry(path: Path) -> dict | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("pid"), int) or isinstance(entry.get("pid"), bool) \
            or path.stem != str(entry["pid"]) or not isinstance(entry.get("started"), (int, float)):
        return None
    for key in ("command", "model", "path", "session", "stats", "boot"):
        if entry.get(key) is not None and not isinstance(entry[key], str):
            return None
    uses = entry.get("uses", [])
    if not isinstance(uses, list) or not all(isinstance(u, str) for u in uses):
        return None
    return entry


def sessions() -> list[dict]:
    """The running sessions' entries, oldest first; stale and damaged files are removed."""
    found = []
    try:
        files = sorted(sessions_dir().glob("*.json"))
    except OSError:
        return []
    for path in files:
        entry = _entry(path)
        if entry is None or not alive(entry["pid"], entry.get("boot")):
            try:
                path.unlink()
            except OSError:
                pass
            continue
        found.append(entry)
    return sorted(found, key=lambda e: e["started"])


def tokens(entries: list[dict]) -> dict[str, int]:
    """{session id: tokens generated so far} for the entries' sessions, counted in their stats streams."""
    wanted: dict[str, set] = {}
    for e in entries:
        if e.get("session") and e.get("stats"):
            wanted.setdefault(e["stats"], set()).add(e["session"])
    counts: dict[str, int] = {}
    for stream, sids in wanted.items():
        for path in (Path(stream + ".1"), Path(stream)):  # the rotated part first
            try:
                with open(path, "rb") as f:
                    lines = f.readlines()
            except OSError:
                continue
            for line in lines:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and rec.get("kind") == "step" and rec.get("session") in sids:
                    n = rec.get("tokens")
                    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
                        counts[rec["session"]] = counts.get(rec["session"], 0) + n
    return counts


def start_session(command: str, session, writer) -> str | None:
    """A session starting: its record in the stats stream (its id, or None when the stream is off) and its entry
    in the registry."""
    sid = writer.new_session(command, session) if writer is not None else None
    register(command, session, sid, writer)
    return sid
