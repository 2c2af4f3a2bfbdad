"""Whether a compiled package is in use, and when it was last used.

A session that loads a package (the target's step, a draft model's step, the heads' programs) holds a shared lock
(flock) on the package's directory for as long as it runs, and touches the package's last-used stamp
(store.LAST_USED). `clover rm` and the pruning of the compile cache (manage.py) take the exclusive lock before they
remove a package: while any session holds it, the package is in use and left alone. The system drops a lock when its
process dies, so a lock is never stale. Where flock is missing (not a POSIX system) nothing is held and nothing
counts as in use.
"""

from __future__ import annotations

import os
from pathlib import Path

from .store import LAST_USED

try:
    import fcntl
except ImportError:  # pragma: no cover - not a POSIX system
    fcntl = None

_HELD: dict[str, int] = {}  # package directory -> the descriptor holding its shared lock, for the process's life


def _open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))


def hold(path: Path) -> None:
    """Mark the package in `path` used now (its stamp) and in use by this process until it ends. Never raises: a
    package whose stamp or lock cannot be had is only less protected."""
    path = Path(path)
    try:
        with open(path / LAST_USED, "w"):  # not atomic: an empty stamp, only its time is read
            pass
        os.utime(path / LAST_USED)
    except OSError:
        pass
    key = str(path.absolute())
    if fcntl is None or key in _HELD:
        return
    try:
        fd = _open_dir(path)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # being removed right now: loaded anyway (its files are open), not held
        os.close(fd)
        return
    _HELD[key] = fd


def release(path: Path) -> None:
    """Let go of the package in `path` (tests; a session keeps its packages to the end)."""
    fd = _HELD.pop(str(Path(path).absolute()), None)
    if fd is not None:
        os.close(fd)


class Claim:
    """The exclusive lock on a package directory, taken to remove it: `ok` is False while a session uses it."""

    def __init__(self, path: Path):
        self.fd, self.ok = None, True
        if fcntl is None or Path(path).is_symlink() or not Path(path).is_dir():
            return
        try:
            self.fd = _open_dir(Path(path))
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.ok = False
        except OSError:
            pass  # gone already, or not ours to lock: nothing to protect

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def in_use(path: Path) -> bool:
    """Whether a session holds the package in `path` now."""
    claim = Claim(path)
    claim.close()
    return not claim.ok


def last_used(path: Path) -> float | None:
    """When the package in `path` was last loaded (its stamp), else when it was built (its meta.json), else None."""
    for name in (LAST_USED, "meta.json"):
        try:
            return (Path(path) / name).stat().st_mtime
        except OSError:
            continue
    return None
