"""The step programs, behind one contract: what runs the target's step (and the draft heads' per-step modules) in
place of the eager forward, and the rules both backends share.

    aot.py, aot_export.py, aot_build.py   on a CPU: the step exported and compiled ahead of time by AOTInductor
                                          (aot_export), built in a child process (aot_build), loaded and run (aot)
    graphs.py                             on a CUDA device: the step with static shapes, captured as CUDA graphs
    manager.py                            the step's life in a session (StepCompiler): which backend, builds, swaps
    costs.py                              what a step of n tokens costs, kept on disk (StepCosts)

A step program (aot.CompiledStep, graphs.StaticStep), attached with Target.attach_program:
    fits(cache, n) -> bool        whether it can run n new tokens after the cache's committed ones (else: eager)
    (cache, tokens, positions, tree_mask, logits_for) -> (pre-norm hidden [n, H], logits)   as Target.forward's
                                  eager path returns them, the new keys and values written into the cache's buffers
A heads program (aot.HeadsPrograms, graphs.CloverGraphs / MedusaGraphs), attached with drafter.attach_programs:
    kind                          "clover" or "medusa" (heads_kind)
    levels                        Clover-2: (first level, later levels), each (states, tokens) -> outputs;
                                  Medusa: hidden -> outputs, as the eager modules
    fits(cache, n), augment(hidden, tokens, positions, cache)   Clover-2's catch-up over the heads' own cache

Both run a step of n tokens as a padded size from a table of sizes (padded_size), and only where the rows fit in the
KV buffers (fits). Each backend keeps its own table: a compiled program per size costs a build and a frozen copy of
the weights (SIZES, STATIC here), a CUDA graph per size costs a capture (graphs.SIZES).
"""

from __future__ import annotations

import os
import shutil

import torch

from ..errors import CloverError
from ..options import compile_sizes, env

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
# Larger steps run one program for any number of rows, as the smallest of SIZES >= n (beyond them: the next
# multiple of 64). oneDNN builds its kernels for every new row count the first time it meets it (about 4 ms a size
# here): a few sizes keep that one-time cost small, and cost almost nothing per step, since a product over a few
# rows more reads the same weights. (The AOTInductor programs' table; the CUDA graphs have their own, graphs.SIZES.)
SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80)
BEYOND = 64  # past SIZES, a compiled step runs as the next multiple of this
# The KV slots a compiled program leaves free after its new tokens (see fits_at).
AOT_SPARE = 1


def static_sizes(nbytes: int = 0) -> tuple[int, ...]:
    """The sizes CLOVER_COMPILE_SIZES lists ("1,4": fewer programs, a shorter build; "": none); without it STATIC,
    or FEW_STATIC for a model of `nbytes` of weights whose copies would pass COPIES_BYTES."""
    sizes = compile_sizes()
    if sizes is None:
        return FEW_STATIC if nbytes * (len(STATIC) + 1) > COPIES_BYTES else STATIC
    if any(not 1 <= size <= SIZES[-1] for size in sizes):
        raise CloverError(f"CLOVER_COMPILE_SIZES must list step sizes from 1 to {SIZES[-1]}, like 1,2,4: "
                          f"{env('CLOVER_COMPILE_SIZES')!r}")
    return sizes


def padded_size(n: int, sizes: tuple[int, ...], beyond: int | None = None) -> int | None:
    """The size a step of n rows runs as in the table `sizes` (ascending): the smallest >= n. Past the table: the
    next multiple of `beyond`, or None (no such size) without it.

    The backends differ past their tables, kept as they were: the AOTInductor program for larger steps takes any
    number of rows (padded to a multiple of BEYOND: a few row counts, as oneDNN builds kernels per new count), while
    a CUDA graph is captured per size, so a step past graphs.SIZES has none and runs eager."""
    for size in sizes:
        if size >= n:
            return size
    return None if beyond is None else -(-n // beyond) * beyond


def fits_at(length: int, rows: int, capacity: int, spare: int = 0) -> bool:
    """Whether `rows` new tokens after `length` committed ones fit in KV buffers of `capacity` tokens, with `spare`
    slots left free after them.

    The backends leave different room, kept as they were: an AOTInductor program runs only where past + n <
    capacity (spare=AOT_SPARE): build_for traces and checks it on examples that leave the last slot free, and the
    committed lengths export finds it takes (its ranges, at most that; some models need more room) were worked out
    from them. A CUDA graph writes at device positions and attends over a span clamped to the capacity, so it may
    fill the buffers to the last slot (spare=0)."""
    return length + rows + spare <= capacity


def fits(cache, capacity: int, rows: int, spare: int = 0) -> bool:
    """Whether a program over KV buffers of `capacity` tokens can write `rows` new tokens into `cache`: its buffers
    are made, of that capacity, and the rows fit after its committed tokens (fits_at)."""
    return cache.capacity == capacity and fits_at(cache.length, rows, capacity, spare) and cache.buffers() is not None


def capacity_for(max_context: int) -> int:
    return min(max_context, MAX_CAPACITY)


def unsupported(model, device: torch.device, dtype: torch.dtype, load_in_8bit: bool) -> str | None:
    """Why the compiled step cannot serve this model here (one short phrase), or None when it can."""
    if spread(model):
        return "a model placed by --device-map (over several devices, or offloaded) is not compiled"
    if load_in_8bit:
        return "8-bit weights are not compiled"
    if getattr(model, "hf_quantizer", None) is not None:
        return "4-bit weights are not compiled"
    if device.type == "cuda":
        return None  # CUDA graphs of the static step (graphs.py), captured in the session
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


def weight_bytes(model) -> int:
    """The bytes a frozen copy of the model's weights takes (quantized linears' packed records included)."""
    from ..quantized import QuantLinear

    return sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(m.packed.numel() for m in model.modules() if isinstance(m, QuantLinear))


def spread(model) -> bool:
    """Whether accelerate placed the model over several devices or offloaded some of its weights (to the CPU or
    disk, loaded at each forward): a device map other than everything on one device."""
    placed = {str(where) for where in (getattr(model, "hf_device_map", None) or {}).values()}
    return len(placed) > 1 or bool(placed & {"disk", "meta"}) or any(
        p.device.type == "meta" for p in model.parameters())


def heads_kind(drafter) -> str | None:
    """Which heads programs a drafter has: "clover" (Clover-2), "medusa", or None (its modules run eager)."""
    return drafter.programs_kind
