"""The compiled step: the target's own forward (and the draft heads' per-step modules), exported with symbolic sizes
and compiled ahead of time.

The target's step is a few programs: one each for exactly 1, 2, 4, 8 and 16 new tokens (STATIC; a smaller step runs
padded to the next of them) and one for any larger number (draft trees, prefills), each taking any number of
committed tokens export found it can, a tree mask, and the rows whose logits are wanted. They are the stock
transformers forward with our attention function and cache (`Target.run`), traced by torch.export and compiled by
AOTInductor with the weights frozen into them (on a CPU: prepacked for oneDNN, the q/k/v and gate/up projections
each concatenated into one product; the fixed sizes with inductor's own autotuned kernels). A model whose float32
weights a float16 or bfloat16 checkpoint holds exactly, too large to stay in the CPU's cache, gets its programs for
1, 2 and 4 tokens with those weights kept narrow and widened as they are read (NARROW_ROWS). They read and write
the live cache's own buffers, so eager and compiled steps can follow each other in one conversation. Per step there
is no Python between the operators, no guard to evaluate and one call into the compiled library.

    inputs   tokens [n] long, positions [n] long, tree [n, n] bool (which new tokens each one sees),
             rows [r] long (the tokens whose logits are wanted), past [past, 0] (only its length counts: the
             committed tokens), then every layer's key buffer and every layer's value buffer [1, Hkv, capacity, D]
    outputs  pre-norm hidden [n, H], logits [r, V]; the new keys and values are written at past..past+n-1

The heads' programs (HeadsPrograms) are the compiled twins of the modules in drafters/clover2.py and medusa.py:
Clover-2's augmenting block (with the heads' own cache, the same way) and levels, Medusa's heads.

Building takes one to two minutes on two cores, so it runs in a child process (this module's main() in a Python
started isolated from the working directory: child_command), never in front of a reply, one process at a time per
package (build_lock); the packages land in the user cache keyed by everything they depend on (model and heads
files, dtype, capacity, torch/transformers/clover versions, CPU instruction set) and load in tens of milliseconds
afterwards. Before a package is written, the builder checks it against the eager modules (logits, hidden states
and cache writes on random trees; the heads' states and ranked tokens) and times the step per tree size: the engine
sizes its trees from those timings instead of measuring its own forwards on every start (StepCosts), keeps the
sizes it runs current from its own forwards, and scales the rest by them.

On a CUDA device nothing is built ahead: the static step of clover_cli/graphs.py is captured as CUDA graphs in the
session, each (rows, span) on its first use, and the heads' per-step modules likewise (graphs.heads_graphs).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
import weakref
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import atomic
from .errors import CloverError, one_line
from .loading import keep_loaded
from .options import MODES, compile_mode  # noqa: F401 - importable from here too

PROGRAM_VERSION = 12  # bump when the programs or their metadata change (12: file sizes and checksums): not reused
MAX_CAPACITY = 8192  # KV buffers of the compiled program (tokens); longer contexts run eager past this point
MAX_WEIGHT_BYTES = 4 << 30  # the package holds a frozen copy of the weights: larger models stay eager
# Steps of up to 16 new tokens (plain decoding, most drafted trees) run a program built for exactly that many rows:
# a static shape lets inductor specialise every kernel. On the AVX2 machine a 1-token step cost 2.5-2.8 ms this way
# against 5.3-5.5 ms in a program for 1-4 rows, 4 rows 4.6 ms against 7.4, 16 rows 7.7 against 9.4
# (docs/BENCHMARKS.md). A step of n tokens runs the smallest of these sizes >= n, its extra rows padding.
STATIC = (1, 2, 4, 8, 16)
# Every program holds its own frozen copy of the weights: a model whose copies for all of them would pass this many
# bytes gets fixed-size programs for 1 and 4 tokens only (three copies, as many as before there were fixed sizes).
COPIES_BYTES = 2 << 30
FEW_STATIC = (1, 4)
# A step of a few tokens reads every weight once for a few rows of arithmetic, so its time is the weights' bytes. A
# checkpoint stored in float16 or bfloat16 and run in float32 (the bundled model; most Hub models on a CPU) holds only
# values that narrow type represents exactly: the programs for exactly 1, 2 and 4 tokens keep the linears' weights in
# it and widen each as it is read, the same float32 products from half the bytes (NarrowLinear). On the AVX2 machine
# the bundled model's programs took 2.0 / 2.4 / 3.9 ms a call for 1 / 2 / 4 tokens against 2.8 / 3.6 / 4.5 with
# float32 weights; for 8 tokens 7.2 against 6.2 (docs/BENCHMARKS.md): larger programs keep float32 weights, frozen
# and prepacked as before.
# For a small model whose weights stay in the CPU's caches the bytes do not count and the reductions lose: the
# bundled draft model (6 MB of float32 weights) took 0.37 / 0.32 / 0.46 ms for 1 / 2 / 4 tokens narrow against
# 0.25 / 0.26 / 0.37 ms. So weights narrow only where the float32 ones exceed NARROW_MIN_BYTES, half the last-level
# cache: every program holds its own copy of the weights, and the steps take turns with the drafters' programs.
NARROW_ROWS = 4


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The size of CPU 0's largest cache level (Linux sysfs), else `default`."""
    best = (0, default)
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
            size = int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0)
        except (OSError, ValueError):
            continue
        best = max(best, (level, size))
    return best[1]


NARROW_MIN_BYTES = last_level_cache_bytes() // 2
NARROW = (torch.float16, torch.bfloat16)
# Larger steps run one program for any number of rows, as the smallest of SIZES >= n (beyond them: the next
# multiple of 64). oneDNN builds its kernels for every new row count the first time it meets it (about 4 ms a size
# here): a few sizes keep that one-time cost small, and cost almost nothing per step, since a product over a few
# rows more reads the same weights.
SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80)
# A causal forward of more than SIZES[-1] tokens (a prefill) runs in pieces of these many rows (the largest that fit,
# in turn), then the rest as a step: every new row count left kernels and buffers behind for good (a prefill of
# each new length to 2,000 tokens grew a process by ~280 MiB), and in pieces there are a few row counts only.
PIECES = (1024, 512, 256, 128, 64)


def program_table(static=STATIC) -> tuple:
    """The programs of a package: (file, fewest rows, most (None: the capacity), the example size it is tuned at,
    autotuned, the register blocking of inductor's C++ float32 products (None: its own choice)).

    The static programs are autotuned: inductor times its own C++ kernels against oneDNN's per product on this machine
    at build and keeps the faster (on an AVX-512 machine 5-6 rows ran 15-18% faster than with oneDNN alone; on the
    AVX2 one oneDNN's were 3-4x slower for 1 row). For 5-8 rows on AVX-512 its kernels are built on 16x16 register
    blocks: on its default 8x48 ones a step of 7-8 tokens cost 15-19% more. The program for larger steps uses
    oneDNN's products, prepacked for its example size."""
    table = [(f"step-{n}.pt2", n, n, n, True, (16, 16) if 5 <= n <= 8 else None) for n in static]
    first = max(static, default=0) + 1
    return tuple(table) + (("step.pt2", first, None, max(first, 32), False, None),)


PROGRAMS = program_table()


def static_sizes(nbytes: int = 0) -> tuple[int, ...]:
    """The sizes CLOVER_COMPILE_SIZES lists ("1,4": fewer programs, a shorter build; "": none); without it STATIC,
    or FEW_STATIC for a model of `nbytes` of weights whose copies would pass COPIES_BYTES."""
    text = os.environ.get("CLOVER_COMPILE_SIZES")
    if text is None:
        return FEW_STATIC if nbytes * (len(STATIC) + 1) > COPIES_BYTES else STATIC
    try:
        sizes = tuple(sorted({int(part) for part in text.replace(" ", "").split(",") if part}))
    except ValueError:
        sizes = (0,)
    if any(not 1 <= size <= SIZES[-1] for size in sizes):
        raise CloverError(f"CLOVER_COMPILE_SIZES must list step sizes from 1 to {SIZES[-1]}, like 1,2,4: {text!r}")
    return sizes


META = "meta.json"


def unsupported(model, device: torch.device, dtype: torch.dtype, load_in_8bit: bool) -> str | None:
    """Why the compiled step cannot serve this model here (one short phrase), or None when it can."""
    if spread(model):
        return "a model placed by --device-map (over several devices, or offloaded) is not compiled"
    if load_in_8bit:
        return "8-bit weights are not compiled"
    if getattr(model, "hf_quantizer", None) is not None:
        return "4-bit weights are not compiled"
    if device.type == "cuda":
        return None  # CUDA graphs of the static step (clover_cli/graphs.py), captured in the session
    if device.type != "cpu":
        return f"the compiled step runs on a CPU or a CUDA device, not {device.type}"
    if dtype != torch.float32:
        return "the compiled step is built for float32 weights"
    size = weight_bytes(model)
    if size > MAX_WEIGHT_BYTES:
        return f"the model's weights ({size / 2**30:.1f} GiB) are too large to freeze into a compiled package"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
        return "no C++ compiler found (inductor needs one)"
    return None


def narrow_dtype(model) -> torch.dtype | None:
    """The first of NARROW that holds every float32 nn.Linear weight of `model` exactly, or None (some weight needs
    float32, there are no linears, or they are NARROW_MIN_BYTES or fewer)."""
    # each weight once (linears may share one)
    weights = list({id(m.weight): m.weight.detach() for m in model.modules()
                    if isinstance(m, torch.nn.Linear)}.values())
    if not weights or any(w.dtype != torch.float32 for w in weights):
        return None
    if sum(w.numel() * w.element_size() for w in weights) <= NARROW_MIN_BYTES:
        return None  # they stay cached: the bytes do not count
    for dtype in NARROW:
        if all(torch.equal(w.to(dtype).float(), w) for w in weights):
            return dtype
    return None


