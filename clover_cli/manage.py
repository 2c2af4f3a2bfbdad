"""What clover keeps on disk, listed and removed: `clover list`, `clover rm`, `clover ps`, and the pruning of the
compile cache after each build.

Every path comes from store.py. An entry (`Entry`) is one thing a user can remove: a Hub repository in the Hugging
Face cache (a model, or draft heads), a converted GGUF model, a GGUF written for llama.cpp (bench), a file fetched
from a package index, a compiled package (a model's step, or heads' programs), or one of clover's smaller caches
(step costs, learned choices, kernels).

Last use: a compiled package's is its last-used stamp, touched each time a session loads it (inuse.py; before its
first load, when it was built); any other entry's is the newest modification or access time of its files (access
times as the file system keeps them: with Linux's default relatime, at least once a day).

Removal never leaves the caches: each path's folder must lie inside clover's cache or the Hub's (their real paths),
a symbolic link is removed as a link (never what it points to), a folder is renamed aside and then removed without
following the links inside it. What a session uses is refused: a compiled package it loaded (inuse.py), one being
built (its build lock), a model a registered session runs (running.py), a download or conversion under way (its
lock).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import store
from .errors import CloverError
from .inuse import Claim, last_used
from .options import env

COMPILED = ("compiled", "compiled-heads")
MODELS = ("model", "heads", "gguf", "package")
KEY_PREFIX = re.compile(r"(.+?)-[0-9a-f]{20}(?=-|\.json$|$)")  # a package key's model part (store.package_key)
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

def _scan(path: Path) -> tuple[int, float | None]:
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


def _children(root: Path) -> list[Path]:
    """The entries of a cache folder, by name, without the dot-named (temporary files, a build under way)."""
    try:
        return sorted((p for p in Path(root).iterdir() if not p.name.startswith(".")), key=lambda p: p.name)
    except OSError:
        return []


def _hub_entries() -> list[Entry]:
    from .aliases import ALIASES

    heads_repos = {repo for spec in ALIASES.values() for _, repo in spec.heads}
    root = store.hf_cache_root()
    out = []
    for d in _children(root):
        if not d.name.startswith("models--") or d.is_symlink() or not d.is_dir():
            continue
        repo = d.name[len("models--"):].replace("--", "/")
        snapshots = [s for s in _children(d / "snapshots") if s.is_dir()]
        kind = "heads" if repo in heads_repos or any(_heads_config(s) for s in snapshots) else "model"
        locks = root / ".locks" / d.name
        entry = Entry(kind, repo, [d] + ([locks] if locks.is_dir() and not locks.is_symlink() else []),
                      *_scan(d), keys=tuple(s.name[:40] for s in snapshots))
        entry.locks = sorted(locks.glob("*.lock")) if locks.is_dir() else []
        out.append(entry)
    return out


def _heads_config(snapshot: Path) -> bool:
    """Whether a snapshot's config.json is draft heads' (clover's own: an "architecture", no transformers
    model_type)."""
    try:
        config = json.loads((snapshot / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(config, dict) and "model_type" not in config and isinstance(config.get("architecture"), str)


def _gguf_entries() -> list[Entry]:
    from .gguf_model import source_of

    out = []
    for p in _children(store.gguf_cache_root()):
        if p.is_symlink():
            continue
        if p.is_dir():
            record = source_of(p) or {}
            of = record.get("gguf") if isinstance(record.get("gguf"), str) else None
            out.append(Entry("gguf", p.name, [p], *_scan(p), of=of and Path(of).name, keys=(p.name[:40],),
                             locks=[store.lock_path(p.name, make=False)], source=of))
        elif p.suffix == ".gguf":
            out.append(Entry("export", p.name, [p], *_scan(p), of="GGUF for llama.cpp (bench)"))
    return out


def _package_entries() -> list[Entry]:
    from .aliases import ALIASES

    known = {spec.package.sha256[:20]: spec for spec in ALIASES.values() if spec.package is not None}
    out = []
    for d in _children(store.packages_root()):
        if d.is_symlink() or not d.is_dir():
            continue
        spec = known.get(d.name)
        files = [f.name for f in _children(d) if f.is_file()]
        name = spec.package.package if spec is not None else (files[0] if files else d.name)
        out.append(Entry("package", name, [d], *_scan(d), of=spec.alias if spec is not None else None,
                         locks=[store.lock_path(f"package-{d.name}", make=False)], sha=d.name))
    return out


def key_prefix(name: str) -> str:
    """The model part of a compile cache file's name (store.package_key: the model directory's name, 40 characters
    at most), or the name itself."""
    m = KEY_PREFIX.match(name)
    return m.group(1) if m else name


def compiled_entries() -> list[Entry]:
    """The compiled packages (steps and heads' programs) in the compile cache."""
    root = store.cache_root()
    out = []
    for d in _children(root):
        if d.is_symlink() or not d.is_dir() or d.name in store.COMPILE_SUBDIRS:
            continue
        step, sep, _ = d.name.rpartition("-heads-")
        log = d.with_name(d.name + ".log")
        size, _ = _scan(d)
        out.append(Entry("compiled-heads" if sep else "compiled", d.name,
                         [d] + ([log] if log.is_file() and not log.is_symlink() else []), size,
                         last_used(d), of=key_prefix(step if sep else d.name)))
    return out


def _cache_entries() -> list[Entry]:
    """clover's smaller caches, each as a whole: the step costs and learned choices, early stops, self-draft
    choices, the built kernels, the index of GGUF hashes, logs of builds whose package is gone."""
    root = store.cache_root()
    places = [(f"compiled/{name}", root / name) for name in store.COMPILE_SUBDIRS]
    places += [("kernels", store.kernels_dir()), ("gguf/hashes.json", store.gguf_cache_root() / "hashes.json")]
    out = [Entry("cache", name, [p], *_scan(p)) for name, p in places if p.exists() and not p.is_symlink()]
    logs = [p for p in _children(root) if p.suffix == ".log" and p.is_file() and not p.with_suffix("").is_dir()]
    if logs:
        scans = [_scan(p) for p in logs]
        out.append(Entry("cache", "compiled/logs", logs, sum(s for s, _ in scans),
                         max((t for _, t in scans if t is not None), default=None)))
    return out


def scan() -> list[Entry]:
    """Everything clover can list and remove, models first."""
    entries = _hub_entries() + _gguf_entries() + _package_entries()
    owners = {key: e.name for e in entries for key in e.keys}
    from .aliases import ALIASES, BUNDLED

    for spec in ALIASES.values():
        if spec.repo is None:
            owners.setdefault(BUNDLED.name, spec.alias)
    compiled = compiled_entries()
    for e in compiled:
        e.of = owners.get(e.of, e.of)
    return entries + compiled + _cache_entries()


def roots() -> list[Path]:
    """The folders removal stays inside: clover's caches and the Hub's."""
    from .stats import cache_dir

    return [cache_dir(), store.cache_root(), store.gguf_cache_root(), store.kernels_dir(), store.packages_root(),
            store.hf_cache_root()]


# ---------------------------------------------------------------------------------------------------------------
# Choosing what `clover rm` removes

def select(model: str, entries: list[Entry]) -> list[Entry]:
    """The entries of `model` (an alias, a Hub repo id, optionally hf.co/-prefixed and with :FILE or :QUANT, or a
    name `clover list` shows): its files, its converted copies and its compiled programs. Raises CloverError (exit
    2) when nothing is known by that name."""
    from .aliases import ALIASES, BUNDLED

    chosen: list[Entry] = []
    keys: set[str] = set()
    spec = ALIASES.get(model)
    repo = model
    for prefix in ("https://huggingface.co/", "huggingface.co/", "hf.co/"):
        repo = repo.removeprefix(prefix)
    repo = repo.split(":", 1)[0]
    if spec is not None:
        repo = spec.repo or ""
        if spec.repo is None:
            keys.add(BUNDLED.name)
    sha = spec.package.sha256[:20] if spec is not None and spec.package is not None else None
    for e in entries:
        if e.name in (model, repo) and e.kind not in COMPILED or (sha and e.sha == sha) \
                or (sha and e.kind == "gguf" and e.name.startswith(f"{sha}-")):
            chosen.append(e)
    hub_dirs = [e.paths[0] for e in chosen if e.kind in ("model", "heads")]
    for e in entries:  # the conversions of a GGUF from a chosen Hub repo
        if e.kind == "gguf" and e not in chosen and e.source and any(_within(Path(e.source), d) for d in hub_dirs):
            chosen.append(e)
    for e in chosen:
        keys.update(e.keys)
    owned = [e for e in entries if e.kind in COMPILED and (e.name == model or e.of == model
                                                           or key_prefix(e.name) in keys)]
    chosen += [e for e in owned if e not in chosen]
    if keys:
        files = [f for sub in store.COMPILE_SUBDIRS for f in _children(store.cache_root() / sub)
                 if key_prefix(f.name) in keys and not f.is_dir()]
        if files:
            scans = [_scan(f) for f in files]
            chosen.append(Entry("cache", f"compiled/costs and choices of {model}", files,
                                sum(s for s, _ in scans), max((t for _, t in scans if t), default=None)))
    if not chosen:
        if spec is not None:
            return []
        raise CloverError(f"{model}: no such model in clover's or the Hub's cache (see `clover list`)")
    return chosen


def plan(model: str | None, compiled_only: bool, everything: bool) -> list[Entry]:
    if model is None and not everything:
        raise CloverError("clover rm: name a MODEL (see `clover list`), or --all")
    if model is not None and everything:
        raise CloverError("clover rm: --all removes everything (with --compiled: every compiled program); name no "
                          "MODEL with it")
    entries = scan()
    chosen = entries if model is None else select(model, entries)
    return [e for e in chosen if e.kind in COMPILED] if compiled_only else chosen


# ---------------------------------------------------------------------------------------------------------------
# Removing

def _within(path: Path, root: Path) -> bool:
    path, root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    return path == root or root in path.parents


def remove_path(path: Path, allowed: list[Path]) -> None:
    """Remove the file, link or folder `path`, which must lie in one of the folders `allowed` (by the real path of
    its parent, and not be one of them): a link is removed itself, never what it points to; a folder is first
    renamed aside (gone at once for every reader), then removed without following the links inside it."""
    path = Path(path)
    if path.name in ("", ".", "..") or not any(_within(path.parent, root) for root in allowed) \
            or any(_within(root, path) for root in allowed if not path.is_symlink()):
        raise CloverError(f"refusing to remove {path}: it is not inside clover's or the Hub's cache", code=1)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        aside = path.with_name(f".{path.name}.removing-{os.getpid()}")
        os.replace(path, aside)
        shutil.rmtree(aside)
    else:
        os.unlink(path)


class Busy(CloverError):
    def __init__(self, message: str):
        super().__init__(message, code=1)


def _hold(entry: Entry, sessions: list[dict], held: list) -> None:
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
    for s in sessions:
        if s.get("path") and any(_within(Path(s["path"]), p) for p in entry.paths):
            raise Busy(f"{entry.name} is in use by clover {s['command']} (pid {s['pid']}); not removed")


def remove(entries: list[Entry]) -> int:
    """Remove the entries, after checking that none is in use (else Busy, and nothing removed); the bytes freed."""
    from .running import sessions

    live = sessions()
    held: list = []
    allowed = roots()
    try:
        for e in entries:
            _hold(e, live, held)
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
            remove([e])
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


# ---------------------------------------------------------------------------------------------------------------
# What the commands print

def ago(t: float | None, now: float | None = None) -> str:
    if t is None:
        return "-"
    s = max(0.0, (time.time() if now is None else now) - t)
    if s < 3600:
        return f"{s / 60:.0f} min ago"
    if s < 86400:
        return f"{s / 3600:.0f} h ago"
    return f"{s / 86400:.0f} days ago"


def list_json(entries: list[Entry]) -> dict:
    from .stats import cache_dir

    return {"entries": [e.as_json() for e in entries], "total_bytes": sum(e.size for e in entries),
            "caches": {"clover": str(cache_dir()), "compiled": str(store.cache_root()),
                       "hub": str(store.hf_cache_root())},
            "last_used": "compiled: the last-used stamp a session touches when it loads the package (else its "
                         "build); others: the newest mtime or atime of their files"}


def show_list(json_out: bool) -> None:
    from .hub import human_size

    entries = scan()
    if json_out:
        print(json.dumps(list_json(entries), indent=1))
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title="clover list", box=box.SIMPLE_HEAD, pad_edge=False, show_footer=True,
                  caption="last used: a compiled package's last load by a session (or its build); anything else's "
                          "newest file modification or access. `clover rm NAME` removes one.")
    total = human_size(sum(e.size for e in entries))
    for col, footer in (("kind", "total"), ("name", f"{len(entries)} entries"), ("of", ""), ("size", total),
                        ("last used", "")):
        table.add_column(col, footer=footer, overflow="fold", justify="right" if col == "size" else "left")
    for e in entries:
        table.add_row(e.kind, e.name, e.of or "", human_size(e.size), ago(e.last_used))
    Console().print(table)


