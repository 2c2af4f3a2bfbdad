"""Every file clover writes goes through here, with deliberate permission bits (the umask does not apply).

Whole files (weights, configs, model cards, checkpoints, caches, saved conversations, plots, GGUF) are written
atomically by `write_with` / `write_bytes` / `write_text`: the content goes to a temporary file in the same
directory, is flushed to disk, given its mode and renamed over the target, so a reader, or a process that crashes
half-way, never sees half a file; the temporary file is removed on any failure. A directory built as a whole (a
checkpoint, a compiled package) is built under `temp_dir(path)` and renamed into place.

Temporary names carry the writer's pid: `.<name>.clover-<pid>-<random>.tmp` (files) and `.<name>.clover-<pid>.tmp`
(directories). A writer killed before it could remove its own leaves one behind; the next write of the same name
removes those whose process is gone (`clean_stale`).

Streams that grow by appending (the stats stream, the chat history, a training run's regenerated replies) cannot
be renamed into place: `open_append` / `append` open them with O_APPEND and the mode asked for, tightening the
mode of an existing file of ours that is more open than that, and `append` writes each record in one call.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

TAG = "clover"


def write_with(path: Path, fill: Callable[[Path], None], mode: int = 0o644, make_parents: bool = True) -> Path:
    """Make `path` atomically from `fill(tmp)`, which writes the content to the temporary path `tmp` beside it (for
    writers that take a path: safetensors, torch.save, GGUF, matplotlib); then fsync, chmod to `mode`, rename over
    `path`. The temporary file is removed on any failure. Raises what `fill` raises, or OSError."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if make_parents:
        parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path)
    fd, name = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.{TAG}-{os.getpid()}-", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        fill(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _sync_dir(parent)
    return path


def write_bytes(path: Path, data: bytes, mode: int = 0o644, make_parents: bool = True) -> Path:
    """Write `data` to `path` atomically with permission bits `mode`. Raises OSError."""
    return write_with(path, lambda tmp: tmp.write_bytes(data), mode, make_parents)


def write_text(path: Path, text: str, mode: int = 0o644, make_parents: bool = True) -> Path:
    return write_bytes(path, text.encode("utf-8"), mode, make_parents)


def temp_dir(path: Path) -> Path:
    """The name of a directory this process builds beside `path` and renames over it (its pid is in the name, so
    that `clean_stale` can tell a crashed builder's leftovers from a live one's)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{TAG}-{os.getpid()}.tmp")


def clean_stale(path: Path) -> list[Path]:
    """Remove what writers of `path` that are gone left beside it (temporary files and directories named as above
    whose process no longer runs); returns what was removed."""
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.{TAG}-(\d+)(-[a-z0-9_]+)?\.tmp")
    parent = path.parent if str(path.parent) else Path(".")
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    removed = []
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or _alive(int(m.group(1))):
            continue
        tmp = parent / name
        try:
            shutil.rmtree(tmp) if tmp.is_dir() and not tmp.is_symlink() else tmp.unlink()
            removed.append(tmp)
        except OSError:
            pass  # another process removed it first, or it is not ours to remove
    return removed


def open_append(path: Path, mode: int = 0o600) -> int:
    """A file descriptor appending to `path` (created with `mode`; an existing file of ours with more permission bits
    than `mode` is tightened to `mode`). Raises OSError."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o777 & ~mode and st.st_uid == os.getuid():
            os.fchmod(fd, mode)
    except (OSError, AttributeError):  # another user's file (or no fchmod): left as it is
        pass
    return fd


def append(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Append `data` to `path` in one write (see `open_append`). Raises OSError."""
    fd = open_append(path, mode)
    try:
        view = memoryview(data)
        while view:  # one call for anything a pipe or a local file takes whole; the rest follows in order
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _sync_dir(path: Path) -> None:
    """Make a rename in `path` durable (best effort: not every platform can open a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