class NarrowLinear(torch.nn.Module):
    """An nn.Linear whose weight is kept in a narrower type that holds it exactly, computed in the input's type as
    one multiply-and-sum per row of the input (its rows, dimension -2, a static size): inductor fuses the widening
    into the loads and the rows' sums into one loop, so the product reads each weight once, at half the bytes."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", linear.weight.detach().to(dtype))
        self.bias = linear.bias

    def forward(self, x):
        weight = self.weight.to(x.dtype)
        out = torch.stack([(x.select(-2, r).unsqueeze(-2) * weight).sum(-1) for r in range(x.shape[-2])], -2)
        return out if self.bias is None else out + self.bias


@contextmanager
def narrow_linears(model, dtype: torch.dtype):
    """Every nn.Linear of `model` a NarrowLinear of `dtype` while the block runs (an export), put back after."""
    swapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, NarrowLinear(child, dtype))
                swapped.append((parent, name, child))
    try:
        yield len(swapped)
    finally:
        for parent, name, child in reversed(swapped):
            setattr(parent, name, child)


def weight_bytes(model) -> int:
    """The bytes a frozen copy of the model's weights takes."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def spread(model) -> bool:
    """Whether accelerate placed the model over several devices or offloaded some of its weights (to the CPU or
    disk, loaded at each forward): a device map other than everything on one device."""
    placed = {str(where) for where in (getattr(model, "hf_device_map", None) or {}).values()}
    return len(placed) > 1 or bool(placed & {"disk", "meta"}) or any(
        p.device.type == "meta" for p in model.parameters())


def capacity_for(max_context: int) -> int:
    return min(max_context, MAX_CAPACITY)


# ---------------------------------------------------------------------------------------------------------------
# Where packages live

def cache_root() -> Path:
    from .stats import cache_dir

    return Path(os.environ.get("CLOVER_COMPILE_CACHE") or cache_dir() / "compiled")


def _fingerprint_files(model_path: Path) -> list:
    """(name, size, mtime) of the files that make the model: its config and weights (not the n-gram prior)."""
    from .loading import model_files

    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns)
            for f in model_files(model_path, (".json", ".safetensors", ".bin", ".pt", ".py"))]


def package_key(model_path: Path, dtype: torch.dtype, capacity: int) -> str:
    """A name for the package of this model, dtype and capacity, built by these versions on this kind of CPU."""
    import transformers

    from . import __version__

    parts = {
        "program": PROGRAM_VERSION, "clover": __version__, "torch": torch.__version__,
        "transformers": transformers.__version__, "python": sys.version.split()[0],
        "cpu": torch.backends.cpu.get_cpu_capability(), "model": str(Path(model_path).resolve()),
        "files": _fingerprint_files(Path(model_path)), "dtype": str(dtype), "capacity": capacity,
        # the sizes asked for; by default they follow from the model's size, which its files in the key fix
        "static": static_sizes() if "CLOVER_COMPILE_SIZES" in os.environ else "default",
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]
    return f"{Path(model_path).name[:40]}-{digest}"


def package_dir(model_path: Path, dtype: torch.dtype, capacity: int) -> Path:
    return cache_root() / package_key(model_path, dtype, capacity)


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


def _count(v, least: int = 0, most: int = sys.maxsize) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and least <= v <= most


def _seconds(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf


STEP_NAME = re.compile(r"step(-[1-9][0-9]{0,3})?\.pt2")
AUGMENT_NAME = re.compile(r"augment(-[1-9][0-9]{0,3})?\.pt2")


def _ranges_problem(ranges, name_pattern) -> str | None:
    """What is wrong with the programs' size ranges of a package's metadata (name -> {"n": [lo, hi], "past":
    [lo, hi]}), or None."""
    if not isinstance(ranges, dict) or not ranges:
        return "its program list is not a table of programs"
    for name, r in ranges.items():
        if not name_pattern.fullmatch(name):
            return f"it names a program {name[:60]!r}"
        if not isinstance(r, dict) or not all(isinstance(r.get(k), list) and len(r[k]) == 2 and all(map(_count, r[k]))
                                              and r[k][0] <= r[k][1] for k in ("n", "past")):
            return f"the sizes of {name} are not ranges"
    return None


def sums(d: Path, names) -> dict:
    """{name: {"bytes": size, "crc32": checksum}} of the files `names` in directory `d` (written into a package's
    metadata when it is built, checked when it is loaded)."""
    out = {}
    for name in names:
        crc, size = 0, 0
        with open(Path(d) / name, "rb") as f:
            while chunk := f.read(8 << 20):
                crc, size = zlib.crc32(chunk, crc), size + len(chunk)
        out[name] = {"bytes": size, "crc32": crc}
    return out


def _files_problem(d: Path, meta: dict, names, full: bool) -> str | None:
    """What is wrong with the program files `names` of the package in `d` against its metadata's sizes (and, with
    `full`, checksums), or None."""
    files = meta.get("files")
    if not isinstance(files, dict):
        return "its metadata lists no file sizes"
    for name in names:
        want = files.get(name)
        if not isinstance(want, dict) or not _count(want.get("bytes")) or not _count(want.get("crc32"), 0, 2**32 - 1):
            return f"its metadata lists no size for {name}"
        try:
            size = (Path(d) / name).stat().st_size
        except OSError as e:
            return f"{name}: {e.strerror}"
        if size != want["bytes"]:
            return f"{name} has {size} bytes, not {want['bytes']}"
    if full:
        # the checksums are read once per version of the files: a later load that finds them as they were when
        # they last matched (same inode, size and modification time) does not read a package's weights again
        stamps = VERIFIED.format(crc=zlib.crc32(json.dumps(files, sort_keys=True).encode()))
        try:
            seen = {name: [st.st_ino, st.st_size, st.st_mtime_ns] for name in names
                    for st in [(Path(d) / name).stat()]}
        except OSError as e:
            return f"cannot read it: {e.strerror}"
        if read_cache_json(Path(d) / stamps, lambda stored: stored) == seen:
            return None
        try:
            got = sums(d, names)
        except OSError as e:
            return f"cannot read it: {e.strerror}"
        for name in names:
            if got[name]["crc32"] != files[name]["crc32"]:
                return f"{name} does not match its checksum"
        try:
            atomic.write_text(Path(d) / stamps, json.dumps(seen))
        except OSError:
            pass  # a package that cannot be written to is checked again next time
    return None


VERIFIED = ".verified-{crc}.json"  # in a package: the stamps of its files when their checksums last matched


def _read_meta(d: Path):
    """(the metadata of the package directory `d`, None) or (None, what is wrong); (None, None) when there is no
    package there."""
    d = Path(d)
    try:
        text = (d / META).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None, ("it has no meta.json" if d.is_dir() else None)
    except (OSError, ValueError) as e:
        return None, f"cannot read its meta.json: {getattr(e, 'strerror', None) or type(e).__name__}"
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError):
        return None, "its meta.json is not JSON"
    if not isinstance(meta, dict):
        return None, "its meta.json is not an object"
    return meta, None


def inspect_package(d: Path, full: bool = False):
    """(Package, None) for a complete step package in `d`, (None, None) when there is none, (None, what is wrong)
    when it is damaged. Sizes are always checked; `full` also checks every file's checksum (what loading does)."""
    meta, why = _read_meta(d)
    if meta is None:
        return None, why
    if meta.get("program") != PROGRAM_VERSION:
        return None, f"it is of program version {str(meta.get('program'))[:20]}, not {PROGRAM_VERSION}"
    capacity, ranges, verify_s = meta.get("capacity"), meta.get("ranges"), meta.get("verify_s", {})
    if not _count(capacity, 2, MAX_CAPACITY):
        return None, "its capacity is not a size"
    why = _ranges_problem(ranges, STEP_NAME)
    if why:
        return None, why
    if not isinstance(verify_s, dict) or not all(isinstance(k, str) and re.fullmatch(r"[0-9]{1,6}", k)
                                                  and 0 < int(k) <= 1 << 16 and _seconds(v)
                                                  for k, v in verify_s.items()):  # ("²".isdigit(), but int fails)
        return None, "its step times are not times"
    why = _files_problem(d, meta, ranges, full)
    if why:
        return None, why
    return Package(Path(d), capacity, {int(k): float(v) for k, v in verify_s.items()}, ranges), None


def damage(d: Path) -> str | None:
    """What is wrong with the step package in `d` (every file's checksum checked), or None (sound, or absent)."""
    return inspect_package(d, full=True)[1]


def _fingerprint(d: Path):
    """What identifies the package now in `d` (a rebuilt one has a new meta.json)."""
    try:
        st = (Path(d) / META).stat()
        return st.st_ino, st.st_mtime_ns, st.st_size
    except OSError:
        return None


def discard(d: Path, seen) -> bool:
    """Remove the damaged package `d` when no process is building it and it is still the one seen damaged (its
    _fingerprint then was `seen`): under its build lock, so that a package just built in its place is kept."""
    from filelock import FileLock, Timeout

    lock = FileLock(f"{d}.lock")
    try:
        lock.acquire(timeout=0)
    except (Timeout, OSError):
        return False  # being built again right now (or the cache is not ours to lock): left as it is
    try:
        if _fingerprint(d) != seen:
            return False
        aside = atomic.temp_dir(Path(d))
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(d, aside)  # gone at once from where a process looks; then removed
        shutil.rmtree(aside, ignore_errors=True)
        return True
    except OSError:
        return False
    finally:
        lock.release()


# ---------------------------------------------------------------------------------------------------------------
# The program and its build

class OnBuffers(torch.nn.Module):
    """Export wrapper: block(*inputs, cache) with the cache made over the trailing buffer inputs (every layer's keys,
    then every layer's values, [1, Hkv, capacity, D]), holding as many tokens as the `past` input is long. Its
    inputs are one variadic argument: dynamic shapes are given as a 1-tuple holding one spec per tensor."""

    def __init__(self, block: torch.nn.Module, n_inputs: int):
        super().__init__()
        self.block, self.n_inputs = block, n_inputs

    def forward(self, *args):
        from .target import TreeKVCache

        inputs, past, buffers = args[:self.n_inputs], args[self.n_inputs], args[self.n_inputs + 1:]
        layers = len(buffers) // 2
        return self.block(*inputs, TreeKVCache.over(list(buffers[:layers]), list(buffers[layers:]), past.shape[0]))


