"""Files written whole or not at all: a temporary file in the same directory, renamed over the target."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_bytes(path: Path, data: bytes, mode: int = 0o644, make_parents: bool = True) -> Path:
    """Write `data` to `path` atomically with permission bits `mode` (the umask does not apply); the temporary file
    is removed on any failure. Raises OSError."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if make_parents:
        parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def write_text(path: Path, text: str, mode: int = 0o644, make_parents: bool = True) -> Path:
    return write_bytes(path, text.encode("utf-8"), mode, make_parents)