def interactive() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def remove_command(model: str | None, compiled_only: bool, everything: bool, yes: bool) -> None:
    from .hub import human_size

    entries = plan(model, compiled_only, everything)
    if not entries:
        what = (f"no compiled program of {model}" if compiled_only else f"nothing of {model}") if model else \
            ("no compiled program" if compiled_only else "nothing")
        print(f"clover: {what} is cached", file=sys.stderr)
        return
    total = human_size(sum(e.size for e in entries))
    if not yes:
        if not interactive():
            raise CloverError(f"clover rm would remove {len(entries)} entries ({total}); it asks first on a "
                              "terminal: pass --yes to remove them without asking")
        for e in entries:
            print(f"  {e.kind:15} {e.name}  {human_size(e.size)}")
        import typer

        if not typer.confirm(f"Remove these {len(entries)} entries ({total})?", default=False):
            print("clover: nothing removed", file=sys.stderr)
            return
    try:
        freed = remove(entries)
    except OSError as e:
        raise CloverError(f"cannot remove {e.filename or 'a cache entry'}: {e.strerror or e}", code=1)
    print(f"removed {len(entries)} entries, {human_size(freed)} freed")


def show_ps(json_out: bool) -> None:
    from .running import sessions, tokens

    found = sessions()
    counts = tokens(found)
    now = time.time()
    rows = [{"pid": s["pid"], "command": s["command"], "model": s["model"], "uptime_s": round(now - s["started"], 1),
             "tokens": counts.get(s.get("session") or "", 0) if s.get("stats") else None} for s in found]
    if json_out:
        print(json.dumps({"sessions": rows}, indent=1))
        return
    if not rows:
        print("no clover session is running")
        return
    print(f"{'pid':>8}  {'command':9} {'uptime':>9} {'tokens':>8}  model")
    for r in rows:
        up = r["uptime_s"]
        uptime = f"{up / 3600:.1f} h" if up >= 3600 else f"{up / 60:.0f} min" if up >= 60 else f"{up:.0f} s"
        print(f"{r['pid']:>8}  {r['command'] or '?':9} {uptime:>9} {'-' if r['tokens'] is None else r['tokens']:>8}  "
              f"{r['model']}")
