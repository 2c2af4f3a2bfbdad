"""The compiled step on a CPU, as it runs: the target's own forward (and the draft heads' per-step modules),
exported with symbolic sizes and compiled ahead of time by AOTInductor (aot_export.py), loaded from its package in
the cache and called in place of the eager forward.

The target's step is a few programs: one each for exactly 1, 2, 4, 8 and 16 new tokens (STATIC; a smaller step runs
padded to the next of them) and one for any larger number (draft trees, prefills), each taking any number of
committed tokens export found it can, a tree mask, and the rows whose logits are wanted. They are the stock
transformers forward with our attention function and cache (`Target.run`), traced by torch.export and compiled by
AOTInductor with the weights frozen into them (on a CPU: prepacked for oneDNN, the q/k/v and gate/up projections
each concatenated into one product; the fixed sizes with inductor's own autotuned kernels); a quantized model's
programs are built without the weights and read the model's own (CompiledStep.share_weights). A model whose float32
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

A package is a directory of program files and a meta.json (their sizes, checksums and size ranges, the step's
measured costs); everything in it is checked before it is used (inspect_package, inspect_heads) and a damaged one
is discarded and built again (discard).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import shutil
import sys
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import atomic
from ..inuse import hold
from ..store import read_cache_json
from ..store import PROGRAM_VERSION
from . import AOT_SPARE, BEYOND, MAX_CAPACITY, SIZES, fits, fits_at, padded_size

# A causal forward of more than SIZES[-1] tokens (a prefill) runs in pieces of these many rows (the largest that fit,
# in turn), then the rest as a step: every new row count left kernels and buffers behind for good (a prefill of
# each new length to 2,000 tokens grew a process by ~280 MiB), and in pieces there are a few row counts only.
PIECES = (1024, 512, 256, 128, 64)
META = "meta.json"

# The programs every heads package holds; a Clover-2 package also holds the fixed-size augment programs its metadata
# names (augment_sizes). Bump HEADS_PROGRAM_VERSION when they change: old heads packages are rebuilt, not reused.
HEADS_PROGRAM_VERSION = 4
HEADS_PACKAGES = {"clover": ("augment.pt2", "level0.pt2", "level.pt2", "level-small.pt2"),
                  "medusa": ("levels.pt2",)}
MAX_LEVEL_ROWS = 64  # nodes a Clover level can expand at once in the compiled program
# As for the target's step: up to this many rows (a catch-up after a short accepted path, a level of a few nodes:
# nearly every heads call) a program of its own with inductor's autotuned matrix-vector kernels, which read the
# weights 2-3x faster there than the oneDNN products of the programs for any size.
SMALL_ROWS = 4


# ---------------------------------------------------------------------------------------------------------------
# Packages on disk

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
    outside, shapes = meta.get("weights_outside", []), meta.get("weight_shapes", {})
    why = _outside_problem(outside, shapes, ranges)
    if why:
        return None, why
    why = _files_problem(d, meta, ranges, full)
    if why:
        return None, why
    return Package(Path(d), capacity, {int(k): float(v) for k, v in verify_s.items()}, ranges, tuple(outside),
                   shapes), None


def _outside_problem(outside, shapes, names, per_program: bool = False) -> str | None:
    """What is wrong with a package's list of programs built without their weights and its table of those weights'
    types and shapes (describe_weights; per_program: one table for each of those programs), or None."""
    if not isinstance(outside, list) or not all(isinstance(name, str) and name in names for name in outside):
        return "its list of programs built without their weights names no programs of it"
    tables = list(shapes.values()) if per_program and isinstance(shapes, dict) else [shapes]
    if per_program and (not isinstance(shapes, dict) or set(shapes) != set(outside)):
        return "its table of the weights' types and shapes is not one"
    if not all(isinstance(table, dict) and all(
            isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], list)
            and all(map(_count, v[1])) for v in table.values()) for table in tables):
        return "its table of the weights' types and shapes is not one"
    return None


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




@dataclass
class Package:
    path: Path
    capacity: int
    verify_s: dict[int, float]
    ranges: dict
    outside: tuple[str, ...] = ()  # programs built without their weights: they read the model's (share_weights)
    shapes: dict | None = None  # their weights' {name: [type, shape]}

    @staticmethod
    def find(d: Path) -> "Package | None":
        """The package built into directory `d`, if there is a complete and sound one (metadata and file sizes
        checked; see inspect_package)."""
        return inspect_package(d)[0]

    def load(self, model=None) -> CompiledStep:
        """The package's programs loaded, after checking every file against its checksum (a file damaged in place,
        its size unchanged); programs built without their weights read those of `model` (share_weights). Raises
        ValueError when a file does not match or `model` lacks weights a program needs, or whatever loading raises."""
        why = _files_problem(self.path, _read_meta(self.path)[0] or {}, self.ranges, full=True)
        if why:
            raise ValueError(why)
        if self.outside and model is None:
            raise ValueError("its programs were built without their weights, and no model was given to read them from")
        hold(self.path)  # in use from now while this process runs: neither `clover rm` nor the pruning removes it
        step = CompiledStep(self.path, self.capacity, self.ranges, self.outside, self.shapes)
        if self.outside:
            step.share_weights(model)
        return step




# ---------------------------------------------------------------------------------------------------------------
# Running a package

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

    def constant_names(self) -> list[str] | None:
        """The names of the weights (and other constants) the program reads, or None when this torch cannot say."""
        try:
            return self.loader.get_constant_fqns()
        except (AttributeError, RuntimeError):
            return None

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


def _marker(past: int, memo: dict) -> torch.Tensor:
    """The `past` input: a [past, 0] tensor (no data; its length is what counts), made once per length."""
    marker = memo.get(past)
    if marker is None:
        marker = torch.empty(past, 0)
        if len(memo) < 4096:
            memo[past] = marker
    return marker


HUGE_PAGE = 2 << 20


def step_weights(model) -> dict[str, torch.Tensor]:
    """The tensors of `model` on the CPU under the names a step program calls its constants (it was exported as
    OnBuffers(TargetStep(target)), with the quantized records of q/k/v and gate/up fused: fused_linears)."""
    from ..quantized import fused_linears

    with fused_linears(model):
        return module_tensors(model, "block.model.")


def module_tensors(module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The parameters and buffers of `module` on the CPU, named as a program exported from it names its constants."""
    named = {f"{prefix}{name}": t for name, t in module.named_parameters(remove_duplicate=False)}
    named.update({f"{prefix}{name}": t for name, t in module.named_buffers(remove_duplicate=False)})
    return {name: t for name, t in named.items() if t.device.type == "cpu"}


