"""Every on-disk cache path and key of clover, in one place: the compiled programs' packages and the heads' programs
(cache_root, package_key, package_dir, heads_dir), the step costs and the default drafter's learned choices beside
them, the learned early stop of a draft model, self-drafting's chosen layers, the converted GGUF models (their
directory, the content hashes that key them, the locks of the caches' entries), and the n-gram prior's file name in
a model directory (which is not one of the files that key a model).

The paths and keys are what existing caches on users' disks are found by: a change to one of them orphans every
entry it keys, so they change only on purpose (PROGRAM_VERSION does it for the compiled programs).

Everything under the cache is untrusted and disposable: what is read from it is checked (read_cache_json) and,
when damaged, ignored with one line (cache_warning) and made again.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from . import atomic
from .options import compile_sizes, env, kv16

# bump when the compiled programs or their metadata change (12: file sizes and checksums; 13: quantized weights, their
# q/k/v and gate/up fused, and the build's check on real cached keys and values; 14: a quantized model's programs
# built without their weights, reading the model's): old packages are not reused
PROGRAM_VERSION = 14

if TYPE_CHECKING:
    import torch

# in a model directory: the n-gram drafter's prior (drafters/ngram.py), tensor "trigrams" [n, 4] int64 rows
# (a, b, c, count)
PRIOR_FILE = "clover-ngram.safetensors"
HASH_CHUNK = 1 << 20  # bytes read at a time when hashing a file


def model_files(directory, suffixes) -> list[Path]:
    """The files of a model directory with these suffixes that make the model, in name order: what keys a package
    built from it (the compiled step, the GGUF). The n-gram prior beside the weights only drafts: not one of them."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted((f for f in directory.iterdir() if f.is_file() and f.suffix in suffixes and f.name != PRIOR_FILE),
                  key=lambda f: f.name)


# ---------------------------------------------------------------------------------------------------------------
# Reading the cache

# Everything under the cache is untrusted and disposable: what is read from it is checked (types, sizes, checksums)
# and, when damaged, ignored or discarded and rebuilt with one line; nothing in it can make a command fail.
_WARNED: set = set()


def cache_warning(text: str, key=None) -> None:
    """One line on stderr about the cache, once per `key` (default: the text) in a process."""
    key = text if key is None else key
    if key not in _WARNED:
        _WARNED.add(key)
        print(f"clover: {text}", file=sys.stderr)


def read_cache_json(path: Path, parse):
    """parse(the JSON in the cache file `path`), or None: silently when there is no such file, with one line when it
    is damaged (unreadable, not JSON, or `parse` raises anything: a file of the wrong shape)."""
    try:
        text = Path(path).read_text()
    except (FileNotFoundError, NotADirectoryError):  # none there (or no cache at all: a file where it would be)
        return None
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or type(e).__name__
    else:
        try:
            return parse(json.loads(text))
        except Exception as e:  # noqa: BLE001 - any shape of garbage (RecursionError, OverflowError included)
            why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]}"
    cache_warning(f"ignoring a damaged cache file {path} ({why}); it is made again", key=("file", str(path)))
    return None


# ---------------------------------------------------------------------------------------------------------------
# The compiled programs (clover_cli/step)

def cache_root() -> Path:
    from .stats import cache_dir

    return Path(env("CLOVER_COMPILE_CACHE") or cache_dir() / "compiled")


# the compile cache's folders of small JSON files beside the packages (costs_path, early_stop_path, self_draft_path)
COMPILE_SUBDIRS = ("costs", "early_stop", "self")
# in a package: touched each time a session loads it (inuse.hold), what `clover list` and the pruning call its last use
LAST_USED = ".last-used"


def kernels_dir() -> Path:
    """Where clover's own C++ kernels (clover_kernels.quant) are built for this machine."""
    from .stats import cache_dir

    return Path(env("CLOVER_KERNEL_CACHE") or cache_dir() / "kernels")


def fingerprint_files(model_path: Path) -> list:
    """(name, size, mtime) of the files that make the model: its config and weights (not the n-gram prior)."""
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns)
            for f in model_files(model_path, (".json", ".safetensors", ".bin", ".pt", ".py"))]


def package_key(model_path: Path, dtype: torch.dtype, capacity: int, weights: str = "float") -> str:
    """A name for the package of this model, dtype, capacity and weights (clover_cli/quantized.py: "float", "gguf",
    "int8", "int4"), built by these versions on this kind of CPU."""
    import torch  # here, not at the top: the chat's prompt comes up before torch loads, and it reads this module
    import transformers

    from . import __version__

    parts = {
        "program": PROGRAM_VERSION, "clover": __version__, "torch": torch.__version__,
        "transformers": transformers.__version__, "python": sys.version.split()[0],
        "cpu": torch.backends.cpu.get_cpu_capability(), "model": str(Path(model_path).resolve()),
        "files": fingerprint_files(Path(model_path)), "dtype": str(dtype), "capacity": capacity,
        # the sizes asked for; by default they follow from the model's size, which its files in the key fix
        "static": "default" if (sizes := compile_sizes()) is None else sizes,
    }
    if weights != "float":  # (float packages keep the keys they had)
        from clover_kernels.quant import build_key

        parts["weights"] = weights
        parts["kernels"] = build_key()
        parts["kv16"] = kv16()  # target.kv_dtype: the cache buffers the programs take
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]
    return f"{Path(model_path).name[:40]}-{digest}"


def package_dir(model_path: Path, dtype: torch.dtype, capacity: int, weights: str = "float") -> Path:
    return cache_root() / package_key(model_path, dtype, capacity, weights)