class TargetStep(torch.nn.Module):
    """The target's step as the program computes it: Target.run with the tree mask after the committed tokens."""

    def __init__(self, target):
        super().__init__()
        self.model = target.model  # a submodule, so export sees its weights as parameters (frozen when compiled)
        self.target = target

    def forward(self, tokens, positions, tree, rows, cache):
        mask = torch.cat([tree.new_ones(tree.shape[0], cache.length), tree], 1)[None, None]
        return self.target.run(tokens, positions, mask, cache, rows)


def _example(target, n: int, past: int, seed: int = 0):
    """Program inputs for random tokens in a random tree (parents before children) after `past` committed ones."""
    from .decode.tree import DraftTree

    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    tree = DraftTree(torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist(), parents)
    return (torch.tensor(tree.tokens), past + torch.tensor(tree.depths()), torch.from_numpy(tree.ancestor_mask()),
            torch.arange(n), torch.empty(past, 0))


@dataclass
class Job:
    """What a build makes: the step package `out` of the model, and the heads' programs `heads_out` when `heads`
    (a heads directory) is given. Parts already in the cache are not built again unless `force`."""

    model: Path
    out: Path
    capacity: int
    trust_remote_code: bool = False
    allow_pickle: bool = False
    heads: Path | None = None
    heads_out: Path | None = None
    topk: int = 8
    force: bool = False

    def argv(self) -> list[str]:
        """The child's arguments: every path absolute (it runs from another directory)."""
        path = os.path.abspath
        args = [path(self.model), "--capacity", str(self.capacity), "--out", path(self.out), "--topk", str(self.topk)]
        if self.heads is not None:
            args += ["--heads", path(self.heads), "--heads-out", path(self.heads_out)]
        return args + ["--trust-remote-code"] * self.trust_remote_code + ["--allow-pickle"] * self.allow_pickle \
            + ["--force"] * self.force

    def missing(self) -> tuple[bool, bool]:
        """(the step, the heads' programs) still to build."""
        step = self.force or Package.find(self.out) is None
        heads = self.heads is not None and (self.force or find_heads(self.heads_out) is None)
        return step, heads


def build(job: Job, log=print) -> dict:
    """Load the model (CPU, float32) once and build what `job` still lacks. Returns {"step": meta, "heads": meta}
    for the parts built."""
    from .drafters.clover2 import CloverDrafter
    from .drafters.medusa import MedusaDrafter
    from .drafters.registry import load as load_heads
    from .loading import load
    from .target import Target

    need_step, need_heads = job.missing()
    if not (need_step or need_heads):
        return {}
    t0 = time.perf_counter()
    loaded = load(Path(job.model), "cpu", "float32", False, job.trust_remote_code, job.allow_pickle)
    model = loaded.model.eval()
    why = unsupported(model, torch.device("cpu"), torch.float32, False)
    if why:
        raise CloverError(f"cannot compile {job.model}: {why}")
    target = Target(model, max_context=job.capacity, initial_capacity=job.capacity, pack=False)
    built = {}
    if need_step:
        log(f"exporting the step of {job.model} ...")
        built["step"] = build_for(target, job.out, log)
        log(f"compiled step ready in {time.perf_counter() - t0:.0f} s: {job.out}")
    if need_heads:
        heads = load_heads(Path(job.heads), model)
        if heads.cfg.architecture not in ("clover2", "medusa"):  # EAGLE heads have no compiled programs
            raise CloverError(f"{heads.cfg.architecture} heads run eager: they have no compiled programs")
        cls = CloverDrafter if heads.cfg.architecture == "clover2" else MedusaDrafter
        built["heads"] = build_heads_for(cls(heads, target, topk=job.topk), target.cache.capacity, job.heads_out,
                                         log)
        log(f"compiled heads ready in {time.perf_counter() - t0:.0f} s: {job.heads_out}")
    return built


def export(module: torch.nn.Module, args: tuple, shapes) -> "torch.export.ExportedProgram":
    """torch.export with symbolic sizes where `shapes` says; sizes 0 and 1 are not special-cased (one program for a
    single token and for a tree)."""
    from torch.fx.experimental import _config as fx_config

    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        return torch.export.export(module, args, dynamic_shapes=shapes, strict=False)


def input_ranges(exported, dims: dict[str, tuple[int, int]]) -> dict[str, list[int]]:
    """The sizes an exported program accepts, as export worked them out: name -> [least, most] for the sizes named
    in `dims` (name -> (input index, dimension))."""
    inputs = [node for node in exported.graph.nodes if node.op == "placeholder"
              if node.name in set(exported.graph_signature.user_inputs)]
    out = {}
    for name, (index, dim) in dims.items():
        size = inputs[index].meta["val"].shape[dim]
        if isinstance(size, int):
            out[name] = [size, size]
            continue
        bounds = exported.range_constraints[size.node.expr]
        out[name] = [int(bounds.lower), int(bounds.upper)]
    return out


def compile_package(exported, path: Path, autotune: bool = False, blocking: tuple[int, int] | None = None,
                    freeze: bool = True) -> None:
    """AOTInductor, the weights frozen into the program (on a CPU: prepacked for oneDNN; q/k/v and gate/up fused).
    autotune: inductor also times its own C++ matrix-product kernels on this machine and keeps what is fastest.
    blocking: (rows, columns) of the register blocks those kernels use for float32 on AVX-512, when inductor has
    them (see register_blocking). freeze=False keeps the weights as the program's constants without folding anything
    into them (narrow weights: folding would widen them once, into float32 copies)."""
    config = {"freezing": freeze, "cpp.enable_concat_linear": freeze}
    if autotune:  # quietly: inductor writes every product's timings to stderr otherwise
        config.update({"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                       "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False})
    with torch.no_grad(), torch._inductor.config.patch(config), register_blocking(blocking), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # inductor's own call, torch 2.13
        torch._inductor.aoti_compile_and_package(exported, package_path=str(path))


@contextmanager
def register_blocking(blocking: tuple[int, int] | None):
    """Inductor's C++ float32 products on AVX-512 built on (rows, columns) register blocks only, for the block.

    Inductor picks one of its blockings (8x48, 8x32, 16x16) by a static score that prefers the largest; for 7-8 rows
    the 16x16 ones ran 1.4-1.5x faster here (the products of a step alone; docs/BENCHMARKS.md). It offers no setting
    for this, so its table of micro-kernels is narrowed while the block runs. Without that table, or without such an
    entry (another torch, another instruction set), nothing changes."""
    if blocking is None:
        yield
        return
    try:
        import torch._inductor.compile_fx  # noqa: F401  (inductor's modules import in this order)
        from torch._inductor.codegen import cpp_micro_gemm
        from torch._inductor.cpu_vec_isa import VecAVX512

        table = cpp_micro_gemm.micro_gemm_configs
    except (ImportError, AttributeError):
        yield
        return

    def other_fp32_avx512(config) -> bool:
        return (config.vec_isa_cls is VecAVX512 and config.input_dtype == torch.float
                and config.input2_dtype == torch.float and tuple(config.register_blocking)[:2] != tuple(blocking))

    saved = {cls: list(configs) for cls, configs in table.items()}
    wanted = any(c.vec_isa_cls is VecAVX512 and tuple(c.register_blocking)[:2] == tuple(blocking)
                 for configs in saved.values() for c in configs)
    try:
        if wanted:
            for configs in table.values():
                configs[:] = [c for c in configs if not other_fp32_avx512(c)]
        yield
    finally:
        for cls, configs in saved.items():
            table[cls][:] = configs


class Program:
    """A compiled package: called with its flat tensor inputs, returns its flat outputs.

    Loading unpacks the package into a directory of its own under TMPDIR (aotinductor_XXXXXX: its library, 2-47 MB
    a program), which the loader removes when it is destroyed. `clover` leaves with os._exit (cli._leave), where
    no destructor runs: every process left ~0.3 GB behind, until release_programs (at exit) destroyed them first."""

    def __init__(self, path: Path):
        self.name = Path(path).name
        # Loading checks that the package suits this CPU's vector instructions; inductor's check of what the CPU
        # supports compiles and loads a probe library for each instruction set (about a second, every process).
        # The CPU's own flags answer it here: the package key already names the CPU's capability.
        with torch._inductor.config.patch({"cpp.vec_isa_ok": True}):
            self.loader = torch._inductor.aoti_load_package(str(path)).loader
        _LOADED.add(self)

    def __call__(self, *inputs):
        if self.loader is None:
            raise RuntimeError(f"compiled program {self.name} was released")
        return self.loader.boxed_run(list(inputs))

    def release(self) -> None:
        """Destroy the loader now (its unpacked directory goes with it)."""
        self.loader = None


_LOADED: "weakref.WeakSet[Program]" = weakref.WeakSet()


@atexit.register
def release_programs() -> None:
    """Destroy every loaded program's loader, so that its unpacked directory is removed even when the process then
    leaves without running destructors (os._exit)."""
    for program in list(_LOADED):
        program.release()


