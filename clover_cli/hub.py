"""Model names: aliases, local directories and Hugging Face Hub repositories, downloaded with huggingface_hub.

Downloads go to the standard cache (HF_HOME / HF_HUB_CACHE), honour HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE, resume
after an interruption (huggingface_hub keeps partial files), and fetch only safetensors weights, configs, tokenizer
and template files: a model's pickled `.bin` weights only with --allow-pickle. Heads repositories may hold pickled
weights (Medusa's `medusa_lm_head.pt`): those are fetched when the repository has no safetensors, and read
tensors-only (clover_cli/torchload.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import CloverError

BUNDLED = Path(__file__).parent / "bundled" / "tiny"
HEADS_SUBDIR = "heads"  # a model directory may carry its draft heads here

SAFE_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja", "README.md"]
PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth"]


FAMILY_NAMES = {"clover": "Clover-2", "medusa": "Medusa", "eagle": "EAGLE", "eagle3": "EAGLE-3"}


@dataclass(frozen=True)
class ModelSpec:
    alias: str
    repo: str | None  # None: the model bundled in this package
    template: str | None  # built-in template for tokenizers without one; None: the tokenizer's own
    # the heads published for it, (drafter, repository) pairs, the one `--draft auto` uses first; ("clover",
    # "bundled"): the bundled model's own heads directory
    heads: tuple[tuple[str, str], ...] = ()
    about: str = ""
    # the default draft model of `--draft model` (issue #16): an alias, a Hub repo id, or "bundled" (the bundled
    # model's own draft/ directory); None: none known
    draft: str | None = None

    def heads_for(self, draft: str) -> str | None:
        """The heads repository for `--draft draft` (auto: the first one), or None."""
        for family, repo in self.heads:
            if draft in ("auto", family):
                return repo
        return None

    def heads_text(self) -> str:
        """What `clover models` shows."""
        return ", ".join(f"{repo} ({FAMILY_NAMES[family]})" for family, repo in self.heads) or "none"


ALIASES = {
    s.alias: s
    for s in [
        ModelSpec("tiny", None, "vicuna_v1.1", (("clover", "bundled"),),
                  "bundled 9M-parameter ShareGPT chat model (offline)", draft="bundled"),
        ModelSpec("vicuna-7b", "lmsys/vicuna-7b-v1.5", "vicuna_v1.1", (("clover", "BinXiao/clover-2-vicuna-7b-v1.5"),),
                  "Vicuna 7B v1.5, with the Clover-2 authors' heads", draft="double7/vicuna-68m"),
        ModelSpec("vicuna-7b-v1.3", "lmsys/vicuna-7b-v1.3", "vicuna_v1.1",
                  (("eagle", "yuhuili/EAGLE-Vicuna-7B-v1.3"), ("medusa", "FasterDecoding/medusa-vicuna-7b-v1.3")),
                  "Vicuna 7B v1.3, with EAGLE's and Medusa's published heads", draft="double7/vicuna-68m"),
        ModelSpec("vicuna-13b", "lmsys/vicuna-13b-v1.5", "vicuna_v1.1", (), "Vicuna 13B v1.5",
                  draft="double7/vicuna-68m"),
        ModelSpec("llama3-8b", "meta-llama/Meta-Llama-3-8B-Instruct", "llama3",
                  (("clover", "BinXiao/clover-2-llama-3-8b-instruct"), ("eagle", "yuhuili/EAGLE-LLaMA3-Instruct-8B")),
                  "Llama 3 8B Instruct (gated), with the Clover-2 authors' and EAGLE's heads",
                  draft="meta-llama/Llama-3.2-1B-Instruct"),
        ModelSpec("llama3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "llama3",
                  (("eagle3", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),),
                  "Llama 3.1 8B Instruct (gated), with EAGLE-3's heads", draft="meta-llama/Llama-3.2-1B-Instruct"),
        ModelSpec("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "chatml", (), "Qwen2.5 0.5B Instruct"),
        ModelSpec("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "chatml", (), "Qwen2.5 7B Instruct", draft="qwen2.5-0.5b"),
        ModelSpec("mistral-7b", "mistralai/Mistral-7B-Instruct-v0.3", None, (), "Mistral 7B Instruct v0.3"),
        ModelSpec("tinyllama", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", None, (), "TinyLlama 1.1B Chat"),
    ]
}


@dataclass
class ResolvedModel:
    name: str  # what the user asked for (alias, repo id or path)
    path: Path  # a local directory with config.json
    spec: ModelSpec | None
    repo: str | None = None
    revision: str | None = None


def looks_like_repo(name: str) -> bool:
    """org/name: the shape of a Hub repo id (a local path may have it too: check that first)."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


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
             quiet: bool = False, pickles_if_needed: bool = False) -> Path:
    """Fetch a repository snapshot into the Hub cache (or find it there) and return its local path.

    Pickled weights are fetched with `allow_pickle`, or with `pickles_if_needed` when the repository has no
    safetensors (heads: read tensors-only)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError)

    if pickles_if_needed and not allow_pickle and not _offline():
        allow_pickle = not _has_safetensors(repo, revision)
    patterns = SAFE_PATTERNS + (PICKLE_PATTERNS if allow_pickle else [])
    rev = f" at revision {revision}" if revision else ""
    try:
        if quiet or not os.isatty(2):
            path = snapshot_download(repo, revision=revision, allow_patterns=patterns, tqdm_class=_silent_tqdm())
        else:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

            with Progress(TextColumn(f"[bold]{repo}[/]"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                          console=Console(stderr=True), transient=True) as progress:
                path = snapshot_download(repo, revision=revision, allow_patterns=patterns,
                                         tqdm_class=_rich_tqdm_class(progress))
    except GatedRepoError:
        raise CloverError(f"{repo} is gated: accept its licence on the Hub and set HF_TOKEN")
    except RevisionNotFoundError:
        raise CloverError(f"{what} {repo} has no revision {revision!r}")
    except RepositoryNotFoundError:
        raise CloverError(f"{what} {repo}{rev} not found on the Hub (or it is private: set HF_TOKEN)")
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        if _offline():
            raise CloverError(f"{what} {repo}{rev} is not in the local cache and HF_HUB_OFFLINE is set")
        raise CloverError(f"cannot reach the Hub to fetch {repo}{rev}, and no cached copy exists")
    except HfHubHTTPError as e:
        raise CloverError(f"the Hub refused {repo}{rev}: {str(e).splitlines()[0]}")
    except OSError as e:
        raise CloverError(f"could not fetch {repo}{rev}: {e}")
    return Path(path)


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
                  quiet: bool = False) -> ResolvedModel:
    name = name or "tiny"
    spec = ALIASES.get(name)
    if spec is not None:
        if spec.repo is None:
            if not (BUNDLED / "config.json").is_file():
                raise CloverError("the bundled model is missing from this installation (reinstall clover)")
            if revision:
                raise CloverError(f"--revision does not apply to the bundled model {name!r} (it has no Hub history)")
            return ResolvedModel(name, BUNDLED, spec)
        path = download(spec.repo, revision, allow_pickle, quiet=quiet)
        check_weights(path, name, allow_pickle)
        return ResolvedModel(name, path, spec, spec.repo, revision)
    local = Path(name).expanduser()
    if local.is_dir():
        check_weights(local, name, allow_pickle)
        return ResolvedModel(name, local, None)
    if local.exists():
        raise CloverError(f"{name} is a file, not a model directory")
    if looks_like_repo(name):
        path = download(name, revision, allow_pickle, quiet=quiet)
        check_weights(path, name, allow_pickle)
        return ResolvedModel(name, path, None, name, revision)
    raise CloverError(f"unknown model {name!r}: not an alias (see `clover models`), a directory or a Hub repo id")


def fetch_heads(heads: str, revision: str | None = None, quiet: bool = False) -> Path:
    """A heads directory named by the user (a local directory or a Hub repo id), fetched when it is a repo; what it
    holds is for drafters/registry.py to say."""
    local = Path(heads).expanduser()
    if local.is_dir():
        return local
    if local.exists() or not looks_like_repo(heads):
        raise CloverError(f"heads directory not found: {heads}")
    return download(heads, revision, what="heads", quiet=quiet, pickles_if_needed=True)
