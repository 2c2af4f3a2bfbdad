"""What clover keeps on disk, listed and removed, and the sessions running: `clover list`, `clover rm`, `clover ps`
(the compile cache's packages, removal and pruning: cache_files.py).

An entry (cache_files.Entry) is one thing a user can remove: a Hub repository in the Hugging Face cache (a model, or
draft heads), a converted GGUF model, a GGUF written for llama.cpp (bench), a file fetched from a package index, a
compiled package (a model's step, or heads' programs), or one of clover's smaller caches (step costs, learned
choices, kernels).

Last use: a compiled package's is its last-used stamp, touched each time a session loads it (inuse.py; before its
first load, when it was built); any other entry's is the newest modification or access time of its files (access
times as the file system keeps them: with Linux's default relatime, at least once a day).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from . import store
from .cache_files import (COMPILED, CONVERTED_NAME, KERNELS_NAME, SHA_NAME, Entry, children, compiled_entries,
                          key_prefix, remove_entries, scan_path, within)
from .errors import CloverError


# ---------------------------------------------------------------------------------------------------------------
# Walking the caches

def _hub_entries() -> list[Entry]:
    from .aliases import ALIASES

    heads_repos = {repo for spec in ALIASES.values() for _, repo in spec.heads}
    root = store.hf_cache_root()
    out = []
    for d in children(root):
        if not d.name.startswith("models--") or d.is_symlink() or not d.is_dir():
            continue
        repo = d.name[len("models--"):].replace("--", "/")
        snapshots = [s for s in children(d / "snapshots") if s.is_dir()]
        kind = "heads" if repo in heads_repos or any(_heads_config(s) for s in snapshots) else "model"
        locks = root / ".locks" / d.name  # (left: a lock file outlives its use, see store.lock_path)
        out.append(Entry(kind, repo, [d], *scan_path(d), keys=tuple(s.name[:40] for s in snapshots),
                         locks=sorted(locks.glob("*.lock")) if locks.is_dir() and not locks.is_symlink() else []))
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
    for p in children(store.gguf_cache_root()):
        if p.is_symlink():
            continue
        if p.is_dir() and CONVERTED_NAME.fullmatch(p.name):
            record = source_of(p) or {}
            of = record.get("gguf") if isinstance(record.get("gguf"), str) else None
            out.append(Entry("gguf", p.name, [p], *scan_path(p), of=of and Path(of).name, keys=(p.name[:40],),
                             locks=[store.lock_path(p.name, make=False)], source=of))
        elif p.suffix == ".gguf" and p.is_file():
            out.append(Entry("export", p.name, [p], *scan_path(p), of="GGUF for llama.cpp (bench)"))
    return out


def _package_entries() -> list[Entry]:
    from .aliases import ALIASES

    known = {spec.package.sha256[:20]: spec for spec in ALIASES.values() if spec.package is not None}
    out = []
    for d in children(store.packages_root()):
        if d.is_symlink() or not d.is_dir() or not SHA_NAME.fullmatch(d.name):
            continue
        spec = known.get(d.name)
        files = [f.name for f in children(d) if f.is_file()]
        name = spec.package.package if spec is not None else (files[0] if files else d.name)
        out.append(Entry("package", name, [d], *scan_path(d), of=spec.alias if spec is not None else None,
                         locks=[store.lock_path(f"package-{d.name}", make=False)], sha=d.name))
    return out


def _cache_entries() -> list[Entry]:
    """clover's smaller caches, each as a whole: the step costs and learned choices, early stops, self-draft
    choices, the built kernels, the index of GGUF hashes, logs of builds whose package is gone."""
    root = store.cache_root()
    places = [(f"compiled/{name}", root / name) for name in store.COMPILE_SUBDIRS]
    places.append(("gguf/hashes.json", store.gguf_cache_root() / "hashes.json"))
    out = [Entry("cache", name, [p], *scan_path(p)) for name, p in places if p.exists() and not p.is_symlink()]
    kernels = store.kernels_dir()  # (its own folder may be a root, CLOVER_KERNEL_CACHE: its builds go, not it)
    inside = [p for p in children(kernels) if KERNELS_NAME.fullmatch(p.name)] if not kernels.is_symlink() else []
    if inside:
        scans = [scan_path(p) for p in inside]
        out.append(Entry("cache", "kernels", inside, sum(n for n, _ in scans),
                         max((t for _, t in scans if t is not None), default=None)))
    logs = [p for p in children(root) if p.suffix == ".log" and p.is_file() and not p.with_suffix("").is_dir()]
    if logs:
        scans = [scan_path(p) for p in logs]
        out.append(Entry("cache", "compiled/logs", logs, sum(s for s, _ in scans),
                         max((t for _, t in scans if t is not None), default=None)))
    return out


def scan() -> list[Entry]:
    """Everything clover can list and remove, models first."""
    from .aliases import ALIASES, BUNDLED

    entries = _hub_entries() + _gguf_entries() + _package_entries()
    owners = {key: e.name for e in entries for key in e.keys}
    for spec in ALIASES.values():
        if spec.repo is None:
            owners.setdefault(BUNDLED.name, spec.alias)
    compiled = compiled_entries()
    for e in compiled:
        e.of = owners.get(e.of, e.of)
    return entries + compiled + _cache_entries()


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
        if e.kind == "gguf" and e not in chosen and e.source and any(within(Path(e.source), d) for d in hub_dirs):
            chosen.append(e)
    for e in chosen:
        keys.update(e.keys)
    owned = [e for e in entries if e.kind in COMPILED and (e.name == model or e.of == model
                                                           or key_prefix(e.name) in keys)]
    chosen += [e for e in owned if e not in chosen]
    if keys:
        files = [f for sub in store.COMPILE_SUBDIRS for f in children(store.cache_root() / sub)
                 if key_prefix(f.name) in keys and not f.is_dir()]
        if files:
            scans = [scan_path(f) for f in files]
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
    from .running import sessions

    try:
        freed = remove_entries(entries, sessions())
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
