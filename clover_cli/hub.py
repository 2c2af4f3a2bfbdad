"""Model names: aliases, local directories and Hugging Face Hub repositories, downloaded with huggingface_hub.

Downloads go to the standard cache (HF_HOME / HF_HUB_CACHE), honour HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE, resume
after an interruption (huggingface_hub keeps partial files), and fetch only safetensors weights, configs, tokenizer
and template files: a model's pickled `.bin` weights only with --allow-pickle. Heads repositories may hold pickled
weights (Medusa's `medusa_lm_head.pt`): those are fetched when the repository has no safetensors, and read
tensors-only (clover_cli/torchload.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from . import gguf_model, store
from .errors import CloverError
from .aliases import ALIASES, BUNDLED, FALLBACK_MODEL, ModelSpec, default_model
from .sources import SourceUnavailable

SAFE_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja", "README.md"]
PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth"]


@dataclass
class ResolvedModel:
    name: str  # what the user asked for (alias, repo id or path)
    path: Path  # a local directory with config.json
    spec: ModelSpec | None
    repo: str | None = None
    revision: str | None = None
    source: str = "a local directory"  # where the files came from, in words (clover models, download, banners)
    gguf: Path | None = None  # the GGUF file the directory was converted from


def looks_like_repo(name: str) -> bool:
    """org/name: the shape of a Hub repo id (a local path may have it too: check that first)."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def _offline() -> bool:
    from .sources import offline

    return offline()


