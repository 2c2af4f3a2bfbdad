"""CPU linears with their weights prepacked once into oneDNN's blocked layout.

A verify forward on a CPU multiplies a few rows (the draft tree) by every weight matrix of the model; at that size a
linear is bound by reading its weight, which MKL's general matrix product (`F.linear`) does slowly. From oneDNN's
prepacked layout a verify forward of the bundled model runs 1.2x (1 token) to 1.5x (4-32 tokens) faster
(scripts/verify_cost.py, docs/BENCHMARKS.md). Its rows are computed independently of how many there are.

Not everywhere, though: a oneDNN call costs ~25-30 us before any arithmetic on an AVX2 machine, where `F.linear`
multiplies one row by a 256x256 weight in 10 us and by a 64x64 one in 4 (docs/BENCHMARKS.md, 2026-11-26). So
pack_linears times both, per weight shape, for 1, 2, 3-4, 5-8 and 9-16 rows (where a call's fixed cost can outweigh
the product), and a PackedLinear runs `F.linear` for the row counts where that was clearly faster on this machine;
17 rows and more always run packed. Only modules whose linears are warmed up (up to WARM_MAX_BYTES) are timed;
larger ones run packed at every row count. CLOVER_PACKED=1 packs every row count (no timing), CLOVER_PACKED=0 turns
packing off.

`pack_linears(module)` turns the module's plain `nn.Linear`s into `PackedLinear`s (same object, same parameters; the
weight stays shared, so tied embeddings stay tied, and a second, packed copy is kept beside it: the linears' memory
doubles, so a module whose linears exceed MAX_PACKED_BYTES (4 GiB) is left as it is). They take the packed
path only inside `packed_linears()` (Target.forward and the drafters enter it), only without autograd and only on
the CPU; everywhere else (transformers' own `generate`, training) they are the stock `F.linear`. A weight changed
in place after packing is packed again before its next use. CLOVER_PACKED=0 turns packing off.

`pack_linears(module, lazy=True)` makes the PackedLinears but leaves the packing, warming and timing (0.5-2 s for
the bundled model, docs/BENCHMARKS.md) to the first packed forward of any of them, or to `finish_packing`: a session
whose compiled step is active from the start runs no eager forward at all and never pays it.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from .options import env

PACKED_DTYPES = (torch.float32,)
MAX_PACKED_BYTES = 4 << 30  # the packed copies double the linears' memory: larger models on a CPU are left as they are
WARM_ROWS = 64
PIECE_ROWS = (2048, 1024, 512, 256, 128, WARM_ROWS)  # the row counts a linear over more rows is run in pieces of
WARM_MAX_BYTES = 256 << 20  # above this the kernels' one-time compile is small next to the products themselves
_state = threading.local()  # .depth: how many packed_linears() blocks this thread is in
_warmed: set = set()  # (weight shape, dtype, bias) whose kernels were compiled for 1..WARM_ROWS rows
_supported: bool | None = None
TIMED_ROWS = (1, 2, 4, 8, 16)  # the row counts timed both ways: buckets 1, 2, 3-4, 5-8, 9-16 (1 + their index's bits)
STOCK_MARGIN = 0.9  # F.linear is taken for a bucket only when it ran in under 90% of the packed time
_stock_buckets: dict = {}  # (weight shape, dtype, bias) -> one bool per TIMED_ROWS bucket: F.linear faster there


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def supported() -> bool:
    """Whether this torch build runs oneDNN's prepacked linear and agrees with F.linear on a probe."""
    global _supported
    if _supported is None:
        _supported = False
        if env("CLOVER_PACKED", "1") != "0" and torch.backends.mkldnn.is_available():
            try:
                g = torch.Generator().manual_seed(0)  # not the global generator: seeded runs stay as they were
                w, x = torch.randn(48, 32, generator=g), torch.randn(3, 32, generator=g)
                _supported = torch.allclose(_linear(x, _pack(w), None), F.linear(x, w), atol=1e-4)
            except (RuntimeError, AttributeError):
                pass
    return _supported


class PackedLinear(nn.Linear):
    """An nn.Linear that also holds its weight prepacked for oneDNN (made by pack_linears, never constructed)."""

    def _key(self):
        w = self.weight
        try:
            version = w._version
        except RuntimeError:  # a weight made under inference_mode has no version counter
            version = -1
        return w.data_ptr(), w.dtype, version

    def repack(self):
        self.packed = _pack(self.weight)
        # Holding the packed-from tensor keeps its memory from being reused by a replacement weight (`.data = ...`),
        # which could otherwise sit at the same address with the same version and pass for the packed one.
        self.packed_from = self.weight.detach()
        self.packed_key = self._key()

    def unpack(self):
        self.__dict__.pop("packed", None)
        self.__dict__.pop("packed_from", None)
        self.packed_key = None

    def _apply(self, fn, recurse=True):  # .to(), .float(), .cuda(), ...: packed again on first use, if at all
        self.unpack()
        return super()._apply(fn, recurse)

    def __getstate__(self):  # copies and pickles leave the packed weight behind (packed again on first use), and
        state = self.__dict__.copy()  # the other linears of a lazy pack_linears call
        state.pop("packed", None)
        state.pop("packed_from", None)
        state["packed_key"] = None
        state["pending"] = None
        return state

    stock_buckets: tuple = ()  # per TIMED_ROWS bucket: run F.linear there (set by pack_linears)
    pending = None  # the linears packed lazily with this one (pack_linears(lazy=True)) until they are finished

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (getattr(_state, "depth", 0) <= 0 or torch.is_grad_enabled() or x.device.type != "cpu"
                or x.dtype not in PACKED_DTYPES or x.dtype != self.weight.dtype):
            return F.linear(x, self.weight, self.bias)
        if self.pending is not None:
            _finish(self.pending)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        bucket = (rows - 1).bit_length()  # 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, 9-16 -> 4
        if rows and bucket < len(self.stock_buckets) and self.stock_buckets[bucket]:
            return F.linear(x, self.weight, self.bias)
        if self._key() != self.packed_key:  # replaced, cast or changed in place since it was packed
            self.repack()
        if rows <= WARM_ROWS:
            return _linear(x, self.packed, self.bias)
        return _linear_in_chunks(x, self.packed, self.bias, rows)