def describe_weights(named: dict[str, torch.Tensor], names) -> dict[str, list]:
    """{name: [type, shape]} of the tensors `names` of `named`: what a package built without its weights records of
    them (give_weights checks a model's against it)."""
    return {n: [str(named[n].dtype).removeprefix("torch."), list(named[n].shape)] for n in sorted(names)}


def give_weights(programs: dict, named: dict[str, torch.Tensor], shapes: dict, huge_pages: bool = False):
    """Let each of `programs` (name -> Program, built without its weights) read its constants from `named` (the
    tensors of the module it was exported from, under its names); with `huge_pages`, the uint8 records (streamed at
    every step) from one copy in memory asked for 2 MB pages, the rest (norms, an embedding of which a step reads a
    row) where they are. Returns ({program: the tensors it reads, to keep alive}, the copies' memory). ValueError
    when one cannot: a constant `named` lacks, or has in another type or shape than `shapes` (from the build) says."""
    plans = {}
    for name, program in programs.items():
        names = program.constant_names()
        if not names:
            raise ValueError(f"{name} was built without its weights, and this torch cannot say which they are")
        for n in names:
            if n not in named:
                raise ValueError(f"{name} was built without its weights, and these have no {n[:80]}")
            if describe_weights(named, [n])[n] != shapes.get(n):
                raise ValueError(f"{name} was built without its weights, and their {n[:80]} is not of the type and "
                                 f"shape it was built for")
        plans[name] = names
    streamed = {n for names in plans.values() for n in names if huge_pages and named[n].dtype == torch.uint8}
    copies, region = huge_page_copies({n: named[n] for n in sorted(streamed)})
    shared = {}
    for name, names in plans.items():
        constants = {n: copies[n] if n in copies else named[n].detach().contiguous() for n in names}
        try:
            programs[name].loader.load_constants(constants, False, True, True)  # the active buffer, all of it, ours
        except (AttributeError, RuntimeError, TypeError) as e:
            raise ValueError(f"{name} was built without its weights, and does not take them: {e}"[:300])
        shared[name] = constants  # kept alive while the program reads them
    return shared, region


