"""Quantized linears on the CPU: weights kept in groups of integers with a scale (and an offset) per group, as a
GGUF's blocks hold them, multiplied in C++ (quant_cpu.cpp: AVX-512 where the CPU has it, VNNI for int8 products,
portable C++ elsewhere; built on first use with the machine's compiler), beside a torch reference.

    w[n, k] = d[n, g] * q[n, k] + m[n, g]        g = k // group, group 16 or 32; q 4-bit (0..15) or 8-bit (-128..127)

Two ways to multiply, chosen by the kind's ACT8 flag:
  - float32 activations as they are: per group, s = sum over k (in order) of q * x, then y += d * s + m * (sum of x
    over the group), fused multiply-adds in float32: the dequantized weights' product up to the order of float32
    sums;
  - ACT8: each row's activations rounded per group to int8 (xs = max|x| / 127, act8()), s = sum of q * xq exactly
    in integers (VNNI: 64 byte products per instruction), y += (d * xs) * s + m * (xs * sum of xq): the dequantized
    weights' product with the rounded activations, as llama.cpp runs a GGUF's blocks; 2-3x cheaper from 8 rows up.
    Its records hold each 64-byte line of integers in VNNI order (act8_records: one output's bytes per 32-bit lane).
    float_activations() turns the rounding off for a while (checks against float references).
Either way a row's result does not depend on the other rows: a draft tree's verify gives each row what a one-row
step gives.

    pack(q, d, m)                  -> Packed (the kernel's records; float16 scales where they hold d and m exactly)
    act8_records(packed)           -> the same weights with int8 activations (ACT8: lines in VNNI order)
    pack_bf16(w)                   -> Packed (bfloat16 weights, no scales: multiplied widened to float32, exactly)
    Packed.unpack() / dequantize() -> q, d, m / the float32 weight the kernel multiplies by
    qlinear(x, packed)             the kernel (torch.ops.clover_quant.linear); load(build_dir) builds and loads it
                                   (and attention.py's exact_rows, built into the same library)
    qlinear_ref(x, packed)         the same sums in torch (rounded as the kernel's fused multiply-adds round)
"""

from __future__ import annotations

import functools
import hashlib
import platform
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# the kernel, and built into the same library attention whose rows do not depend on the batch (kernels/attention.py)
SOURCES = [Path(__file__).with_name("quant_cpu.cpp"), Path(__file__).with_name("attention_cpu.cpp")]
LANES = 16  # outputs per tile (one 512-bit register of float32)


BF16 = 16  # the kind of bfloat16 weights (quant_cpu.cpp's BF16): no groups, no scales (pack_bf16's layout)
ACT8 = 32  # a flag on a kind of integers: the activations rounded to int8 per group (quant_cpu.cpp's ACT8)


def kind_code(bits: int, group: int, affine: bool, f32: bool) -> int:
    """The integer naming a packed layout (quant_cpu.cpp's Kind)."""
    assert bits in (4, 8) and group in (16, 32)
    return (bits == 8) | (group == 16) << 1 | bool(affine) << 2 | bool(f32) << 3


def kind_of(code: int) -> tuple[int, int, bool, bool]:
    """(bits, group, affine, float32 scales) of a kind (ACT8 aside: it changes the activations, not the records)."""
    code &= ~ACT8  # never set on BF16
    if code == BF16:
        return 16, 32, False, False
    return (8 if code & 1 else 4), (16 if code & 2 else 32), bool(code & 4), bool(code & 8)


def _record_bytes(code: int) -> tuple[int, int]:
    """(the bytes of its integers, of the whole record) of a record of integers of this kind (quant_cpu.cpp's Kind)."""
    bits, group, affine, f32 = kind_of(code)
    qbytes = LANES * group * bits // 8
    return qbytes, qbytes + (2 if affine else 1) * LANES * (4 if f32 else 2)