def _linear_in_chunks(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """A linear over many rows (a prompt) in pieces of PIECE_ROWS (the largest that fit, in turn) and the rest, under
    WARM_ROWS: oneDNN keeps a kernel for every row count it meets (in a cache of 1,024 kernels, emptied only as it
    fills), so a prompt of each new length left kernels behind, about 0.2 MiB each, and a long chat's memory grew
    by hundreds of MiB. In pieces only PIECE_ROWS are added to the row counts kept, and a prompt of up to 4,095
    rows takes at most seven pieces. The result is the same, bit for bit: rows are computed independently."""
    flat = x.reshape(rows, x.shape[-1])
    pieces, start = [], 0
    for size in PIECE_ROWS:
        while rows - start >= size:
            pieces.append(_linear(flat[start:start + size], packed, bias))
            start += size
    if start < rows:
        pieces.append(_linear(flat[start:], packed, bias))
    out = torch.cat(pieces)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def pack_linears(module: nn.Module, max_bytes: int = MAX_PACKED_BYTES, lazy: bool = False) -> int:
    """Make the CPU float32 nn.Linears of `module` PackedLinears; returns how many (0 when not supported here).

    oneDNN compiles a kernel the first time it meets a (weight shape, row count); for a small model that costs more
    (~0.4 ms) than the product itself, so each new weight shape is run here for 1..WARM_ROWS rows (the tree sizes a
    verify uses) rather than during the first replies, where it would also skew the engine's measured verify costs.
    lazy: all of that waits for the first packed forward of one of them, or finish_packing(module).
    """
    linears = [m for m in module.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"
               and m.weight.dtype in PACKED_DTYPES]
    size = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    if not linears or size > max_bytes or not supported():
        return 0
    for m in linears:
        m.__class__ = PackedLinear
        m.packed_key = None
        m.pending = linears if lazy else None
    if not lazy:
        _finish(linears)
    return len(linears)


def finish_packing(module: nn.Module) -> None:
    """Pack (warm, time) now what pack_linears(lazy=True) left for later in `module`."""
    for m in module.modules():
        if isinstance(m, PackedLinear) and m.pending is not None:
            _finish(m.pending)


def _finish(linears: list) -> None:
    """Pack, warm and time the PackedLinears of one pack_linears call (those still on the CPU in a packed type; an
    interrupted call leaves them pending, to be finished at their next use)."""
    for m in linears:
        m.pending = None
    try:
        _pack_warm_time([m for m in linears if m.weight.device.type == "cpu" and m.weight.dtype in PACKED_DTYPES])
    except BaseException:
        for m in linears:
            m.pending = linears
        raise


def _pack_warm_time(linears: list) -> None:
    if not linears:
        return
    size = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    shapes = {}
    for m in linears:
        m.repack()
        shapes.setdefault(_shape_key(m), m)
    if size <= WARM_MAX_BYTES:
        timed = env("CLOVER_PACKED", "auto") != "1"
        with torch.inference_mode():
            for key, m in shapes.items():
                if key not in _warmed:
                    for rows in range(1, WARM_ROWS + 1):
                        _linear(m.weight.new_zeros(rows, m.in_features), m.packed, m.bias)
                    _warmed.add(key)
                if timed and key not in _stock_buckets:
                    _stock_buckets[key] = tuple(stock_faster(m, rows) for rows in TIMED_ROWS)
        for m in linears:
            m.stock_buckets = _stock_buckets.get(_shape_key(m), ()) if timed else ()


def _shape_key(m: nn.Linear) -> tuple:
    """What a linear's kernels and timings depend on: (weight shape, dtype, whether it has a bias)."""
    return tuple(m.weight.shape), m.weight.dtype, m.bias is not None


def _seconds(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def stock_faster(m: PackedLinear, rows: int, rounds: int = 3) -> bool:
    """Whether F.linear multiplies `rows` rows by m's weight clearly faster than oneDNN's prepacked product here: the
    two timed alternately, the fastest of `rounds` rounds each (of 5 calls, or 1 for products over 0.5 ms)."""
    x = torch.full((rows, m.in_features), 0.5, dtype=m.weight.dtype)  # not the global generator: seeds stay as set
    stock = lambda: F.linear(x, m.weight, m.bias)  # noqa: E731
    packed = lambda: _linear(x, m.packed, m.bias)  # noqa: E731
    calls = 1 if max(_seconds(stock, 1), _seconds(packed, 1)) > 5e-4 else 5
    t_stock = t_packed = float("inf")
    for _ in range(rounds):
        t_stock, t_packed = min(t_stock, _seconds(stock, calls)), min(t_packed, _seconds(packed, calls))
    return t_stock < STOCK_MARGIN * t_packed


@contextmanager
def stock_linears():
    """Inside this block PackedLinears run F.linear, packed_linears() blocks within it included (per thread): for a
    forward that must not set off a lazy packing (a model's one-time check at load)."""
    saved = getattr(_state, "depth", 0)
    _state.depth = -(1 << 30)
    try:
        yield
    finally:
        _state.depth = saved


@contextmanager
def packed_linears():
    """PackedLinears take the packed path inside this block (re-entrant; per thread)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