@contextmanager
def building(out: Path):
    """A fresh directory beside `out` to build into; renamed to `out` (replacing it) when the block succeeds,
    removed when it fails: a package directory is complete or absent."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic.clean_stale(out)  # what builds that were killed left
    tmp = atomic.temp_dir(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_for(target, out: Path, log=print, static: tuple[int, ...] | None = None, autotune: bool = True) -> dict:
    """Export, compile, check and time the step programs of `target` (a Target whose cache capacity is the
    programs'), one for each of the `static` sizes (default: static_sizes() for its weights) and one for larger
    steps; write them to directory `out` atomically (built beside it, renamed into place). Returns the metadata
    written. autotune=False compiles the programs meant for autotuning without it (quicker to build, slower to
    run)."""
    t0 = time.perf_counter()
    capacity = target.cache.capacity
    with torch.inference_mode():  # allocates the cache buffers at full capacity
        target.cache.truncate(0)
        target.forward(torch.tensor([0], device=target.device))
    keys, values = target.cache.buffers()
    Dim = torch.export.Dim
    program = OnBuffers(TargetStep(target), 4).eval()
    exported, ranges = {}, {}
    if static is None:
        static = static_sizes(weight_bytes(target.model))
    narrow = narrow_dtype(target.model)
    narrowed = {}  # program -> the type its linears' weights are kept in (NarrowLinear)
    for name, lo, hi, example_n, tuned, blocking in program_table(static):
        hi = min(hi or capacity - 1, capacity - 1)
        if lo > hi:
            continue  # more rows than the buffers hold
        example_n = min(example_n, hi)
        # how many committed tokens a program takes is for export to work out (past + n < capacity at least; some
        # models need more): the ranges it finds are kept and a step outside them runs another program or eager
        if lo == hi:  # every size static: the program computes the logits of all its rows
            shapes = ((None, None, None, None, {0: Dim.DYNAMIC}, *(None for _ in keys + values)),)
        else:
            n, rows = Dim("n", min=lo, max=hi), Dim("rows", min=1, max=hi)
            shapes = (({0: n}, {0: n}, {0: n, 1: n}, {0: rows}, {0: Dim.DYNAMIC}, *(None for _ in keys + values)),)
        example = _example(target, example_n, min(max(37, capacity // 2), capacity - example_n - 1))
        if narrow is not None and lo == hi <= NARROW_ROWS:  # a few rows: half the bytes (see NARROW)
            with narrow_linears(target.model, narrow):
                exported[name] = (export(program, (*example, *keys, *values), shapes), False, None)
            narrowed[name] = str(narrow).removeprefix("torch.")
        else:
            exported[name] = (export(program, (*example, *keys, *values), shapes), autotune and tuned, blocking)
        ranges[name] = input_ranges(exported[name][0], {"n": (0, 0), "past": (4, 0)})
    log(f"compiling (AOTInductor, weights frozen) ... {time.perf_counter() - t0:.0f} s")
    try:
        with building(out) as tmp:
            for name, (program, tuned, blocking) in exported.items():
                compile_package(program, tmp / name, tuned, blocking, freeze=name not in narrowed)
            step = CompiledStep(tmp, capacity, ranges)
            check(step, target)
            meta = {"program": PROGRAM_VERSION, "capacity": capacity, "ranges": ranges, "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "narrow": narrowed, "verify_s": measure(step, target),
                    "build_s": round(time.perf_counter() - t0, 1), "files": sums(tmp, ranges)}
            atomic.write_text(tmp / META, json.dumps(meta, indent=1))
    finally:
        target.cache.truncate(0)
    return meta


@torch.inference_mode()
def check(step: "CompiledStep", target, tolerance: float = 1e-3):
    """The package must compute what the eager forward computes: logits, hidden states and the keys and values it
    writes, on random trees of a few sizes after random cached keys and values."""
    keys, values = target.cache.buffers()
    g = torch.Generator().manual_seed(1)
    attached, target.program = target.program, None  # the reference is the eager forward
    try:
        _compare(step, target, keys, values, g, tolerance)
    finally:
        target.program = attached
        target.cache.truncate(0)


def _compare(step, target, keys, values, g, tolerance):
    from .target import TreeKVCache

    served = 0
    for n, past in ((1, 0), (1, 9), (3, 12), (7, 23), (16, 40), (20, 3), (2, 300), (9, 200), (33, 150)):
        past = min(past, step.capacity - n - 1)
        if step._route(n, past) is None:
            continue  # a step the program does not take runs eager
        served += 1
        for buf in keys + values:
            buf.copy_(torch.randn(buf.shape, generator=g) * 0.5)
        tokens, positions, tree, rows, _ = _example(target, n, past, seed=n)
        mine = TreeKVCache.over([k.clone() for k in keys], [v.clone() for v in values], past)
        pre_c, logits_c = step(mine, tokens, positions, tree, None)
        target.cache.length = past
        pre_e, logits_e = target.forward(tokens, positions, tree)
        scale = max(1.0, float(logits_e.abs().max()))
        worst = max(float((logits_c - logits_e).abs().max()) / scale,
                    float((pre_c - pre_e).abs().max()) / max(1.0, float(pre_e.abs().max())),
                    max(float((a[:, :, past:past + n] - b[:, :, past:past + n]).abs().max())
                        for a, b in zip(mine.buffers()[0], keys)))
        if not worst <= tolerance:  # also catches NaN
            raise CloverError(f"the compiled step disagrees with the eager one (relative error {worst:.2g} "
                              f"with {n} new tokens after {past})")
    if served < 5:
        raise CloverError("the compiled step takes too few of the step sizes it was built for")


@torch.inference_mode()
def measure(step: "CompiledStep", target, repeats: int = 7) -> dict[str, float]:
    """Seconds per compiled forward by number of new tokens (the best of `repeats`). The sizes take turns, one
    forward each per round: a build often shares the machine (with the chat it runs beside), and a busy spell then
    slows every size alike instead of a few of them, which would skew the trees the engine sizes from this table
    (sizes it does not run keep these costs). The first round only warms up."""
    from .target import TreeKVCache

    keys, values = target.cache.buffers()
    cache = TreeKVCache.over(keys, values, 0)
    examples = {}
    for n in SIZES:
        past = min(200, step.capacity - n - 1)
        if step._route(n, past) is not None:
            examples[n] = (past, _example(target, n, past, seed=n)[:3])
    best = {n: float("inf") for n in examples}
    for round_ in range(repeats + 1):
        for n, (past, (tokens, positions, tree)) in examples.items():
            cache.length = past
            t = time.perf_counter()
            step(cache, tokens, positions, tree, None)
            if round_:
                best[n] = min(best[n], time.perf_counter() - t)
    return {str(n): seconds for n, seconds in best.items()}


# ---------------------------------------------------------------------------------------------------------------
# Running a package

def fits(capacity: int, cache, n: int) -> bool:
    """Whether a program built for `capacity` can write n new tokens into `cache`."""
    return cache.capacity == capacity and cache.length + n < capacity and cache.buffers() is not None


def _marker(past: int, memo: dict) -> torch.Tensor:
    """The `past` input: a [past, 0] tensor (no data; its length is what counts), made once per length."""
    marker = memo.get(past)
    if marker is None:
        marker = torch.empty(past, 0)
        if len(memo) < 4096:
            memo[past] = marker
    return marker


def padded_size(n: int) -> int:
    """The size a step of n new tokens runs as (see SIZES)."""
    for size in SIZES:
        if size >= n:
            return size
    return -(-n // 64) * 64


class CompiledStep:
    """A loaded package: call it like Target.forward, with the cache whose buffers it writes."""

    def __init__(self, path: Path, capacity: int, ranges: dict[str, dict[str, list[int]]]):
        self.path = Path(path)
        self.capacity = capacity
        # (new tokens from, to, committed tokens from, to, program) for each program, fewest rows first; a program
        # whose least and most rows are the same is static: it takes exactly that many and makes all their logits
        self.programs = sorted(((*ranges[name]["n"], *ranges[name]["past"], Program(self.path / name))
                                for name in ranges), key=lambda program: program[:4])
        self._inputs: dict[int, tuple] = {}
        self._past: dict[int, torch.Tensor] = {}
        self._tril = np.tril(np.ones((SIZES[-1], SIZES[-1]), dtype=bool))
        self._first = torch.zeros(1, dtype=torch.long)
        self._static = {id(program) for lo, hi, *_, program in self.programs if lo == hi}
        self._routed = (-1, -1, None)  # (n, past, route) of the last fits(): the call that follows runs it

    def fits(self, cache, n: int) -> bool:
        if not fits(self.capacity, cache, n):
            return False
        route = self._route(n, cache.length)
        self._routed = (n, cache.length, route)
        return route is not None

    @staticmethod
    def pieces(n: int) -> list[int]:
        """The row counts a causal forward of n tokens runs as, in order (see PIECES)."""
        out = []
        for size in PIECES:
            while n > SIZES[-1] and n >= size:
                out.append(size)
                n -= size
        return out + [n] * (n > 0)

    def _route(self, n: int, past: int):
        """(size to run, program) for n new tokens after `past`: the smallest static program of n rows or more, else
        the padded size when a program takes it, else n itself (no room to pad at the end of the buffers); None when
        no program takes any."""
        for lo, hi, past_lo, past_hi, program in self.programs:
            if past_lo <= past <= past_hi:
                for size in ((lo,) if lo == hi else (padded_size(n), n)):
                    if n <= size and lo <= size <= hi and past + size < self.capacity:
                        return size, program
        return None

    def _causal(self, n: int) -> np.ndarray:
        if n <= SIZES[-1]:
            return self._tril[:n, :n]
        return np.tril(np.ones((n, n), dtype=bool))

    def _scratch(self, size: int):
        """Input buffers of one padded size: tokens, positions, tree mask, rows (made once, reused), and numpy views
        of the first three, through which a step writes its inputs: right after the last step's forward has
        flushed the CPU's caches, a numpy copy costs a fraction of a torch one (docs/BENCHMARKS.md)."""
        bufs = self._inputs.get(size)
        if bufs is None:
            tensors = (torch.zeros(size, dtype=torch.long), torch.zeros(size, dtype=torch.long),
                       torch.ones(size, size, dtype=torch.bool).tril(), torch.arange(size))
            bufs = self._inputs[size] = (*tensors, *(t.numpy() for t in tensors[:3]))
        return bufs

    def __call__(self, cache, tokens, positions, tree_mask, logits_for):
        if not torch.is_inference_mode_enabled():  # Target.forward enters it: not again (a step's every us counts)
            with torch.inference_mode():
                return self(cache, tokens, positions, tree_mask, logits_for)
        n = tokens.numel()
        if tree_mask is None and n > SIZES[-1]:
            wanted = None if logits_for is None else torch.arange(n)[logits_for]
            if wanted is None or bool((wanted[1:] > wanted[:-1]).all()):
                return self._in_pieces(cache, tokens, positions, wanted)
        return self._run(cache, tokens, positions, tree_mask, logits_for, cache.length)

    def _in_pieces(self, cache, tokens, positions, wanted):
        """A causal forward in PIECES: each piece sees the ones before it as committed (their keys are in the
        buffers already), so the result is the whole forward's, up to rounding."""
        pres, logits, start = [], [], 0
        for size in self.pieces(tokens.numel()):
            end = start + size
            rows = None if wanted is None else wanted[(wanted >= start) & (wanted < end)] - start
            keep = None if rows is None else rows.numel()
            if keep == 0:
                rows = self._first  # a program makes the logits of one row at least: made, then dropped
            pre, out = self._run(cache, tokens[start:end], positions[start:end], None, rows, cache.length + start)
            pres.append(pre)
            logits.append(out if keep is None else out[:keep])
            start = end
        return torch.cat(pres), torch.cat(logits)

    def _run(self, cache, tokens, positions, tree_mask, logits_for, past):
        n = tokens.numel()
        routed_n, routed_past, route = self._routed
        size, run = route if routed_n == n and routed_past == past and route is not None else self._route(n, past)
        tok, pos, tree, rows, tok_np, pos_np, tree_np = self._scratch(size)
        tok_np[:n] = tokens.numpy()
        pos_np[:n] = positions.numpy()
        # Rows of real tokens: their tree, nothing of the padding. Padding rows keep whatever they hold (valid token
        # ids, positions and masks of an earlier step): they see the committed tokens, so nothing is NaN, and nothing
        # reads their outputs or the keys they write after the committed ones.
        tree_np[:n] = False
        tree_np[:n, :n] = tree_mask.numpy() if tree_mask is not None else self._causal(n)
        keys, values = cache.buffers()
        if id(run) in self._static:  # the logits of all its rows: the wanted ones are picked here
            pre, logits = run(tok, pos, tree, rows, _marker(past, self._past), *keys, *values)
            if n < size:
                pre, logits = pre[:n], logits[:n]
            return pre, (logits if logits_for is None else logits[logits_for])
        rows = rows[:n] if logits_for is None else rows[:n][logits_for]
        pre, logits = run(tok, pos, tree, rows, _marker(past, self._past), *keys, *values)
        return pre[:n], logits


# ---------------------------------------------------------------------------------------------------------------
# The draft heads' programs

# The programs every heads package holds; a Clover-2 package also holds the fixed-size augment programs its metadata
# names (augment_sizes). Bump HEADS_PROGRAM_VERSION when they change: old heads packages are rebuilt, not reused.
HEADS_PROGRAM_VERSION = 3
HEADS_PACKAGES = {"clover": ("augment.pt2", "level0.pt2", "level.pt2", "level-small.pt2"),
                  "medusa": ("levels.pt2",)}
MAX_LEVEL_ROWS = 64  # nodes a Clover level can expand at once in the compiled program
# As for the target's step: up to this many rows (a catch-up after a short accepted path, a level of a few nodes:
# nearly every heads call) a program of its own with inductor's autotuned matrix-vector kernels, which read the
# weights 2-3x faster there than the oneDNN products of the programs for any size.
SMALL_ROWS = 4


def augment_sizes() -> tuple[int, ...]:
    """The fixed sizes of a Clover-2 catch-up's own programs: those of static_sizes() up to SMALL_ROWS (default 1, 2
    and 4). A catch-up of up to 4 positions (nearly all) runs the smallest >= its size, padded. Built for exactly its
    rows, the augmenting block cost 0.41-0.60 ms right after a target step, against 0.93-1.20 ms in a program for 1-4
    rows (bundled heads, AVX2 machine; docs/BENCHMARKS.md)."""
    return tuple(n for n in static_sizes() if n <= SMALL_ROWS)


def augment_name(n: int) -> str:
    return f"augment-{n}.pt2"


def heads_program_names(kind: str, augment_ranges: dict | None) -> tuple[str, ...]:
    """The programs of a heads package of `kind` whose metadata gives these augment programs' ranges."""
    fixed = HEADS_PACKAGES[kind]
    return fixed + tuple(name for name in augment_ranges or () if name not in fixed)


class HeadsPrograms:
    """The compiled twins of a heads drafter's per-step modules (drafters/clover2.py, medusa.py): for Clover-2 the
    augmenting block (`augment`, with the heads' own cache) and the first and later levels (`levels`); for Medusa
    all heads at once (`levels`). Same inputs and outputs as the eager modules. A Clover-2 catch-up of up to
    SMALL_ROWS positions runs the program built for the smallest fixed size >= n (padded), a level of up to
    SMALL_ROWS nodes the small twin of the level program."""

    def __init__(self, path: Path, kind: str, capacity: int, augment_ranges: dict | None = None):
        self.path, self.kind, self.capacity = Path(path), kind, capacity
        # program name -> {"n": [least, most], "past": [least, most]}: the sizes each augment program takes
        self.augment_ranges = augment_ranges
        programs = {name: Program(self.path / name) for name in heads_program_names(kind, augment_ranges)}
        self._past: dict[int, torch.Tensor] = {}
        if kind == "clover":
            # fixed sizes first, smallest first; then the program for any size
            fixed = sorted((r["n"][0], name) for name, r in (augment_ranges or {}).items() if r["n"][0] == r["n"][1])
            self._augments = [(name, programs[name]) for _, name in fixed] + [("augment.pt2", programs["augment.pt2"])]
            level0, level, small = programs["level0.pt2"], programs["level.pt2"], programs["level-small.pt2"]
            self.levels = (lambda states, tokens: tuple(level0(states.contiguous(), tokens)),
                           lambda states, tokens: tuple((small if states.shape[0] <= SMALL_ROWS else level)(
                               states.contiguous(), tokens)))
        else:
            self.levels = lambda hidden: tuple(programs["levels.pt2"](hidden.contiguous()))

    def _augment_for(self, cache, n: int):
        """(the augment program that takes n new positions after the cache's, the rows it runs them as), or None."""
        if self.augment_ranges is None:
            return None
        for name, program in self._augments:
            r = self.augment_ranges.get(name)
            if r is None:
                continue
            lo, hi = r["n"]
            rows = lo if lo == hi else padded_size(n)  # a fixed-size program: its rows; else the next of SIZES
            if n <= rows and lo <= rows <= hi and r["past"][0] <= cache.length <= r["past"][1] \
                    and fits(self.capacity, cache, rows):
                return program, rows
        return None

    def fits(self, cache, n: int) -> bool:
        return self._augment_for(cache, n) is not None

    @torch.inference_mode()
    def augment(self, hidden, tokens, positions, cache):
        """States of the n new positions. Run as the rows of a fixed-size program, or padded_size(n) rows (the block is
        causal: rows after the real ones change nothing before them, and the keys they write lie past the committed
        ones)."""
        n = tokens.numel()
        program, size = self._augment_for(cache, n)
        if size != n:
            hidden = torch.cat([hidden, hidden.new_zeros(size - n, hidden.shape[1])])
            tokens = torch.cat([tokens, tokens.new_zeros(size - n)])
            positions = torch.cat([positions, positions[-1:].expand(size - n)])
        keys, values = cache.buffers()
        return program(hidden.contiguous(), tokens, positions, _marker(cache.length, self._past), *keys,
                       *values)[0][:n]


def inspect_heads(d: Path | None, full: bool = False):
    """(the metadata of complete, sound heads' programs built into `d`, None), (None, None) when there are none,
    (None, what is wrong) when they are damaged (as inspect_package)."""
    if d is None:
        return None, None
    meta, why = _read_meta(d)
    if meta is None:
        return None, why
    if meta.get("program") != HEADS_PROGRAM_VERSION:
        return None, f"they are of program version {str(meta.get('program'))[:20]}, not {HEADS_PROGRAM_VERSION}"
    kind, augment_ranges = meta.get("kind"), meta.get("augment_ranges")
    if not isinstance(kind, str) or kind not in HEADS_PACKAGES:
        return None, "their kind is not one of clover's"
    if not _count(meta.get("capacity"), 2, MAX_CAPACITY) or not _count(meta.get("topk"), 1, 1 << 16):
        return None, "their capacity or top-k is not a number"
    if kind == "clover" or augment_ranges is not None:
        why = _ranges_problem(augment_ranges, AUGMENT_NAME)
        if why:
            return None, why
    why = _files_problem(d, meta, heads_program_names(kind, augment_ranges), full)
    if why:
        return None, why
    return meta, None


def find_heads(d: Path | None) -> dict | None:
    """The metadata of complete, sound heads' programs built into `d`, or None."""
    return inspect_heads(d)[0]


def heads_damage(d: Path | None) -> str | None:
    """What is wrong with the heads' programs in `d` (every file's checksum checked), or None."""
    return inspect_heads(d, full=True)[1]


def heads_dir(step_dir: Path, heads_path: Path, topk: int) -> Path:
    """Where the programs of these heads (for the model whose step package is `step_dir`) are built."""
    digest = hashlib.sha256(json.dumps([_fingerprint_files(Path(heads_path)), str(Path(heads_path).resolve()),
                                        topk]).encode()).hexdigest()[:12]
    return step_dir.with_name(f"{step_dir.name}-heads-{digest}")


def heads_kind(drafter) -> str | None:
    from .drafters.clover2 import CloverDrafter
    from .drafters.medusa import MedusaDrafter

    return {CloverDrafter: "clover", MedusaDrafter: "medusa"}.get(type(drafter))


def build_heads_for(drafter, capacity: int, out: Path, log=print, autotune: bool = True) -> dict:
    """Export, compile and check the programs of a heads drafter (on an eager target); write them to `out`.
    autotune=False compiles the programs meant for autotuning without it (quicker to build, slower to run)."""
    t0 = time.perf_counter()
    kind = heads_kind(drafter)
    H = drafter.heads.cfg.hidden_size
    dev = drafter.target.device
    Dim = torch.export.Dim
    exported = {}
    if kind == "clover":
        drafter.cache.grow_to(capacity)
        drafter.reset(0)
        drafter.observe(torch.zeros(1, H, device=dev), torch.zeros(1, dtype=torch.long, device=dev))
        drafter._catch_up()  # allocates the heads' cache buffers at full capacity
        drafter.reset(0)
        keys, values = drafter.cache.buffers()
        ranges = {}
        # (program, fewest and most new positions, example size, autotuned): one for any size, one for each fixed size
        for name, least, most, example_n, tuned in (("augment.pt2", 1, capacity - 1, 5, False),
                                                    *((augment_name(m), m, m, m, True) for m in augment_sizes())):
            example = (torch.randn(example_n, H), torch.arange(example_n), torch.arange(20, 20 + example_n),
                       torch.empty(20, 0))
            n = Dim("n", min=least, max=most) if least < most else None
            rows = {0: n} if n is not None else None
            program = export(OnBuffers(drafter.augment_block, 3).eval(), (*example, *keys, *values),
                             ((rows, rows, rows, {0: Dim.DYNAMIC}, *(None for _ in keys + values)),))
            exported[name] = (program, tuned)
            ranges[name] = input_ranges(program, {"n": (0, 0), "past": (3, 0)})
        exported["level0.pt2"] = (export(drafter.levels[0].eval(), (torch.randn(1, H), torch.tensor([3])), None),
                                  True)
        for name, most, example_n, tuned in (("level.pt2", MAX_LEVEL_ROWS, 3, False),
                                             ("level-small.pt2", SMALL_ROWS, 2, True)):
            rows = Dim("rows", min=1, max=most)
            exported[name] = (export(drafter.levels[1].eval(), (torch.randn(example_n, H),
                                                                torch.arange(3, 3 + example_n)),
                                     ({0: rows}, {0: rows})), tuned)
    else:
        exported["levels.pt2"] = (export(drafter.levels.eval(), (torch.randn(1, H),), None), True)
        ranges = None
    log(f"compiling the {kind} heads' programs ... {time.perf_counter() - t0:.0f} s")
    with building(out) as tmp:
        for name, (program, tuned) in exported.items():
            compile_package(program, tmp / name, autotune and tuned)
        check_heads(HeadsPrograms(tmp, kind, capacity, ranges), drafter)
        meta = {"program": HEADS_PROGRAM_VERSION, "kind": kind, "capacity": capacity, "topk": drafter.grower.topk,
                "augment_ranges": ranges, "build_s": round(time.perf_counter() - t0, 1),
                "files": sums(tmp, heads_program_names(kind, ranges))}
        atomic.write_text(tmp / META, json.dumps(meta, indent=1))
    drafter.reset(0)
    return meta


@torch.inference_mode()
def check_heads(programs: HeadsPrograms, drafter, tolerance: float = 1e-3):
    """The heads' programs must compute what their eager modules compute, on random states and tokens."""
    g = torch.Generator().manual_seed(2)
    H = drafter.heads.cfg.hidden_size
    vocab = drafter.target.config.vocab_size

    def close(a, b, what):
        worst = float((a - b).abs().max()) / max(1.0, float(b.abs().max()))
        if not worst <= tolerance:
            raise CloverError(f"the compiled {programs.kind} heads disagree with the eager ones ({what}: relative "
                              f"error {worst:.2g})")

    def same_top(compiled, eager, what):
        (cp, ci), (ep, ei) = compiled, eager
        close(cp, ep, what)
        distinct = (ep[..., :-1] - ep[..., 1:]).abs() > 1e-4  # ranks of near-equal probabilities may swap
        if not torch.equal(ci[..., :-1][distinct], ei[..., :-1][distinct]):
            raise CloverError(f"the compiled {programs.kind} heads rank tokens differently ({what})")

    if programs.kind == "medusa":
        hidden = torch.randn(1, H, generator=g)
        same_top(programs.levels(hidden), drafter.levels(hidden), "levels")
        return
    keys, values = drafter.cache.buffers()
    served = 0
    for n, past in ((1, 0), (6, 17), (3, 100), (9, 40)):
        drafter.cache.length = past
        if not programs.fits(drafter.cache, n):
            continue
        served += 1
        for buf in keys + values:
            buf.copy_(torch.randn(buf.shape, generator=g) * 0.5)
        hidden = torch.randn(n, H, generator=g)
        tokens = torch.randint(0, vocab, (n,), generator=g)
        positions = torch.arange(past, past + n)
        mine = type(drafter.cache).over([k.clone() for k in keys], [v.clone() for v in values], past)
        drafter.cache.length = past
        close(programs.augment(hidden, tokens, positions, mine),
              drafter.augment_block(hidden, tokens, positions, drafter.cache), f"augment {n} after {past}")
        for a, b in zip(mine.buffers()[0] + mine.buffers()[1], keys + values):
            close(a[:, :, past:past + n], b[:, :, past:past + n], "the heads' cache")
    if served < 2:
        raise CloverError(f"the compiled {programs.kind} heads take too few of the sizes they were built for")
    for first, rows in ((True, 1), (False, 1), (False, SMALL_ROWS), (False, SMALL_ROWS + 1)):
        states, tokens = torch.randn(rows, H, generator=g), torch.randint(0, vocab, (rows,), generator=g)
        compiled = programs.levels[0 if first else 1](states, tokens)
        eager = drafter.levels[0 if first else 1](states, tokens)
        close(compiled[0], eager[0], "level states")
        same_top(compiled[1:], eager[1:], f"level of {rows}")
    drafter.cache.length = 0


@dataclass
class Package:
    path: Path
    capacity: int
    verify_s: dict[int, float]
    ranges: dict

    @staticmethod
    def find(d: Path) -> "Package | None":
        """The package built into directory `d`, if there is a complete and sound one (metadata and file sizes
        checked; see inspect_package)."""
        return inspect_package(d)[0]

    def load(self) -> CompiledStep:
        """The package's programs loaded, after checking every file against its checksum (a file damaged in place,
        its size unchanged); raises ValueError when one does not match, or whatever loading raises."""
        why = _files_problem(self.path, _read_meta(self.path)[0] or {}, self.ranges, full=True)
        if why:
            raise ValueError(why)
        return CompiledStep(self.path, self.capacity, self.ranges)


# ---------------------------------------------------------------------------------------------------------------
# In a session

class StepCompiler:
    """The compiled step's life in a session. mode auto: a package already in the cache is used at once; otherwise
    one is built in the background (`start(background=True)`, chat) while replies run eager, and swapped in by
    `poll()` between steps when ready. mode on: built now if needed (start waits). mode off: always eager.
    A model or machine it cannot serve, or a build that fails, leaves the session eager with one warning line."""

    def __init__(self, mode: str, target, model_path: Path, dtype: torch.dtype, device: torch.device,
                 load_in_8bit: bool = False, trust_remote_code: bool = False, allow_pickle: bool = False,
                 warn=None):
        self.mode, self.target, self.model_path = mode, target, Path(model_path)
        self.dtype, self.device = dtype, device
        self.trust_remote_code, self.allow_pickle = trust_remote_code, allow_pickle
        # a draft model's own compiled step (use_drafter with a ModelDrafter): a StepCompiler of its own, built after
        # this one; `_started` is what start() was last asked (None: not yet), which a draft set later also gets
        self.draft: StepCompiler | None = None
        self._started: bool | None = None
        self._draft_waits = False  # its build starts when this one's ends
        self.warn = warn or (lambda text: print(f"clover: {text}", file=sys.stderr))
        self.capacity = capacity_for(target.max_context)
        self.builder: Builder | None = None
        self.verify_s: dict[int, float] | None = None  # the package's measured costs, once active
        self.listeners: list = []  # called with verify_s when the compiled step becomes active
        self.just_activated = False  # set when poll() swapped the step in; the chat notes it and clears it
        self.heads = self.heads_path = self.heads_out = None  # the drafter's heads (use_drafter) and their programs
        self.eager_for = None  # a drafter that needs the eager step (EAGLE-3 reads layers the program does not return)
        self._loaded: dict[Path, HeadsPrograms] = {}  # heads' programs loaded so far, by directory
        self._threads = 0  # torch's thread count to restore when a background build ends (0: none changed)
        self._said_other = False  # said that another process is building this package
        self.out = package_dir(self.model_path, dtype, self.capacity)
        why = None if mode == "off" else unsupported(target.model, device, dtype, load_in_8bit)
        self.state, self.reason = "off", "--compile off"
        self.graphs = None  # on CUDA: the static step whose CUDA graphs are captured as each size is first used
        if why:
            self.state, self.reason = "eager", why
            if mode == "on":
                self.warn(f"no compiled step: {why}; running eager")
        elif mode != "off" and device.type == "cuda":
            from .graphs import attach, check

            self.graphs = attach(target, self.capacity)
            why = check(self.graphs)
            if why:
                target.program, self.graphs = None, None
                self.state, self.reason = "eager", why
                self.warn(f"no CUDA graphs: {why}; running eager")
            else:
                self.state, self.reason = "active", "active"
                self.graphs.on_failure = self._graphs_failed
        elif mode != "off" and not self._activate():
            self.state, self.reason = "missing", "not built yet"
            if building_elsewhere(self.out):  # another clover process is building it: use it when it is done
                self._watch(Builder(self.job(), watch=True), step=True)

    @property
    def active(self) -> bool:
        return self.state == "active" and self.eager_for is None

    def describe(self) -> str:
        if self.state == "building":
            return "compiled step building in the background (eager until it is ready)"
        if self.eager_for is not None and self.state != "off":
            return f"eager ({self.eager_for} reads target layers the compiled step does not return)"
        if self.state != "active":
            return f"eager ({self.reason})"
        if self.graphs is not None:
            heads = "; heads too" if self.heads is not None and self.heads.programs is not None else ""
            return "CUDA graphs active" + heads + ("; draft model " + self.draft._draft_state() if self.draft else "")
        if self.draft is not None:
            return "compiled step active; draft model " + self.draft._draft_state()
        if self.heads is None or self.heads_out is None:
            return "compiled step active"
        if self.heads.programs is not None:
            return "compiled step and heads active"
        return "compiled step active; heads " + ("building in the background" if self.builder else "eager")

    def _draft_state(self) -> str:
        """What describe() says of a draft model's step (this compiler being the draft's)."""
        if self.state == "active":
            return "CUDA graphs" if self.graphs is not None else "compiled"
        if self.state == "building":
            return "compiling in the background"
        return "eager" if self.state == "missing" else f"eager ({self.reason})"

    def use_drafter(self, drafter, heads_path, draft_path=None) -> None:
        """The session's drafter (again after a switch): its heads' programs are attached when they are built, and a
        draft model (`draft_path`: a ModelDrafter's model directory) gets a compiled step of its own."""
        self._use_draft_model(drafter, draft_path)
        heads = drafter.primary  # the default drafter merges the heads with lookup
        self.eager_for = heads.name if heads.feature_layers else None
        self.heads = heads if heads_kind(heads) else None
        self.heads_path = Path(heads_path) if heads_path is not None and self.heads is not None else None
        self.heads_out = None
        if self.graphs is not None and self.heads is not None:
            self._attach_graphs(self.heads)
        if self.heads_path is not None and self.state not in ("off", "eager") and self.graphs is None:
            self.heads_out = heads_dir(self.out, self.heads_path, self.heads.grower.topk)
            self._activate_heads()

    def _graphs_failed(self, why: str) -> None:
        self.state, self.reason, self.graphs = "eager", why, None
        self.warn(f"no CUDA graphs: {why}; running eager")

    def _attach_graphs(self, drafter) -> bool:
        """On CUDA: the heads' per-step modules as static calls captured as graphs (clover_cli/graphs.py)."""
        from .graphs import heads_graphs

        programs = heads_graphs(drafter, self.capacity)
        if programs is None:
            return False
        programs.on_failure = lambda why: self.warn(f"no CUDA graphs for the heads: {why}; they run eager")
        drafter.attach_programs(programs)
        return True

    def _use_draft_model(self, drafter, draft_path) -> None:
        runner = drafter.draft  # a ModelDrafter runs its model as a Target
        if runner is None or draft_path is None or self.state in ("off", "eager", "failed"):
            self.draft = None
            return
        if self.draft is None or self.draft.target is not runner:
            self.draft = StepCompiler(self.mode, runner, draft_path, self.dtype, self.device,
                                      trust_remote_code=self.trust_remote_code, warn=self.warn)
            if self._started is not None:  # the session already started its builds: this one follows
                self._start_draft(self._started)

    def _start_draft(self, background: bool) -> None:
        if self.builder is None:
            self.draft.start(background)
        else:
            self._draft_waits = background

    def ready_draft(self, drafter, draft_path) -> bool:
        """Compile a draft model's step for a ModelDrafter (clover bench makes one per run), waiting for the build
        when it is not cached. False when the compiled step is not in use or the build failed."""
        if self.state != "active" or drafter.draft is None:
            return False
        if self.draft is None or self.draft.target is not drafter.draft:
            self.draft = StepCompiler("on", drafter.draft, draft_path, self.dtype, self.device,
                                      trust_remote_code=self.trust_remote_code, warn=self.warn)
        self.draft.start(background=False)
        return self.draft.active

    def job(self) -> Job:
        return Job(self.model_path, self.out, self.capacity, self.trust_remote_code, self.allow_pickle,
                   self.heads_path if self.heads_out else None, self.heads_out,
                   self.heads.grower.topk if self.heads is not None else 8)

    def start(self, background: bool) -> None:
        """Build what is not cached (the step, the heads' programs, then a draft model's step): wait for it (mode on),
        or go on while it builds in the background (mode auto, background)."""
        self._started = background
        self._start_own(background)
        if self.draft is not None:
            self._start_draft(background)

    def _start_own(self, background: bool) -> None:
        if self.graphs is not None:
            return  # nothing to build: the graphs are captured as they are first used
        if self.builder is None:
            step, heads = self.job().missing() if self.state in ("missing", "active") else (False, False)
            step = step and self.state == "missing"
            if not (step or heads) or (self.mode == "auto" and not background):
                return
            builder = self._builder(self.job(), step)
            if builder is None:
                return
            self._watch(builder, step)
        else:
            step = self.state == "building"
        if self.mode == "on":
            if not getattr(self.builder, "other", False):
                print(f"clover: compiling the {'step' if step else 'heads'} of {self.model_path.name} (once per model "
                      f"and machine; `clover compile` does it ahead) …", file=sys.stderr)
            self.builder.wait()
            self.poll()
            self.just_activated = False

    def _builder(self, job: Job, step: bool) -> "Builder | None":
        """A Builder for `job`, or None (with one warning line: eager) when the compile cache cannot be written."""
        try:
            return Builder(job)
        except OSError as e:
            where = e.filename or job.out
            why = f"cannot write the compile cache: {e.strerror or type(e).__name__}: {where}"
            if step:
                self.state, self.reason = "failed", why
                self.warn(f"no compiled step ({why}); running eager")
            else:
                self.warn(f"no compiled heads ({why}); they run eager")
            return None

    def _watch(self, builder: Builder, step: bool) -> None:
        self.builder = builder
        self._say_other()
        if step:
            self.state, self.reason = "building", "building"
        if self.mode == "auto" and not self._threads and torch.get_num_threads() > 1:
            # Replies run meanwhile. Several threads of ours would wait on each other at every operator whenever the
            # build takes one of their cores (a reply 20-30x slower on two cores): one thread until it is done.
            self._threads = torch.get_num_threads()
            torch.set_num_threads(1)

    def _say_other(self) -> None:
        """One line, once, when the build is another process's (this one runs eager meanwhile and picks its package
        up when it lands)."""
        if getattr(self.builder, "other", False) and not self._said_other:
            self._said_other = True
            self.warn(f"another process is building the compiled step of {self.model_path.name}; "
                      + ("waiting for it" if self.mode == "on" else "running eager meanwhile"))

    def poll(self) -> bool:
        """Swap in what a finished build made; True when the compiled step just became active."""
        if self.draft is not None:
            self.draft.poll()
        if self.builder is None:
            return False
        finished = self.builder.done()
        self._say_other()
        if not finished:
            return False
        builder, self.builder = self.builder, None
        if self._threads:
            torch.set_num_threads(self._threads)
            self._threads = 0
        if self._draft_waits and self.draft is not None:
            self._draft_waits = False
            self.draft.start(background=True)
        became = False
        if self.state == "building":
            became = self._activate()
            if not became and self.state == "building":
                self.state, self.reason = "failed", builder.error()
                self.warn(f"no compiled step ({self.reason}); running eager")
        if self.heads_out is not None and self.heads.programs is None and not self._activate_heads() \
                and self.state == "active":
            self.warn(f"no compiled heads ({builder.error()}); they run eager")
        self.just_activated = self.just_activated or became
        keep_loaded()  # what the build brought in lives as long as the session, as the model does
        return became

    def _discard(self, d: Path, seen, why: str, what: str = "compiled step") -> None:
        """A damaged package: one line, and removed (a build makes it again: chat's in the background, `clover
        compile`)."""
        gone = discard(d, seen)
        self.warn(f"the {what}'s package {d} is damaged ({why}){': discarded' if gone else ''}; running eager until "
                  f"it is built again")

    def _activate(self) -> bool:
        seen = _fingerprint(self.out)
        pkg, why = inspect_package(self.out)
        if pkg is None:
            if why:
                self._discard(self.out, seen, why)
            return False
        try:
            step = pkg.load()
        except Exception as e:  # noqa: BLE001 - a package that does not load is damaged: built again
            self._discard(self.out, seen, (str(e).splitlines() or [""])[0][:200] if isinstance(e, ValueError)
                          else f"it does not load: {type(e).__name__}")
            return False
        self.target.attach_program(step)
        self.verify_s = pkg.verify_s
        self.state, self.reason = "active", "active"
        for listener in self.listeners:
            listener(dict(pkg.verify_s), padded=True)
        return True

    def _activate_heads(self) -> bool:
        return self._attach_heads(self.heads, self.heads_out)

    def _attach_heads(self, drafter, out: Path) -> bool:
        """Attach the heads' programs built into `out` to `drafter` (loaded once per session, shared)."""
        programs = self._loaded.get(out)
        if programs is None:
            seen = _fingerprint(out)
            meta, why = inspect_heads(out, full=True)
            if why:
                self._discard(out, seen, why, "heads")
            if meta is None or meta.get("kind") != heads_kind(drafter) or meta.get("topk") != drafter.grower.topk:
                return False
            try:
                programs = self._loaded[out] = HeadsPrograms(out, meta["kind"], meta["capacity"],
                                                             meta.get("augment_ranges"))
            except Exception as e:  # noqa: BLE001 - programs that do not load are damaged: built again
                self._discard(out, seen, f"they do not load: {type(e).__name__}", "heads")
                return False
        drafter.attach_programs(programs)
        return True

    def ready_heads(self, drafter, heads_path: Path) -> bool:
        """Attach compiled programs to another heads drafter (clover bench makes one per run), building them first
        (waiting) when they are not cached yet. False when the compiled step is not in use or the build failed."""
        if self.state != "active" or heads_kind(drafter) is None:
            return False
        if self.graphs is not None:
            return self._attach_graphs(drafter)
        out = heads_dir(self.out, Path(heads_path), drafter.grower.topk)
        if out not in self._loaded and find_heads(out) is None:
            job = Job(self.model_path, self.out, self.capacity, self.trust_remote_code, self.allow_pickle,
                      Path(heads_path), out, drafter.grower.topk)
            builder = self._builder(job, step=False)
            if builder is None:
                return False
            builder.wait()
            if find_heads(out) is None:
                self.warn(f"no compiled heads ({builder.error()}); they run eager")
                return False
        return self._attach_heads(drafter, out)


def cost_table(data) -> dict[int, float]:
    """A stored table of step costs ({"n": seconds}) as {n: seconds}; ValueError when it is not one."""
    if not isinstance(data, dict):
        raise ValueError("not a table")
    table = {}
    for k, v in data.items():
        if not (k.isdigit() and 0 < int(k) <= 1 << 16 and _seconds(v)):
            raise ValueError(f"entry {k[:20]!r}")
        table[int(k)] = float(v)
    return table


class StepCosts:
    """What verifying n tokens costs, measured once and kept on disk per model, device, dtype, thread count and
    step (eager or compiled), so a new process sizes its trees without timing its own forwards again. The engine
    refreshes the table from the forwards it runs and saves it back after each reply."""

    def __init__(self, model_path: Path, device: torch.device, dtype: torch.dtype, compiler: StepCompiler | None):
        self.model_path, self.device, self.dtype, self.compiler = Path(model_path), device, dtype, compiler

    @property
    def padded(self) -> bool:
        """The compiled step runs a tree as the next of its SIZES: costs are steps between the table's sizes."""
        return self.compiler is not None and self.compiler.active

    def _path(self) -> Path:
        step = "compiled" if self.padded else "eager"
        name = package_key(self.model_path, self.dtype, 0)
        dev = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        from .packed import supported

        # the threads in use now (one while a build runs beside us)
        tag = hashlib.sha256(f"{dev}|{torch.get_num_threads()}|{step}|{supported()}".encode()).hexdigest()[:10]
        return cache_root() / "costs" / f"{name}-{step}-{tag}.json"

    def load(self) -> dict[int, float] | None:
        table = read_cache_json(self._path(), cost_table)
        if not table and self.compiler is not None and self.compiler.active:
            table = dict(self.compiler.verify_s or {})  # measured by the builder
        return table or None

    def reference(self) -> dict[int, float] | None:
        """Costs of every size measured back to back: the compiled package's, taken when it was built (the stored
        table's sizes may have been timed at different moments, some long ago); None when eager."""
        if self.padded and self.compiler.verify_s:
            return dict(self.compiler.verify_s)
        return None

    def save(self, table: dict[int, float]) -> None:
        try:
            atomic.write_text(self._path(), json.dumps({str(k): v for k, v in sorted(table.items())}))
        except OSError:
            pass  # a cache that cannot be written only costs the next process a measurement

    def choices_path(self, heads_path: Path, repetition_penalty: float = 1.0, temperature: float = 0.0) -> Path:
        """Where the default drafter's learned choice (drafters.ChoiceStats: when a step pays for running the heads)
        is kept: beside this table, per heads directory and its files, as it depends on both step costs and heads,
        and per temperature and repetition penalty (drafts fare far worse against a sampled or penalised target)."""
        heads = hashlib.sha256(repr((str(Path(heads_path).resolve()), _fingerprint_files(Path(heads_path))))
                               .encode()).hexdigest()[:10]
        table = self._path()
        mode = "" if temperature == 0.0 else f"-t{temperature:g}"
        mode += "" if repetition_penalty == 1.0 else f"-penalty{repetition_penalty:g}"
        return table.with_name(f"{table.stem}-choice-{heads}{mode}.json")

    @staticmethod
    def load_choices(choices, path: Path) -> None:
        """Restore `choices` from `path` (choices_path) when it holds a state (a missing or damaged file leaves them
        as they are: only the learning starts over)."""
        def restore(state):
            if isinstance(state, dict) and state.get("version") != getattr(choices, "VERSION", None):
                return  # learned by another version of clover: started over, nothing to say
            choices.restore(state)

        read_cache_json(path, restore)

    @staticmethod
    def save_choices(choices, path: Path) -> None:
        try:
            atomic.write_text(path, json.dumps(choices.state()))
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------------------------
# Building in a child process

def _lowest_priority():
    try:
        os.nice(19)
    except OSError:
        pass


BUSY = 3  # the builder child's exit status when another process holds the package's build lock
LOCK_WAIT_S = 1.0  # a child waits this long for the lock: a probe (building_elsewhere) holds it for microseconds


def build_lock(out: Path):
    """The lock a build of package `out` holds (filelock: an OS lock on `out`.lock, released by the system when its
    process dies, so no lock is ever stale, and the file's content means nothing)."""
    from filelock import FileLock

    return FileLock(f"{out}.lock")


def _locked_elsewhere(out: Path) -> bool:
    """Whether another process (or another lock object of this one) holds the build lock of `out`. Raises OSError
    when the lock file cannot be made (a cache that cannot be written)."""
    from filelock import Timeout

    lock = build_lock(out)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    lock.release()
    return False


def building_elsewhere(out: Path) -> bool:
    """Whether another process is building package `out` now (False when the lock cannot even be made)."""
    try:
        return _locked_elsewhere(out)
    except OSError:
        return False


def child_command(module: str, args: list[str]) -> list[str]:
    """The command running `module`'s main() with `args` in a child Python, isolated: `-I` (no working directory,
    script directory, PYTHON* variables or user site on its path), its path the one this process imports from
    (clover's own directory first, then this process's entries, made absolute; the working directory's '' left out).
    The child imports clover from where this process did, an editable install or a normal one, never from the
    directory it is started in. Start it from a fixed directory (cwd=) too."""
    here = str(Path(__file__).resolve().parent.parent)
    paths = list(dict.fromkeys([here] + [os.path.abspath(p) for p in sys.path if p]))
    code = (f"import sys; sys.path[:0] = [p for p in {paths!r} if p not in sys.path]; "
            f"sys.argv[0] = {module!r}; from {module} import main; sys.exit(main())")
    return [sys.executable, "-I", "-c", code, *args]


class Builder:
    """A child process (child_command: `clover_cli.compiled` isolated, started from the cache directory) building a
    package while the caller goes on (eager). When another process is already building the same package (its build
    lock is held: found here, or by the child, which then exits BUSY), it waits for that one instead (`other`).
    Raises OSError when the cache cannot be written (its directory, the lock, the log): the caller runs eager."""

    def __init__(self, job: Job, watch: bool = False):
        out = Path(job.out)
        self.out = out
        self.log_path = Path(str(out) + ".log")
        self.proc = None
        self.other = watch  # another process's build, which this one waits for
        self._checked = (0.0, False)  # (when, done) of the last look at the other build's lock: poll() runs per step
        if watch:
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        if _locked_elsewhere(out):
            self.other = True
            return
        # appended to, never truncated here: the child that takes the lock empties it, one that finds the lock taken
        # writes nothing (two builders never interleave their lines)
        log_fd = atomic.open_append(self.log_path, 0o644)
        with os.fdopen(log_fd, "a") as log:
            # its own session: Ctrl-C in the chat does not reach it, and a build under way finishes (into the
            # cache) even when the chat ends first. At the lowest priority: the replies meanwhile run eager on the
            # same cores, and must not wait on it.
            self.proc = subprocess.Popen(child_command("clover_cli.compiled", [*job.argv(), "--log",
                                                                               str(self.log_path)]),
                                         cwd=out.parent, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_lowest_priority)

    def done(self) -> bool:
        if self.proc is not None:
            if self.proc.poll() is None:
                return False
            if self.proc.returncode != BUSY:
                return True
            self.proc, self.other = None, True  # another process took the lock first: wait for its build
        when, done = self._checked
        if not done and time.monotonic() - when >= 0.2:
            self._checked = (time.monotonic(), not building_elsewhere(self.out))
        return self._checked[1]

    def wait(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.done() and time.monotonic() < deadline:
            time.sleep(0.2)

    def error(self) -> str:
        """The child's last line (its one-line reason) when it failed."""
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        last = lines[-1].removeprefix("clover: ") if lines else ""
        return last[:300] or ("the other process's build made no package" if self.other
                              else "the build stopped without a package")


def build_locked(job: Job, log=print, wait: bool = False, on_lock=None, name: str | None = None) -> dict | None:
    """build() under the package's build lock. When another process holds it: None at once, or with `wait` (one
    line said, naming the model as `name`) once that build has ended, building then what it did not (usually
    nothing). `on_lock` is called when the lock is taken, before anything is built."""
    from filelock import Timeout

    out = Path(job.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = build_lock(out)
    try:
        lock.acquire(timeout=LOCK_WAIT_S)
    except Timeout:
        if not wait:
            return None
        log(f"another clover process is compiling {name or job.model.name} right now; waiting for it ...")
        lock.acquire()
    try:
        if on_lock is not None:
            on_lock()
        return build(job, log)
    finally:
        lock.release()


def failure_line(e: Exception) -> str:
    """One line for an export or compiler failure: its first line is the reason we can give."""
    return f"compiling failed: {one_line(e, 240, kind=True)}"


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m clover_cli.compiled",
                                description="Build the compiled step of a model and its heads' programs (what "
                                            "`clover compile` runs; chat runs it in the background).")
    p.add_argument("model", help="local model directory")
    p.add_argument("--capacity", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--heads")
    p.add_argument("--heads-out")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--allow-pickle", action="store_true")
    p.add_argument("--force", action="store_true")
    p.add_argument("--log", help="the file standard output goes to: emptied once the build lock is taken")
    a = p.parse_args(argv)
    from .signals import exit_on_signals

    exit_on_signals()
    job = Job(Path(a.model), Path(a.out), a.capacity, a.trust_remote_code, a.allow_pickle,
              Path(a.heads) if a.heads else None, Path(a.heads_out) if a.heads_out else None, a.topk, a.force)

    def empty_log():
        if a.log:
            try:
                os.truncate(a.log, 0)  # not atomic: the log this build streams to (opened to append)
            except OSError:
                pass

    try:
        built = build_locked(job, log=lambda text: print(text, flush=True), on_lock=empty_log)
    except CloverError as e:
        print(f"clover: {e}", flush=True)
        return 2
    except Exception as e:
        print(f"clover: {failure_line(e)}", flush=True)
        return 1
    return BUSY if built is None else 0


if __name__ == "__main__":
    sys.exit(main())