@dataclass
class Packed:
    """A linear's weight in the kernel's records: `data` (uint8), out_features x in_features (padded to 32)."""

    data: torch.Tensor
    out_features: int
    in_features: int
    kind: int

    @property
    def group(self) -> int:
        return kind_of(self.kind)[1]

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q [N, K] int, d [N, K / group] float32, m or None), N and K as packed (K padded to 32)."""
        bits, group, affine, f32 = kind_of(self.kind)
        n, k = self.out_features, self.in_features
        tiles, groups = -(-n // LANES), k // group
        qbytes, record = _record_bytes(self.kind)
        sbytes = LANES * (4 if f32 else 2)
        raw = self.data.view(tiles, groups, record)
        lines = raw[:, :, :qbytes].reshape(tiles, groups, -1, 4, LANES)  # line, i, lane l: byte 16 i + l
        if self.kind & ACT8:  # VNNI order: byte 4 l + i
            lines = raw[:, :, :qbytes].reshape(tiles, groups, -1, LANES, 4).transpose(3, 4)
        qs = lines.reshape(tiles, groups, -1, LANES)  # per k (8-bit) or pair of k (4-bit), the lanes
        if bits == 4:
            qs = qs.to(torch.int32)
            q = torch.stack([qs & 15, qs >> 4], dim=3)  # tiles, groups, pair, lo/hi, lane
        else:
            q = qs.view(torch.int8).to(torch.int32)
        q = q.reshape(tiles, groups, group, LANES).permute(0, 3, 1, 2).reshape(tiles * LANES, k)
        scale = torch.float32 if f32 else torch.float16

        def side(offset):
            s = raw[:, :, offset:offset + sbytes].contiguous().view(scale).view(tiles, groups, LANES)
            return s.permute(0, 2, 1).reshape(tiles * LANES, groups).float()[:n]

        d = side(qbytes)
        m = side(qbytes + sbytes) if affine else None
        return q[:n], d, m

    def bf16_weight(self) -> torch.Tensor:
        """The bfloat16 weight [N, K] (K as packed) of BF16 records (pack_bf16's layout)."""
        tiles = -(-self.out_features // LANES)
        w = self.data.view(torch.bfloat16).view(tiles, self.in_features // 2, 4, 2, 4)  # tile, pair, quarter, k, i
        return w.permute(0, 2, 4, 1, 3).reshape(tiles * LANES, self.in_features)[:self.out_features]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the records hold: d * q + m, group by group (for a GGUF's blocks exactly what the
        gguf package dequantizes them to); bfloat16 records widened."""
        if self.kind == BF16:
            return self.bf16_weight().float()
        q, d, m = self.unpack()
        group = self.group
        w = d.repeat_interleave(group, dim=1) * q.float()
        if m is not None:
            w = w + m.repeat_interleave(group, dim=1)
        return w


def _exact_in_half(t: np.ndarray) -> bool:
    return bool(np.array_equal(t.astype(np.float16).astype(np.float32), t) and np.all(np.isfinite(t)))


def pack(q, d, m=None, bits: int = 4) -> Packed:
    """Records for the kernel from integers q [N, K] (4-bit: 0..15; 8-bit: -128..127), scales d [N, groups]
    and offsets m (same shape, or None), groups of 32 or 16 weights covering K. K is padded to a multiple of 32 with
    zero weights. Scales are kept in float16 where that holds every d and m exactly, else in float32."""
    q = np.asarray(q)
    d = np.asarray(d, dtype=np.float32)
    n, k = q.shape
    group = next((g for g in (32, 16) if -(-k // g) == d.shape[1]), 0)  # the groups cover k (the last one padded)
    if not group or d.shape[0] != n or (m is not None and np.shape(m) != d.shape):
        raise ValueError(f"pack: weights {q.shape} with scales {d.shape} are not groups of 16 or 32")
    if bits == 4 and (q.min(initial=0) < 0 or q.max(initial=0) > 15):
        raise ValueError("pack: 4-bit integers must lie in 0..15")
    if bits == 8 and (q.min(initial=0) < -128 or q.max(initial=0) > 127):
        raise ValueError("pack: 8-bit integers must lie in -128..127")
    m = None if m is None else np.asarray(m, dtype=np.float32)
    pad_k = -k % 32
    if pad_k:  # zero integers past the real inputs (and zero scales for groups wholly past them)
        q = np.pad(q, ((0, 0), (0, pad_k)))
        more = (k + pad_k) // group - d.shape[1]
        d = np.pad(d, ((0, 0), (0, more)))
        m = None if m is None else np.pad(m, ((0, 0), (0, more)))
    kp = k + pad_k
    tiles = -(-n // LANES)
    pad_n = tiles * LANES - n
    q = np.pad(q, ((0, pad_n), (0, 0)))
    d = np.pad(d, ((0, pad_n), (0, 0)))
    m = None if m is None else np.pad(m, ((0, pad_n), (0, 0)))
    groups = kp // group
    f32 = not (_exact_in_half(d) and (m is None or _exact_in_half(m)))
    scale = np.float32 if f32 else np.float16
    # q [tiles * lanes, groups * group] -> tiles, groups, k, lanes
    qt = q.reshape(tiles, LANES, groups, group).transpose(0, 2, 3, 1)
    if bits == 4:
        qt = qt.astype(np.uint8).reshape(tiles, groups, group // 2, 2, LANES)
        qbytes = (qt[:, :, :, 0] | (qt[:, :, :, 1] << 4)).reshape(tiles, groups, -1)
    else:
        qbytes = np.ascontiguousarray(qt.astype(np.int8)).view(np.uint8).reshape(tiles, groups, -1)

    def side(s):
        return np.ascontiguousarray(s.reshape(tiles, LANES, groups).transpose(0, 2, 1)).astype(scale) \
            .view(np.uint8).reshape(tiles, groups, -1)

    parts = [qbytes, side(d)] + ([side(m)] if m is not None else [])
    data = np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(-1)
    return Packed(torch.from_numpy(data.copy()), n, kp, kind_code(bits, group, m is not None, f32))


def act8_records(packed: Packed) -> Packed:
    """The same weights for int8 activations (kind | ACT8): each 64-byte line of a record's integers reordered so
    that byte 4 l + i holds byte 16 i + l (output l's four bytes in one 32-bit lane, as VNNI multiplies them)."""
    if packed.kind & ACT8 or packed.kind == BF16:
        raise ValueError("act8_records: integer records without ACT8 only")
    qbytes, record = _record_bytes(packed.kind)
    raw = packed.data.view(-1, record).clone()
    raw[:, :qbytes] = raw[:, :qbytes].reshape(-1, qbytes // 64, 4, LANES).transpose(2, 3).reshape(-1, qbytes)
    return Packed(raw.view(-1), packed.out_features, packed.in_features, packed.kind | ACT8)


def pack_bf16(w: torch.Tensor) -> Packed:
    """Records for the kernel from a weight [N, K] whose values bfloat16 holds exactly (ValueError otherwise): per
    tile of 16 outputs, a 64-byte line per pair of k, each of its four 128-bit quarters holding 4 outputs' words of
    the first k then of the second (quant_cpu.cpp widens them by interleaving with zeros). K is padded to a multiple
    of 32 with zero weights."""
    w = w.detach()
    narrow = w.to(torch.bfloat16)
    if not torch.equal(narrow.float(), w.float()):
        raise ValueError("pack_bf16: the weights are not bfloat16 values")
    n, k = narrow.shape
    tiles = -(-n // LANES)
    narrow = torch.nn.functional.pad(narrow, (0, -k % 32, 0, tiles * LANES - n))
    kp = narrow.shape[1]
    # outputs (quarter, i) and k (pair, which) -> tile, pair, quarter, which, i
    records = narrow.view(tiles, 4, 4, kp // 2, 2).permute(0, 3, 1, 4, 2).contiguous()
    return Packed(records.view(-1).view(torch.uint8).clone(), n, kp, BF16)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once to float32 (through float64: equal to a fused multiply-add except where that double
    rounding differs, by an ulp)."""
    return (a.double() * b.double() + c.double()).float()


def qlinear_ref(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """The kernel's result in torch: per group, s = fma(q[:, k], x[:, k], s) for the group's k in order, then
    acc = fma(d, s, acc) and (affine) acc = fma(m, sum of x over the group, acc); bfloat16 records:
    acc = fma(w[:, k], x[:, k], acc) for every k in order."""
    shape = x.shape
    group, n = packed.group, packed.out_features
    x = x.reshape(-1, shape[-1]).float()
    if x.shape[1] < packed.in_features:
        x = torch.nn.functional.pad(x, (0, packed.in_features - x.shape[1]))
    if packed.kind == BF16:  # acc = fma(w[k], x[k], acc), k in order
        w = packed.dequantize()
        acc = torch.zeros(x.shape[0], n, dtype=torch.float32)
        for k in range(packed.in_features):
            acc = _fma(w[None, :, k], x[:, k, None], acc)
        return acc.view(*shape[:-1], n)
    q, d, m = packed.unpack()
    if packed.kind & ACT8:
        return _act8_ref(x, q, d, m, group).view(*shape[:-1], n)
    qf = q.float()
    acc = torch.zeros(x.shape[0], n, dtype=torch.float32)
    for g in range(packed.in_features // group):
        s = torch.zeros_like(acc)
        sx = torch.zeros(x.shape[0], 1)
        for k in range(g * group, (g + 1) * group):
            s = _fma(qf[None, :, k], x[:, k, None], s)
            sx = sx + x[:, k, None]
        acc = _fma(d[None, :, g], s, acc)
        if m is not None:
            acc = _fma(m[None, :, g], sx, acc)
    return acc.view(*shape[:-1], n)


def act8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] rounded per group to int8 as the kernel rounds it: (xq [M, K] integers in -127..127, xs [M, groups]):
    xs = max|x| / 127, xq = rint(x * (127 / max|x|)), 0 for a group of zeros."""
    xg = x.float().reshape(x.shape[0], -1, group)
    amax = xg.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xg * inv[..., None]).clamp(-127, 127)
    return xq.reshape(x.shape), amax / 127.0


def _act8_ref(x, q, d, m, group):
    """ACT8: per group s = sum of q * xq (exact integers), acc = fma(d * xs, s, acc), affine acc = fma(m, sq, acc)
    (sq = xs * the sum of xq over the group)."""
    xq, xs = act8(x, group)
    acc = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float32)
    for g in range(x.shape[1] // group):
        k = slice(g * group, (g + 1) * group)
        s = (xq[:, k].double() @ q[:, k].double().T).float()  # integers below 2^24: exact
        acc = _fma(d[None, :, g] * xs[:, g, None], s, acc)
        if m is not None:
            acc = _fma(m[None, :, g], xs[:, g, None] * xq[:, k].sum(1, keepdim=True), acc)
    return acc


# ---------------------------------------------------------------------------------------------------------------
# the C++ kernel

_library: Path | None = None  # the kernel library this process loaded (one per process)


@functools.cache
def _cpu_flags() -> str:
    """This CPU's flags line (read once per process: the build key and options.kv16 ask for it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]


def _variant_flags(generic: bool, avx2: bool) -> list[str]:
    return FLAGS + ["-DCLOVER_GENERIC"] * generic + ["-mno-avx512f"] * avx2


def build_key(generic: bool = False, avx2: bool = False) -> str:
    """What the built library depends on: its source, torch, the compiler's target (this CPU's flags), whether it is
    the portable path (or the AVX2 one)."""
    h = hashlib.sha256()
    for source in SOURCES:
        h.update(source.read_bytes())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    h.update(repr(_variant_flags(generic, avx2)).encode())
    return h.hexdigest()[:16]


def load(build_dir: Path, generic: bool = False, verbose: bool = False, avx2: bool = False) -> Path:
    """Build (once per build_key, in build_dir) and load the kernel library; its path. `generic`: the portable C++
    path even where the CPU has AVX-512 or AVX2; `avx2`: the AVX2 path even where it has AVX-512 (checks: every path
    gives the same bits). One library per process: the first loaded stays. Raises what the compiler raised when it
    cannot be built."""
    global _library
    if _library is not None:
        return _library
    from torch.utils.cpp_extension import load as build

    key = build_key(generic, avx2)
    name = f"clover_quant_{key}"
    where = Path(build_dir) / name
    so, done = where / f"{name}.so", where / "built"
    if not done.is_file():  # built by this process (another one building it meanwhile holds torch's lock there)
        where.mkdir(parents=True, exist_ok=True)
        build(name=name, sources=[str(s) for s in SOURCES], extra_cflags=_variant_flags(generic, avx2),
              extra_ldflags=["-fopenmp"], build_directory=str(where), is_python_module=False, verbose=verbose)
        done.write_text(key)  # not atomic: a marker written once the library is whole, only its presence is read
    else:
        torch.ops.load_library(str(so))
    _register_fake()
    _library = so
    return so


def _native():
    """The loaded kernel library's C functions (ctypes), or None before load()."""
    import ctypes

    return None if _library is None else ctypes.CDLL(str(_library))


@contextmanager
def float_activations():
    """While inside, kinds with ACT8 multiply the float32 activations as they are (no int8 rounding), in eager code and
    compiled programs alike: for checks against a reference that computes in floats. Nothing when no kernel library
    is loaded."""
    native = _native()
    if native is None:
        yield
        return
    before = native.clover_quant_float_activations(1)
    try:
        yield
    finally:
        native.clover_quant_float_activations(before)


def avx512() -> bool:
    """Whether the loaded kernel runs its AVX-512 path (else its portable C++)."""
    native = _native()
    return native is not None and bool(native.clover_quant_avx512())


def vnni() -> bool:
    """Whether the loaded kernel multiplies int8 activations with AVX-512 VNNI."""
    native = _native()
    return native is not None and bool(native.clover_quant_vnni())


def avx2() -> bool:
    """Whether the loaded kernel runs its AVX2 path (a CPU with AVX2, FMA and F16C but no AVX-512)."""
    native = _native()
    return native is not None and bool(native.clover_quant_avx2())


def int8_activations() -> bool:
    """Whether the loaded kernel multiplies int8 activations with SIMD (AVX-512 VNNI, or AVX2's VPMADDUBSW; else in
    portable C++, far slower than its float32 activations)."""
    native = _native()
    return native is not None and bool(native.clover_quant_int8())


def _register_fake() -> None:
    """The op's output shape for torch.export (the compiled step traces it)."""

    @torch.library.register_fake("clover_quant::linear")
    def _(x, packed, out_features, in_features, kind):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("clover_attention::exact_rows")
    def _(query, key, value, mask, scale, softcap):
        return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


def qlinear(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    return torch.ops.clover_quant.linear(x, packed.data, packed.out_features, packed.in_features, packed.kind)
