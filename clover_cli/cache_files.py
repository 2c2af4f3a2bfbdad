"""The compile cache's packages, and removal that stays inside clover's and the Hub's caches: what `clover list`
and `clover rm` (manage.py) build on, and the pruning that each build runs (step/aot_build.py). Every path comes from
store.py.

Removal never leaves the caches: each path's folder must lie inside clover's cache or the Hub's (their real paths),
a symbolic link is removed as a link (never what it points to), a folder is renamed aside and then removed without
following the links inside it. What is in use is refused (Busy): a compiled package a session loaded (inuse.py), one
being built (its build lock), a model a registered session runs (running.py), a download or conversion under way
(its lock).

The compile cache is pruned after each build: packages unused for CLOVER_COMPILE_MAX_AGE days (30), then, oldest
first, those beyond CLOVER_COMPILE_MAX_SIZE GiB in all (5); never the one just built, one in use or one being built.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import store
from .errors import CloverError
from .inuse import Claim, last_used
from .options import env

COMPILED = ("compiled", "compiled-heads")
KEY_PREFIX = re.compile(r"(.+?)-[0-9a-f]{20}(?=-|\.json$|$)")  # a package key's model part (store.package_key)
# the names clover gives what it keeps (anything else in a cache folder is not listed, nor ever removed): a package
# (store.package_key, heads_dir), a converted GGUF (store.converted_dir), a package index file's folder
# (sources.PackageSource.path), a build of clover's kernels (clover_kernels.quant.load)
PACKAGE_NAME = re.compile(r".+-[0-9a-f]{20}(-heads-[0-9a-f]{12})?")
CONVERTED_NAME = re.compile(r"[0-9a-f]{20}-[a-z0-9]+")
SHA_NAME = re.compile(r"[0-9a-f]{20}")
KERNELS_NAME = re.compile(r"clover_quant_[0-9a-f]{16}")
GiB = 1 << 30


@dataclass
class Entry:
    kind: str  # model, heads (Hub repos), gguf (a converted GGUF), export (a GGUF for llama.cpp), package (from a
    # package index), compiled, compiled-heads, cache (clover's smaller caches)
    name: str  # what `clover list` shows and `clover rm` takes
    paths: list[Path]  # removed together
    size: int = 0
    last_used: float | None = None
    of: str | None = None  # what it belongs to: the model of a compiled package, the file of a converted GGUF
    keys: tuple[str, ...] = ()  # the names compiled packages of this model are keyed by (store.package_key's prefix)
    locks: list[Path] = field(default_factory=list)  # filelocks held while it is written (a download, a conversion)
    source: str | None = None  # a converted GGUF's file (a Hub repo's removal takes the conversions of its GGUFs)
    sha: str | None = None  # a package index file's folder name (its sha256's first 20 digits)

    def as_json(self) -> dict:
        return {"kind": self.kind, "name": self.name, "of": self.of, "bytes": self.size,
                "last_used": self.last_used, "paths": [str(p) for p in self.paths]}


# ---------------------------------------------------------------------------------------------------------------
# Walking the caches

def scan_path(path: Path) -> tuple[int, float | None]:
    """(bytes, newest of mtime and atime) of a file or folder, never following a symbolic link."""
    size, newest = 0, None
    try:
        st = os.lstat(path)
    except OSError:
        return 0, None
    if not stat.S_ISDIR(st.st_mode):
        return (st.st_size if stat.S_ISREG(st.st_mode) else 0), max(st.st_mtime, st.st_atime)
    for top, _dirs, files in os.walk(path):  # (os.walk does not follow links to folders)
        for name in files:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                size += st.st_size
                newest = max(newest or 0.0, st.st_mtime, st.st_atime)
    return size, newest


def children(root: Path) -> list[Path]:
    """The entries of a cache folder, by name, without the dot-named (temporary files, a build under way)."""
    try:
        return sorted((p for p in Path(root).iterdir() if not p.name.startswith(".")), key=lambda p: p.name)
    except OSError:
        return []


def key_prefix(name: str) -> str:
    """The model part of a compile cache file's name (store.package_key: the model directory's name, 40 characters
    at most), or the name itself."""
    m = KEY_PREFIX.match(name)
    return m.group(1) if m else name


def compiled_entries() -> list[Entry]:
    """The compiled packages (steps and heads' programs) in the compile cache: folders named as package keys that
    hold a meta.json as every build writes (another folder of such a name, in a cache folder shared with other
    files, is not clover's to list, remove or prune)."""
    root = store.cache_root()
    out = []
    for d in children(root):
        if d.is_symlink() or not d.is_dir() or not PACKAGE_NAME.fullmatch(d.name):
            continue
        meta = d / "meta.json"
        if meta.is_symlink() or not meta.is_file():
            continue
        step, sep, _ = d.name.rpartition("-heads-")
        log = d.with_name(d.name + ".log")
        size, _ = scan_path(d)
        out.append(Entry("compiled-heads" if sep else "compiled", d.name,
                         [d] + ([log] if log.is_file() and not log.is_symlink() else []), size,
                         last_used(d), of=key_prefix(step if sep else d.name)))
    return out


def roots() -> list[Path]:
    """The folders removal stays inside: clover's caches and the Hub's."""
    from .stats import cache_dir

    return [cache_dir(), store.cache_root(), store.gguf_cache_root(), store.kernels_dir(), store.packages_root(),
            store.hf_cache_root()]



# ---------------------------------------------------------------------------------------------------------------
# Removing

def within(path: Path, root: Path) -> bool:
    path, root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    return path == root or root in path.parents


def check_path(path: Path, allowed: list[Path]) -> None:
    """Raise CloverError unless `path` lies in one of the folders `allowed` (by the real path of its parent) and
    holds none of them."""
    path = Path(path)
    if path.name in ("", ".", "..") or not any(within(path.parent, root) for root in allowed) \
            or any(within(root, path) for root in allowed if not path.is_symlink()):
        raise CloverError(f"refusing to remove {path}: it is not inside clover's or the Hub's cache", code=1)


def sweep_removals(folder: Path) -> None:
    """Remove the `.NAME.removing-PID` folders in `folder` that a removal left when it failed or was killed midway
    (PID no longer running); a running removal's is left to it."""
    try:
        leftovers = [p for p in Path(folder).iterdir() if p.name.startswith(".") and ".removing-" in p.name]
    except OSError:
        return
    for p in leftovers:
        pid = p.name.rsplit(".removing-", 1)[1]
        if not pid.isdigit() or p.is_symlink() or not p.is_dir():
            continue
        if int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
                continue  # that removal is still running
            except ProcessLookupError:
                pass
            except OSError:  # another user's process: running
                continue
        shutil.rmtree(p, ignore_errors=True)


def remove_path(path: Path, allowed: list[Path]) -> None:
    """Remove the file, link or folder `path`, which must pass check_path: a link is removed itself, never what it
    points to; a folder is first renamed aside (gone at once for every reader), then removed without following the
    links inside it."""
    path = Path(path)
    check_path(path, allowed)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    sweep_removals(path.parent)
    if stat.S_ISDIR(st.st_mode):
        aside = path.with_name(f".{path.name}.removing-{os.getpid()}")
        shutil.rmtree(aside, ignore_errors=True)  # (this process's own, left by a removal that failed)
        os.replace(path, aside)
        shutil.rmtree(aside)
    else:
        os.unlink(path)


class Busy(CloverError):
    def __init__(self, message: str):
        super().__init__(message, code=1)


def hold_entry(entry: Entry, sessions: list[dict], held: list) -> None:
    """Take what keeps `entry` from being used while it is removed, or raise Busy naming what uses it."""
    from filelock import FileLock, Timeout

    if entry.kind in COMPILED:
        claim = Claim(entry.paths[0])
        held.append(claim)
        if not claim.ok:
            raise Busy(f"{entry.name} is in use by a running clover session (clover ps); not removed")
        entry.locks = [Path(f"{entry.paths[0]}.lock")]
    for lock_file in entry.locks:
        if not lock_file.exists():
            continue
        lock = FileLock(str(lock_file))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise Busy(f"{entry.name} is being written by another process (a build, download or conversion); "
                       f"not removed")
        except OSError:
            continue
        held.append(lock)
    for s in sessions:  # its target, and the heads or draft model it loaded beside it
        used = [u for u in (s.get("path"), *s.get("uses", ())) if u]
        if any(within(Path(u), p) for u in used for p in entry.paths):
            raise Busy(f"{entry.name} is in use by clover {s['command']} (pid {s['pid']}); not removed")


def remove_entries(entries: list[Entry], sessions: list[dict] = ()) -> int:
    """Remove the entries, after checking that every path is inside the caches and none is in use (else a CloverError
    or Busy, and nothing removed); the bytes freed. `sessions`: the running sessions (running.sessions())."""
    held: list = []
    allowed = roots()
    for e in entries:
        for p in e.paths:
            check_path(p, allowed)
    try:
        for e in entries:
            hold_entry(e, sessions, held)
        freed = 0
        for e in entries:
            for p in e.paths:
                remove_path(p, allowed)
            freed += e.size
        return freed
    finally:
        for h in held:
            (h.close if isinstance(h, Claim) else h.release)()


# ---------------------------------------------------------------------------------------------------------------
# Pruning the compile cache (after each build: step/aot_build.py)

def _limit(name: str, default: float, unit: float) -> float:
    """The limit in environment variable `name` (a number >= 0; 0: none), in `unit`s; a bad value warns once and
    keeps the default."""
    raw = env(name)
    if raw is None or raw.strip() == "":
        return default * unit
    try:
        value = float(raw)
        if not value >= 0 or value == float("inf"):
            raise ValueError
    except ValueError:
        store.cache_warning(f"{name}={raw[:40]!r} is not a number >= 0; using {default:g}")
        return default * unit
    return value * unit


def prune_compiled(keep=(), now: float | None = None, log=None) -> list[Path]:
    """Remove the compiled packages not used for CLOVER_COMPILE_MAX_AGE days (default 30), then, oldest first, those
    beyond CLOVER_COMPILE_MAX_SIZE GiB in all (default 5); never one in `keep` (the one just built), one a session
    uses or one being built. Returns what was removed."""
    now = time.time() if now is None else now
    max_age = _limit("CLOVER_COMPILE_MAX_AGE", 30, 86400.0)
    max_bytes = _limit("CLOVER_COMPILE_MAX_SIZE", 5, GiB)
    keep = {os.path.realpath(k) for k in keep if k is not None}
    packages = sorted(compiled_entries(), key=lambda e: e.last_used or 0.0)
    total = sum(e.size for e in packages)
    removed = []
    for e in packages:
        age = now - (e.last_used or 0.0)
        too_old = max_age > 0 and age > max_age
        too_big = max_bytes > 0 and total > max_bytes
        if not (too_old or too_big) or os.path.realpath(e.paths[0]) in keep:
            continue
        try:
            remove_entries([e])
        except CloverError:  # in use, being built, or not ours: kept
            continue
        except OSError:
            continue
        total -= e.size
        removed.append(e.paths[0])
        if log is not None:
            why = f"unused for {age / 86400:.0f} days" if too_old else "over the compile cache's size cap"
            log(f"removed the compiled package {e.name} ({why})")
    return removed


