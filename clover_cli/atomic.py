"""Every file clover writes goes through here, with deliberate permission bits (the umask does not apply), and so
does every path a user names for clover to write (`/save`, `--plot`, `--stats-file`, `--history-file`).

Whole files (weights, configs, model cards, checkpoints, caches, saved conversations, plots, GGUF) are written
atomically by `write_with` / `write_bytes` / `write_text`: the content goes to a temporary file in the same
directory, is flushed to disk, given its mode and renamed over the target, so a reader, or a process that crashes
half-way, never sees half a file; the temporary file is removed on any failure. Only a regular file or a new name is
replaced (`check_replace`): a device, a FIFO, a socket or a directory at the path is refused, and so is a symbolic
link, which is neither followed nor replaced (a link is not clover's to turn into a file, and a link followed could
lead anywhere: the user names the file it points to). A new file gets the mode asked for; an existing one keeps its
permission bits (and, where the system allows, its owner and group): clover changes the mode only of files it
creates. A directory built as a whole (a checkpoint, a compiled package) is built under `temp_dir(path)` and renamed
into place.

Temporary names carry the writer's pid: `.<name>.clover-<pid>-<random>.tmp` (files) and `.<name>.clover-<pid>.tmp`
(directories). A writer killed before it could remove its own leaves one behind; the next write of the same name
removes those whose process is gone (`clean_stale`).

Streams that grow by appending (the stats stream, the chat history, a training run's regenerated replies) cannot
be renamed into place: `open_append` / `append` open them with O_APPEND, and `append` writes each record in one
call. A file that is not there is created, exclusively (never through a symbolic link), with the mode asked for;
what is already there is never chmodded. What may be appended to (`check_appendable`, judged on the descriptor
opened, so what is checked is what is written): a regular file (also through a symbolic link: appending replaces
nothing), a FIFO or pipe, and the null device, which is how a user says "keep nothing". A directory, a block device,
a socket or any other device is refused, before it is opened where the path shows it. `check_append` judges a path
before a run starts (a model loads), creating nothing.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable

TAG = "clover"


class NotAFile(OSError):
    """What is at a path clover was asked to write is not something it writes (the reason, in one line, is the
    strerror: callers show `cannot save to PATH: {strerror}`)."""

    def __init__(self, reason: str, path):
        super().__init__(errno.EINVAL, reason, str(path))


_KINDS = [(stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]


def kind(st: os.stat_result) -> str:
    """What a stat result describes, in words ("a regular file", "a FIFO", ...)."""
    if stat.S_ISREG(st.st_mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(st.st_mode)), "not a file")


def check_replace(path) -> os.stat_result | None:
    """What `write_with` may replace at `path`: nothing (None: a new file) or a regular file (its lstat). Anything
    else raises NotAFile, a symbolic link too (not followed: `lstat` only, nothing is opened)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(st.st_mode):
        return st
    hint = ": name the file it points to" if stat.S_ISLNK(st.st_mode) else ""
    raise NotAFile(f"not a regular file ({kind(st)}{hint})", path)


def write_with(path: Path, fill: Callable[[Path], None], mode: int = 0o644, make_parents: bool = True) -> Path:
    """Make `path` atomically from `fill(tmp)`, which writes the content to the temporary path `tmp` beside it (for
    writers that take a path: safetensors, torch.save, GGUF, matplotlib); then fsync, give it its mode and rename it
    over `path`. `path` must be a new name or a regular file (`check_replace`, judged before the content is made and
    again just before the rename); a new file gets `mode`, an existing one keeps its permission bits and, where
    allowed, its owner. The temporary file is removed on any failure. Raises what `fill` raises, or OSError
    (NotAFile for a path that is not a regular file)."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if make_parents:
        parent.mkdir(parents=True, exist_ok=True)
    check_replace(path)  # before any work: a FIFO or a device is refused at once
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
        old = check_replace(path)  # again, as close to the rename as can be: what appeared meanwhile is kept too
        if old is None:
            os.chmod(tmp, mode)
        else:
            _keep_owner(tmp, old)
            os.chmod(tmp, stat.S_IMODE(old.st_mode) & 0o777)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _sync_dir(parent)
    return path


def _keep_owner(tmp: Path, old: os.stat_result) -> None:
    """Give the replacement the replaced file's owner and group where the system lets this process (root; or a
    group it is in); otherwise they stay this process's."""
    st = os.lstat(tmp)
    if (st.st_uid, st.st_gid) == (old.st_uid, old.st_gid) or not hasattr(os, "chown"):
        return
    for uid, gid in ((old.st_uid, old.st_gid), (-1, old.st_gid)):
        try:
            os.chown(tmp, uid, gid)
            return
        except OSError:
            continue


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


_APPEND = os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)


def _null_device() -> int | None:
    try:
        st = os.stat(os.devnull)
    except OSError:
        return None
    return st.st_rdev if stat.S_ISCHR(st.st_mode) else None


def check_appendable(st: os.stat_result, path) -> None:
    """Whether what `st` describes (a stat, or the fstat of an open descriptor) may be appended to: a regular file,
    a FIFO or pipe, or the null device. Raises IsADirectoryError for a directory, NotAFile for anything else (a
    block device, a socket, a character device other than the null device: a terminal, a disk, /dev/port)."""
    if stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode):
        return
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == _null_device():
        return
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
    raise NotAFile(f"not a file, a FIFO or {os.devnull} ({kind(st)})", path)


def check_append(path) -> None:
    """Judge `path` for `open_append` before a run starts, creating and opening nothing: what is there must be
    appendable (`check_appendable`) and writable; a new file needs a directory it can be made in (the nearest one
    that exists; `open_append` makes the rest). Raises OSError."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise NotAFile("a symbolic link to nothing", path) from None
        up = path.parent
        while not up.exists() and up != up.parent:
            up = up.parent
        if not up.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(up))
        if not os.access(up, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "Permission denied", str(up))
        return
    check_appendable(st, path)
    if not os.access(path, os.W_OK):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))


def open_append(path: Path, mode: int = 0o600) -> int:
    """A file descriptor appending to `path`. A new file is created exclusively (never through a symbolic link) and
    given `mode`; anything already there is checked (`check_appendable`) before it is opened and again on the open
    descriptor, and never chmodded. A FIFO nobody reads is refused rather than waited for. Raises OSError."""
    for _ in range(3):  # a file removed between the two opens below is made again
        try:
            fd = os.open(path, _APPEND | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            pass
        else:
            try:
                os.fchmod(fd, mode)  # made here: the mode asked for, whatever the umask
            except BaseException:
                os.close(fd)
                raise
            return fd
        try:
            check_appendable(os.stat(path), path)  # a device that is not the null device is not even opened
            fd = os.open(path, _APPEND | getattr(os, "O_NONBLOCK", 0))  # O_NONBLOCK: a FIFO with no reader fails
        except FileNotFoundError:
            if os.path.islink(path):
                raise NotAFile("a symbolic link to nothing", path) from None
            continue
        except OSError as e:
            if e.errno == errno.ENXIO:
                raise OSError(errno.ENXIO, "a FIFO that nothing reads", str(path)) from None
            raise
        try:
            check_appendable(os.fstat(fd), path)  # what was opened, whatever the path names by now
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise FileNotFoundError(errno.ENOENT, "No such file or directory (removed as it was opened)", str(path))


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