def is_cached(repo: str, revision: str | None = None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        hit = try_to_load_from_cache(repo, "config.json", revision=revision)
    except Exception:
        return False
    return isinstance(hit, str)


def _silent_tqdm():
    """A tqdm class that draws nothing (no bars in logs, pipes or --json runs)."""
    from tqdm.auto import tqdm

    class SilentTqdm(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return SilentTqdm


def _rich_tqdm_class(progress):
    """A tqdm class for huggingface_hub that draws its byte counters on a rich Progress instead of the terminal."""
    from tqdm.auto import tqdm

    class RichTqdm(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True  # tqdm draws nothing; we keep the counts
            super().__init__(*args, **kwargs)
            self.count = kwargs.get("initial", 0) or 0
            desc = kwargs.get("desc") or ""
            self.task = None
            if kwargs.get("unit") == "B" and "Downloading" in desc:
                self.task = progress.add_task(desc, total=self.total or None, completed=self.count)

        def update(self, n=1):
            self.count += n or 0
            self.n = self.count  # huggingface_hub reads n to grow the total of its byte counter
            self.refresh()

        def refresh(self, *args, **kwargs):
            if self.task is not None:
                progress.update(self.task, completed=self.count, total=self.total or None)

    return RichTqdm


def _has_safetensors(repo: str, revision: str | None) -> bool:
    """Whether the repository holds safetensors weights (asked of the Hub; True when it cannot be asked, so that
    nothing pickled is fetched on a guess)."""
    from huggingface_hub import HfApi

    try:
        return any(f.endswith(".safetensors") for f in HfApi().list_repo_files(repo, revision=revision))
    except Exception:
        return True


def download(repo: str, revision: str | None = None, allow_pickle: bool = False, what: str = "model",
             quiet: bool = False, pickles_if_needed: bool = False, local_only: bool = False) -> Path:
    """Fetch a repository snapshot into the Hub cache (or find it there) and return its local path; with
    `local_only`, the cached snapshot without asking the Hub.

    Pickled weights are fetched with `allow_pickle`, or with `pickles_if_needed` when the repository has no
    safetensors (heads: read tensors-only)."""
    from huggingface_hub import snapshot_download

    if pickles_if_needed and not allow_pickle and not _offline():
        allow_pickle = not _has_safetensors(repo, revision)
    patterns = SAFE_PATTERNS + (PICKLE_PATTERNS if allow_pickle else [])

    def fetch(tqdm_class):
        return snapshot_download(repo, revision=revision, allow_patterns=patterns, tqdm_class=tqdm_class,
                                 local_files_only=local_only)

    try:
        if not local_only and not is_cached(repo, revision):
            _check_reachable()
        return Path(_with_progress(repo, fetch, quiet))
    except HubUnreachable as e:
        raise CloverError(f"{e}: cannot fetch {repo}, and no cached copy exists") from None
    except Exception as e:
        raise _hub_error(e, repo, revision, what) from None


_reachable: dict[str, str | None] = {}  # endpoint -> None (reachable) or why not, asked once per process


def _check_reachable() -> None:
    """Fail at once, in one line, when the Hub's host cannot be reached: huggingface_hub would retry a failed
    connection five times over ~23 s before giving up. Offline, or with a cached copy, nothing asks."""
    import logging
    import socket
    from urllib.parse import urlparse

    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # its retry warnings: the outcome is told once
    if _offline():
        return
    from urllib.request import getproxies, proxy_bypass

    from huggingface_hub import constants

    endpoint = constants.ENDPOINT
    url = urlparse(endpoint)
    proxies = getproxies()
    if (proxies.get(url.scheme) or proxies.get("all")) and not proxy_bypass(url.hostname or ""):
        return  # only the proxy knows whether the Hub can be reached: huggingface_hub goes through it and tells
    if endpoint not in _reachable:
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            socket.create_connection((url.hostname, port), timeout=5.0).close()
            _reachable[endpoint] = None
        except OSError as e:
            _reachable[endpoint] = f"{url.hostname}: {e.strerror or e}"
    if _reachable[endpoint] is not None:
        raise HubUnreachable(f"cannot reach the Hub ({_reachable[endpoint]})")


class HubUnreachable(CloverError):
    pass


def _with_progress(label: str, fetch, quiet: bool):
    """fetch(tqdm_class) with huggingface_hub's byte counters drawn as rich bars on a terminal, silent otherwise."""
    if quiet or not os.isatty(2):
        return fetch(_silent_tqdm())
    from .render import download_progress

    with download_progress(label) as progress:
        return fetch(_rich_tqdm_class(progress))


def _hub_error(e: Exception, repo: str, revision: str | None, what: str) -> Exception:
    """A huggingface_hub failure as one line (anything it does not explain is handed back as it is)."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError)

    rev = f" at revision {revision}" if revision else ""
    if isinstance(e, CloverError):
        return e
    if isinstance(e, GatedRepoError):
        return CloverError(f"{repo} is gated: accept its licence on the Hub and set HF_TOKEN")
    if isinstance(e, RevisionNotFoundError):
        return CloverError(f"{what} {repo} has no revision {revision!r}")
    if isinstance(e, RepositoryNotFoundError):
        return CloverError(f"{what} {repo}{rev} not found on the Hub (or it is private: set HF_TOKEN)")
    if isinstance(e, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        if _offline():
            return CloverError(f"{what} {repo}{rev} is not in the local cache and HF_HUB_OFFLINE is set")
        return CloverError(f"cannot reach the Hub to fetch {repo}{rev}, and no cached copy exists")
    if isinstance(e, HfHubHTTPError):
        return CloverError(f"the Hub refused {repo}{rev}: {str(e).splitlines()[0]}")
    if isinstance(e, OSError) or type(e).__module__.split(".")[0].startswith("httpx"):  # a connection failure
        return CloverError(f"could not fetch {repo}{rev}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    return e


def download_file(repo: str, filename: str, revision: str | None = None, quiet: bool = False) -> Path:
    """One file of a Hub repository (a GGUF), fetched into the Hub cache or found there, with a progress bar on a
    terminal. Raises CloverError in one line."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    def fetch(tqdm_class):
        return hf_hub_download(repo, filename, revision=revision, tqdm_class=tqdm_class)

    try:
        if not isinstance(try_to_load_from_cache(repo, filename, revision=revision), str):
            _check_reachable()
        return Path(_with_progress(f"{repo} {filename}", fetch, quiet))
    except HubUnreachable as e:
        raise CloverError(f"{e}: cannot fetch {repo} {filename}, and no cached copy exists") from None
    except EntryNotFoundError as e:
        if isinstance(e, LocalEntryNotFoundError):  # not on the Hub's answer: the cache's
            raise _hub_error(e, repo, revision, "model") from None
        raise CloverError(f"{repo} has no file {filename}") from None
    except Exception as e:
        raise _hub_error(e, repo, revision, "model") from None


def _repo_files(repo: str, revision: str | None) -> list[str]:
    """The file names of a Hub repository (asked of the Hub; offline, those of its cached snapshot)."""
    if _offline():
        from huggingface_hub import scan_cache_dir

        try:
            for cached in scan_cache_dir().repos:
                if cached.repo_id == repo:
                    return sorted({f.file_name for r in cached.revisions for f in r.files})
        except Exception:
            pass
        raise CloverError(f"{repo} is not in the local cache and HF_HUB_OFFLINE is set")
    from huggingface_hub import HfApi

    try:
        _check_reachable()
        return HfApi().list_repo_files(repo, revision=revision)
    except HubUnreachable as e:
        raise CloverError(f"{e}: cannot list the files of {repo}") from None
    except Exception as e:
        raise _hub_error(e, repo, revision, "model") from None


def check_weights(path: Path, name: str, allow_pickle: bool):
    if not (path / "config.json").is_file():
        raise CloverError(f"{name}: no config.json in {path}")
    if any(path.glob("*.safetensors")):
        return
    if allow_pickle and any(path.glob(p) for p in PICKLE_PATTERNS):
        return
    raise CloverError(f"{name} has no safetensors weights"
                      + ("" if allow_pickle else " (pickled .bin weights are loaded only with --allow-pickle)"))


def resolve_model(name: str | None, revision: str | None = None, allow_pickle: bool = False,
                  quiet: bool = False, dtype: str = "auto") -> ResolvedModel:
    """A local model directory for `name`: an alias (its sources in order), a directory (or one holding a GGUF),
    a GGUF file, a Hub repo id, or `REPO:FILE` / `REPO:QUANT` for a GGUF in a Hub repo. A GGUF is converted into
    clover's cache once (with `dtype` when it names a float type, else float32). No name: the default model, or
    the bundled one with one line when the default can be neither fetched nor found in the cache."""
    if name is None:
        chosen = default_model()
        try:
            return resolve_model(chosen, revision, allow_pickle, quiet, dtype)
        except SourceUnavailable as e:
            if chosen == FALLBACK_MODEL:
                raise
            print(f"clover: {e}: running the bundled {FALLBACK_MODEL!r} model instead", file=sys.stderr, flush=True)
            return resolve_model(FALLBACK_MODEL, None, allow_pickle, quiet, dtype)
    kind, what = classify(name)
    if kind == "alias":
        spec = what
        if spec.repo is None:
            if not (BUNDLED / "config.json").is_file():
                raise CloverError("the bundled model is missing from this installation (reinstall clover)")
            if revision:
                raise CloverError(f"--revision does not apply to the bundled model {name!r} (it has no Hub history)")
            return ResolvedModel(name, BUNDLED, spec, source="bundled with clover")
        if spec.package is None:
            path = download(spec.repo, revision, allow_pickle, quiet=quiet)
            check_weights(path, name, allow_pickle)
            return ResolvedModel(name, path, spec, spec.repo, revision, source=f"the Hub ({spec.repo})")
        return _resolve_sources(spec, revision, allow_pickle, quiet, dtype)
    if kind == "gguf":
        if len(what) > 1:
            raise CloverError(f"{name} holds {len(what)} GGUF files: name one ({', '.join(f.name for f in what)})")
        return _from_gguf(name, what[0], None, quiet, dtype, revision)
    if kind == "directory":
        check_weights(what, name, allow_pickle)
        return ResolvedModel(name, what, None)
    if kind == "hub-gguf":
        return _from_hub_gguf(name, *what, revision, quiet, dtype)
    if kind == "repo":
        path = download(what, revision, allow_pickle, quiet=quiet)
        check_weights(path, name, allow_pickle)
        return ResolvedModel(name, path, None, what, revision, source=f"the Hub ({what})")
    raise CloverError(what)


def classify(name: str):
    """What a MODEL name names, as (kind, what), without fetching or converting anything:
    ("alias", its ModelSpec); ("gguf", [the GGUF files]: a file by its name or magic bytes, or those of a folder
    without config.json; several: the user must name one); ("directory", its path); ("hub-gguf", (repo, FILE or
    QUANT)); ("repo", the Hub repo id); ("error", the one-line reason it names nothing)."""
    spec = ALIASES.get(name)
    if spec is not None:
        return "alias", spec
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            try:
                ggufs = sorted(f for f in local.iterdir() if gguf_model.is_gguf_name(f.name) and f.is_file())
            except OSError:
                ggufs = []  # a folder that cannot be listed: check_weights says why
            if ggufs:
                return "gguf", ggufs
        return "directory", local
    if local.exists():
        if gguf_model.is_gguf_name(local.name) or _starts_with_magic(local):
            return "gguf", [local]
        return "error", f"{name} is a file, not a model directory nor a GGUF file"
    bare = _strip_hub_prefix(name)
    repo, _, selector = bare.rpartition(":")
    if repo and selector and looks_like_repo(repo):
        return "hub-gguf", (repo, selector)
    if gguf_model.is_gguf_name(name):
        return "error", f"{name}: no such file"
    if looks_like_repo(bare):
        return "repo", bare
    return "error", (f"unknown model {name!r}: not an alias (see `clover models`), a directory, a GGUF file or a Hub "
                     f"repo id")


def is_gguf_source(name: str) -> bool:
    """Whether `name` names a GGUF the way resolve_model takes one: a file (by its name or its magic bytes), a folder
    holding GGUF files and no config.json, or `REPO:FILE.gguf` / `REPO:QUANT` on the Hub (aliases are not asked); a
    .gguf name that is not there too (resolve_model says so)."""
    kind, _ = classify(name)
    return kind in ("gguf", "hub-gguf") or (kind == "error" and gguf_model.is_gguf_name(name)
                                           and not Path(name).expanduser().exists())


def will_fetch(name: str | None, revision: str | None = None, dtype: str = "auto") -> bool:
    """Whether resolving `name` would download or convert something (and so draw progress of its own): what a chat
    does before its prompt comes up rather than behind it."""
    kind, what = classify(name or default_model())
    if kind == "alias":
        if what.repo is None or is_cached(what.repo, revision):
            return False
        cached = what.package.cached() if what.package is not None and revision is None else None
        return cached is None or not _is_converted(cached, dtype)
    if kind == "gguf":
        return len(what) == 1 and not _is_converted(what[0], dtype)
    if kind == "hub-gguf":
        return True
    return kind == "repo" and not is_cached(what, revision)


def _is_converted(file: Path, dtype: str) -> bool:
    try:
        return gguf_model.is_converted(store.converted_dir(store.content_hash(file), _gguf_dtype(dtype)))
    except (OSError, CloverError):
        return False


def disk_size(path: Path) -> int:
    """Bytes a file or directory holds on disk (a Hub snapshot's links counted as the files they point to)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    total = 0
    for f in path.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:
            pass
    return total


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def local_copy(spec: ModelSpec) -> str:
    """Where an alias's files are on this machine, and their size on disk, in words ('-': nowhere yet)."""
    if spec.repo is None:
        return f"bundled, {human_size(disk_size(BUNDLED))}" if (BUNDLED / "config.json").is_file() else "missing"
    if is_cached(spec.repo):
        from huggingface_hub import try_to_load_from_cache

        snapshot = Path(try_to_load_from_cache(spec.repo, "config.json")).parent
        return f"Hub cache, {human_size(disk_size(snapshot))}"
    file = spec.package.cached() if spec.package is not None else None
    if file is None:
        return "-"
    size = disk_size(file)
    converted = [d for d in store.gguf_cache_root().glob(f"{spec.package.sha256[:20]}-*") if gguf_model.is_converted(d)]
    size += sum(disk_size(d) for d in converted)
    return f"package index, {human_size(size)}" + (" with its conversion" if converted else "")


def _strip_hub_prefix(name: str) -> str:
    """Ollama's spelling of a Hub model, hf.co/OWNER/REPO[:QUANT], taken as OWNER/REPO[:QUANT]."""
    for prefix in ("https://huggingface.co/", "huggingface.co/", "hf.co/"):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _starts_with_magic(path: Path) -> bool:
    try:
        gguf_model.check_magic(path)  # (a FIFO or a device is not opened: a FIFO would wait for a writer)
        return True
    except CloverError:
        return False


def _gguf_dtype(dtype: str) -> str:
    """The float type a GGUF is dequantized to: the one asked for, else float32 (what the CPU runs)."""
    from .loading import DTYPES

    named = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
             "bfloat16": "bfloat16", "bf16": "bfloat16"}
    if dtype != "auto" and dtype not in DTYPES:
        raise CloverError(f"unknown dtype {dtype!r} (use auto, float32, float16 or bfloat16)")
    return named.get(dtype, "float32")


def _from_gguf(name: str, file: Path, spec: ModelSpec | None, quiet: bool, dtype: str, revision: str | None = None,
               source: str | None = None, repo: str | None = None) -> ResolvedModel:
    if revision and repo is None:
        raise CloverError(f"--revision does not apply to a local GGUF file ({name})")
    path = gguf_model.convert(file, _gguf_dtype(dtype), quiet=quiet)
    return ResolvedModel(name, path, spec, repo, revision, source=source or f"the GGUF file {file}", gguf=file)


def _from_hub_gguf(name: str, repo: str, selector: str, revision: str | None, quiet: bool,
                   dtype: str) -> ResolvedModel:
    """REPO:FILE.gguf, or REPO:QUANT (Ollama's tag: the one .gguf file of the repo whose name holds it)."""
    if gguf_model.is_gguf_name(selector):
        filename = selector
    else:
        names = _repo_files(repo, revision)
        ggufs = [f for f in names if gguf_model.is_gguf_name(f)]
        matches = [f for f in ggufs if selector.lower() in Path(f).name.lower()]
        if len(matches) != 1:
            some = ", ".join(Path(f).name for f in (matches or ggufs)[:8]) or "none"
            raise CloverError(f"{repo} has {len(matches) or 'no'} GGUF file{'s' if len(matches) != 1 else ''} "
                              f"matching {selector!r} (its GGUF files: {some}); name one as {repo}:FILE.gguf")
        filename = matches[0]
    file = download_file(repo, filename, revision, quiet=quiet)
    return _from_gguf(name, file, None, quiet, dtype, revision, source=f"the Hub ({repo}, {filename})", repo=repo)


def _resolve_sources(spec: ModelSpec, revision: str | None, allow_pickle: bool, quiet: bool,
                     dtype: str) -> ResolvedModel:
    """An alias with several sources: whichever is already cached (in order) without any network; else each in
    order, saying in one line why one could not give the files before the next is tried."""
    name, package = spec.alias, spec.package
    if is_cached(spec.repo, revision):
        try:  # no network: the cache's copy as it is (a partial one falls through to the sources below)
            path = download(spec.repo, revision, allow_pickle, quiet=quiet, local_only=True)
            check_weights(path, name, allow_pickle)
            return ResolvedModel(name, path, spec, spec.repo, revision, source=f"the Hub ({spec.repo})")
        except CloverError:
            pass
    file = package.cached() if revision is None else None
    if file is not None:
        return _from_gguf(name, file, spec, quiet, dtype, source=package.describe())
    if _offline():
        raise SourceUnavailable(f"{name} is not in the local cache and HF_HUB_OFFLINE is set")
    try:
        path = download(spec.repo, revision, allow_pickle, quiet=quiet)
        check_weights(path, name, allow_pickle)
        return ResolvedModel(name, path, spec, spec.repo, revision, source=f"the Hub ({spec.repo})")
    except CloverError as e:
        if revision is not None:  # a revision is the Hub's: no other source has it
            raise
        print(f"clover: {e}; trying {package.describe()}", file=sys.stderr, flush=True)
    try:
        file = package.fetch(quiet=quiet)
    except SourceUnavailable as e:
        raise SourceUnavailable(f"{name}: {e}")
    return _from_gguf(name, file, spec, quiet, dtype, source=package.describe())


def fetch_heads(heads: str, revision: str | None = None, quiet: bool = False) -> Path:
    """A heads directory named by the user (a local directory or a Hub repo id), fetched when it is a repo; what it
    holds is for drafters/registry.py to say."""
    local = Path(heads).expanduser()
    if local.is_dir():
        return local
    if local.exists() or not looks_like_repo(heads):
        raise CloverError(f"heads directory not found: {heads}")
    return download(heads, revision, what="heads", quiet=quiet, pickles_if_needed=True)