def huge_page_copies(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], object]:
    """Copies of `tensors` (CPU), packed one after another (64-byte aligned) in one private anonymous mapping that
    Linux is asked to back with 2 MB pages (madvise; transparent huge pages in "madvise" or "always" mode, else
    ordinary pages): a step streaming ~100 MB of weights then needs ~50 translations instead of ~25,000. Returns
    the copies and the mapping (keep it alive as long as they are used)."""
    import mmap

    if not tensors:
        return {}, None
    offsets, total = {}, 0
    for name, t in tensors.items():
        offsets[name] = total
        total += -(-t.numel() * t.element_size() // 64) * 64
    size = -(-(total + HUGE_PAGE) // HUGE_PAGE) * HUGE_PAGE  # room to start at a 2 MB boundary
    try:
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (AttributeError, TypeError, OSError, ValueError):  # no such mapping here (Windows): shared as they are
        return {name: t.detach().contiguous() for name, t in tensors.items()}, None
    memory = torch.frombuffer(region, dtype=torch.uint8)
    start = -memory.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, (size - start) // HUGE_PAGE * HUGE_PAGE)
    except (AttributeError, OSError, ValueError):
        pass  # no such advice here: ordinary pages, the same values
    copies = {}
    for name, t in tensors.items():
        at = start + offsets[name]
        view = memory[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        copies[name] = view
    return copies, region


class CompiledStep:
    """A loaded package: call it like Target.forward, with the cache whose buffers it writes."""

    def __init__(self, path: Path, capacity: int, ranges: dict[str, dict[str, list[int]]], outside=(),
                 shapes: dict | None = None):
        self.path = Path(path)
        self.capacity = capacity
        # the programs built without their weights (Package.outside), and the type and shape of each of those: they
        # run only once share_weights gave them
        self.outside, self.shapes = frozenset(outside), shapes or {}
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
        self._shared: dict[str, dict] = {}  # program name -> the model's tensors it reads (share_weights)
        self._region = None  # the memory holding share_weights' copies

    def share_weights(self, model) -> int:
        """Give the programs built without their weights (`outside`) the model's own tensors, its records streamed at
        every step copied once into memory asked for 2 MB pages; returns how many programs read them. ValueError when
        the model lacks one of them or has it in another type or shape than the build's (`shapes`).

        Each program built with its weights holds a copy of them (frozen into it): ~200 MB each for SmolLM2's Q4_1
        file, six of them, each ~400 MB of memory once loaded; and speculative decoding alternates between the
        programs (a plain step, then a 2-node tree, ...), each streaming its own copy: a one-token step right after a
        2-token one cost 3.15 ms, 2.68 ms when both read one copy in 2 MB pages (docs/BENCHMARKS.md, 2026-12-07). So
        a quantized model's programs are built without them (aot_export.build_for). A program built with its
        weights keeps them: those under a weight's name may be another type (a narrow program's float16 copy)."""
        shared, self._region = give_weights({p.name: p for *_, p in self.programs if p.name in self.outside},
                                            step_weights(model), self.shapes, huge_pages=True)
        self._shared.update(shared)
        return len(shared)

    def fits(self, cache, n: int) -> bool:
        if not fits(cache, self.capacity, n, AOT_SPARE):
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
                for size in ((lo,) if lo == hi else (padded_size(n, SIZES, BEYOND), n)):
                    if n <= size and lo <= size <= hi and fits_at(past, size, self.capacity, AOT_SPARE):
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

    def __init__(self, path: Path, kind: str, capacity: int, augment_ranges: dict | None = None, outside=(),
                 drafter=None, shapes: dict | None = None):
        """`outside`: the programs built without their weights (`shapes`: {name: [type, shape]} of those), which
        read those of `drafter` (share_weights; ValueError when it is not given or lacks them)."""
        self.path, self.kind, self.capacity = Path(path), kind, capacity
        # program name -> {"n": [least, most], "past": [least, most]}: the sizes each augment program takes
        self.augment_ranges = augment_ranges
        hold(self.path)  # in use from now on (see CompiledStep's load)
        self.programs = programs = {name: Program(self.path / name)
                                    for name in heads_program_names(kind, augment_ranges)}
        self.outside, self.shapes = frozenset(outside), shapes or {}
        self._shared: dict[str, dict] = {}  # program name -> the drafter's tensors it reads
        if self.outside and drafter is None:
            raise ValueError("the heads' programs were built without their weights, and no heads were given to read "
                             "them from")
        if self.outside:
            self.share_weights(drafter)
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

    def share_weights(self, drafter) -> int:
        """Give the programs built without their weights (`outside`) the tensors of `drafter`'s module each was
        exported from (heads_weights); returns how many read them. ValueError when one cannot (give_weights)."""
        for name in sorted(self.outside):  # each program's names are those of its own module
            self._shared.update(give_weights({name: self.programs[name]}, heads_weights(drafter, name),
                                             self.shapes.get(name, {}))[0])
        return len(self.outside)

    def _augment_for(self, cache, n: int):
        """(the augment program that takes n new positions after the cache's, the rows it runs them as), or None."""
        if self.augment_ranges is None:
            return None
        for name, program in self._augments:
            r = self.augment_ranges.get(name)
            if r is None:
                continue
            lo, hi = r["n"]
            # a fixed-size program: its rows; else the next of SIZES
            rows = lo if lo == hi else padded_size(n, SIZES, BEYOND)
            if n <= rows and lo <= rows <= hi and r["past"][0] <= cache.length <= r["past"][1] \
                    and fits(cache, self.capacity, rows, AOT_SPARE):
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


def heads_weights(drafter, program: str) -> dict[str, torch.Tensor]:
    """The tensors (on the CPU) of the module of `drafter` that the heads' program named `program` was exported from
    (aot_export.build_heads_for), under the names the program calls its constants."""
    if AUGMENT_NAME.fullmatch(program):
        module, prefix = drafter.augment_block, "block."  # exported as OnBuffers(augment_block)
    elif program == "level0.pt2":
        module, prefix = drafter.levels[0], ""
    elif program in ("level.pt2", "level-small.pt2"):
        module, prefix = drafter.levels[1], ""
    else:
        module, prefix = drafter.levels, ""
    return module_tensors(module, prefix)


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
    names = heads_program_names(kind, augment_ranges)
    why = _outside_problem(meta.setdefault("weights_outside", []), meta.setdefault("weight_shapes", {}), names,
                           per_program=True)
    if why:
        return None, why.replace("its ", "their ").replace("of it", "of theirs")
    why = _files_problem(d, meta, names, full)
    if why:
        return None, why
    return meta, None


def find_heads(d: Path | None) -> dict | None:
    """The metadata of complete, sound heads' programs built into `d`, or None."""
    return inspect_heads(d)[0]


def heads_damage(d: Path | None) -> str | None:
    """What is wrong with the heads' programs in `d` (every file's checksum checked), or None."""
    return inspect_heads(d, full=True)[1]