def heads_dir(step_dir: Path, heads_path: Path, topk: int, int8: bool = False) -> Path:
    """Where the programs of these heads (for the model whose step package is `step_dir`) are built; int8: with their
    linears as 8-bit integers (drafters/clover2.py: beside a target of integers)."""
    digest = hashlib.sha256(json.dumps([fingerprint_files(Path(heads_path)), str(Path(heads_path).resolve()), topk]
                                       + (["int8"] if int8 else [])).encode()).hexdigest()[:12]
    return step_dir.with_name(f"{step_dir.name}-heads-{digest}")


# ---------------------------------------------------------------------------------------------------------------
# Step costs and the choices learned beside them (clover_cli/step/costs.py)

def costs_path(model_path: Path, device: torch.device, dtype: torch.dtype, step: str, packed: bool,
               weights: str = "float") -> Path:
    """Where the step costs of this model, device, dtype and weights are kept, for `step` ("compiled" or "eager")
    with the threads in use now (one while a build runs beside us) and `packed` (packed.supported(): the packed
    linears)."""
    import torch

    name = package_key(model_path, dtype, 0, weights)
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tag = hashlib.sha256(f"{dev}|{torch.get_num_threads()}|{step}|{packed}".encode()).hexdigest()[:10]
    return cache_root() / "costs" / f"{name}-{step}-{tag}.json"


def choices_path(table: Path, heads_path: Path, repetition_penalty: float = 1.0, temperature: float = 0.0,
                 int8: bool = False) -> Path:
    """Where the default drafter's learned choice (drafters.ChoiceStats: when a step pays for running the heads)
    is kept: beside the step costs' table `table` (costs_path), per heads directory and its files, as it depends on
    both step costs and heads, per temperature and repetition penalty (drafts fare far worse against a sampled or
    penalised target), and apart for heads run as 8-bit integers (int8: a third of the float heads' cost)."""
    heads = hashlib.sha256(repr((str(Path(heads_path).resolve()), fingerprint_files(Path(heads_path))))
                           .encode()).hexdigest()[:10]
    mode = "" if temperature == 0.0 else f"-t{temperature:g}"
    mode += "" if repetition_penalty == 1.0 else f"-penalty{repetition_penalty:g}"
    mode += "-int8" if int8 else ""
    return table.with_name(f"{table.stem}-choice-{heads}{mode}.json")


# ---------------------------------------------------------------------------------------------------------------
# The drafters' learned state

def early_stop_path(target_path, draft_path, dtype) -> Path:
    """Where a session keeps the learned early stop of this target and draft model (both by path and files)."""
    key = [(str(Path(p).resolve()), fingerprint_files(Path(p))) for p in (target_path, draft_path)]
    digest = hashlib.sha256(json.dumps([key, str(dtype)]).encode()).hexdigest()[:20]
    return cache_root() / "early_stop" / f"{Path(draft_path).name[:40]}-{digest}.json"


def self_draft_path(model_path, device, dtype) -> Path:
    """Where the chosen set is kept: per model (path and files), dtype, device and kind of CPU."""
    import torch

    dev = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else str(torch.device(device).type)
    tag = hashlib.sha256(dev.encode()).hexdigest()[:10]
    return cache_root() / "self" / f"{package_key(Path(model_path), dtype, 0)}-{tag}.json"


# ---------------------------------------------------------------------------------------------------------------
# Converted GGUF models (clover_cli/gguf_model.py) and the package index's downloads (clover_cli/sources.py)

def gguf_cache_root() -> Path:
    from .stats import cache_dir

    return Path(env("CLOVER_GGUF_CACHE") or cache_dir() / "gguf")


def content_hash(path: Path) -> str:
    """The sha256 of the file's bytes, remembered per (path, size, mtime) so that a later run need not read it."""
    path = Path(path).resolve()
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns]
    index_path = gguf_cache_root() / "hashes.json"
    try:
        index = json.loads(index_path.read_text())
        known = index.get(str(path)) if isinstance(index, dict) else None
        if isinstance(known, dict) and known.get("stamp") == stamp and isinstance(known.get("sha256"), str):
            return known["sha256"]
    except (OSError, ValueError, RecursionError):  # a damaged cache file: the hash is taken again
        index = {}
    if not isinstance(index, dict):
        index = {}
    sha = sha256_of(path)
    index[str(path)] = {"stamp": stamp, "sha256": sha}
    try:
        atomic.write_text(index_path, json.dumps(index))
    except OSError:
        pass  # a cache that cannot be written only costs a hash next time
    return sha


def lock_path(name: str, make: bool = True) -> Path:
    """Where the lock of one of clover's caches' entries lives: apart from the entries, in the cache's locks/ (a lock
    file outlives its use: removing it could let a third process lock a file nobody else sees), that folder made
    unless not `make`."""
    from .stats import cache_dir

    locks = cache_dir() / "locks"
    if make:
        locks.mkdir(parents=True, exist_ok=True)
    return locks / f"{name}.lock"


def packages_root() -> Path:
    """Where the files fetched from a package index are kept (sources.PackageSource.path), one folder per file."""
    from .stats import cache_dir

    return cache_dir() / "packages"


def hf_cache_root() -> Path:
    """The Hugging Face Hub's cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub), as
    huggingface_hub reads it now."""
    import huggingface_hub.constants as hf_constants

    return Path(hf_constants.HF_HUB_CACHE)


def sessions_dir() -> Path:
    """The registry of running sessions (running.py): one <pid>.json per chat, generate or serve."""
    from .stats import cache_dir

    return cache_dir() / "sessions"


def converted_dir(sha: str, dtype: str) -> Path:
    return gguf_cache_root() / f"{sha[:20]}-{dtype}"


def sha256_of(path: Path) -> str:
    """The sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(HASH_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()
