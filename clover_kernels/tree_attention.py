"""Tree attention: the queries of the n tree tokens against the committed prefix plus the tree's own keys.

Shapes (B is 1 in the engine, any B works):

    q     [B, Hq, n, D]          the tree tokens' queries
    k, v  [B, Hkv, >= L + n, D]  positions [0, L) are the committed prefix, [L, L + n) the tree tokens, anything
                                 after L + n is ignored (so a whole preallocated cache buffer can be passed)
    Hq = G * Hkv                 grouped-query attention: query head h reads kv head h // G
    out   [B, Hq, n, D]          in q's dtype (a view of a [B, n, Hq, D] buffer, so `out.transpose(1, 2)` is
                                 contiguous: the layout transformers wants back from an attention function)

Visibility: every query sees the whole prefix; query i sees tree token j when bit j of row i of `tree_bits` is set.

Tree mask layout (`pack_tree_mask`): int64 [n, W], W = ceil(n / 64). Bit b (0 = least significant) of word w in
row i is set when query i may see tree node j = 64 * w + b. Bits past n are zero. n <= 128 gives two words a row.
A tree's ancestor mask always has its diagonal set, so no query row is empty; rows with nothing visible are not
supported (the reference returns NaN for them, the kernel zeros).

Kernel (`_tree_attn_fwd`), flash-attention style with online softmax in base 2:

  * One program owns BLOCK_M rows of the flattened (group member g, query i) space of ONE kv head, so the G query
    heads that share a kv head read each K/V tile once (GQA aware); row r is head kv*G + r // n, query r % n.
  * Split-K: the prefix is cut into S chunks of `chunk` keys (a multiple of BLOCK_N); grid axis 2 is the chunk.
    The last chunk's program also runs over the n tree keys, where the bitmask is applied: for a key block
    [j0, j0 + BLOCK_N) with BLOCK_N dividing 64, all its bits lie in word j0 // 64 of each row, so one word per
    row is loaded and bit (j % 64) tested.
  * With S == 1 the program normalises and writes the output directly. With S > 1 each program writes its
    normalised partial output and log2-sum-exp to an fp32 workspace, and `_tree_attn_combine` merges the S
    partials of each row: out = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max).

Fully masked tiles are safe: the running max is replaced by 0 while it is still -inf, so exp2 never sees inf - inf.
"""

from __future__ import annotations

import math

import torch

from ._triton import require_triton, tl, triton

__all__ = ["pack_tree_mask", "unpack_tree_mask", "tree_attention_ref", "tree_attention_triton"]

LOG2E = 1.4426950408889634


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [n, n] (row i: which tree nodes query i sees) -> int64 [n, ceil(n / 64)] bit words (see module doc).

    Runs on the mask's device with a handful of torch ops and no host synchronisation.
    """
    if mask.dim() != 2 or mask.shape[0] != mask.shape[1]:
        raise ValueError(f"tree mask must be [n, n], got {tuple(mask.shape)}")
    n = mask.shape[0]
    words = (n + 63) // 64
    padded = torch.zeros(n, words * 64, dtype=torch.int64, device=mask.device)
    padded[:, :n] = mask.to(torch.int64)
    weights = torch.ones(64, dtype=torch.int64, device=mask.device) << torch.arange(64, device=mask.device)
    # Distinct powers of two: the (wrapping) int64 sum is their bitwise OR, bit 63 included.
    return (padded.view(n, words, 64) * weights).sum(-1)


def unpack_tree_mask(bits: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """int64 [n, W] bit words -> bool [n, n] (the inverse of `pack_tree_mask`)."""
    n = bits.shape[0] if n is None else n
    shifts = torch.arange(64, device=bits.device)
    unpacked = ((bits.to(torch.int64)[:, :, None] >> shifts) & 1).bool()  # [n, W, 64]
    return unpacked.reshape(bits.shape[0], -1)[:, :n]


def _check(q, k, v, tree_bits, prefix_len):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, H, T, D]")
    B, Hq, n, D = q.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[1] != v.shape[1] or k.shape[3] != D or v.shape[3] != D:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    Hkv = k.shape[1]
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} kv heads")
    if k.shape[2] < prefix_len + n or v.shape[2] < prefix_len + n:
        raise ValueError(f"k/v hold {k.shape[2]} positions, need prefix {prefix_len} + {n} tree tokens")
    if tree_bits.shape != (n, (n + 63) // 64):
        raise ValueError(f"tree_bits must be [{n}, {(n + 63) // 64}], got {tuple(tree_bits.shape)}")
    return B, Hq, Hkv, n, D


def tree_attention_ref(q, k, v, tree_bits, prefix_len: int, scale: float | None = None, num_splits=None):
    """Torch reference (fp32 math). `num_splits` is accepted for signature parity with the kernel and ignored."""
    B, Hq, Hkv, n, D = _check(q, k, v, tree_bits, prefix_len)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    total = prefix_len + n
    visible = torch.ones(n, total, dtype=torch.bool, device=q.device)
    visible[:, prefix_len:] = unpack_tree_mask(tree_bits, n)
    kf = k[:, :, :total].float().repeat_interleave(Hq // Hkv, dim=1)
    vf = v[:, :, :total].float().repeat_interleave(Hq // Hkv, dim=1)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf
    return out.to(q.dtype)


@triton.jit
def _online_softmax_step(m_i, l_i, acc, s, v_tile, PRECISION: tl.constexpr):
    """Fold a [BLOCK_M, BLOCK_N] tile of base-2 scores (-inf = hidden) and its values into the running state (the
    product in `PRECISION`: float32 operands as "ieee", not the TF32 a GPU would otherwise use)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tree_attn_fwd(
    Q, K, V, Bits, Out, Part, Lse,
    sqb, sqh, sqn, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sob, soh, son, sod,
    Hkv, n, D, prefix_len, chunk, num_splits, words, scale_log2,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SINGLE: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bk = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bk // Hkv
    kvh = pid_bk % Hkv

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # flattened (g, i)
    row_ok = rows < G * n
    g = rows // n
    qi = rows % n
    h = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    q = tl.load(Q + b * sqb + h[:, None] * sqh + qi[:, None] * sqn + d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh  # int64: a long cache can pass 2**31 elements
    v_base = V + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # The committed prefix: every query sees every key; only the chunk's end needs masking.
    lo = split * chunk
    hi = tl.minimum(lo + chunk, prefix_len)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        kt = tl.load(k_base + cols[None, :] * skn + d[:, None] * skd,
                     mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        vt = tl.load(v_base + cols[:, None] * svn + d[None, :] * svd,
                     mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale_log2
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, vt, PRECISION)

    # The tree's own keys, masked by the ancestor bits; done by the last split.
    if split == num_splits - 1:
        for start in range(0, n, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            j_ok = j < n
            pos = prefix_len + j
            kt = tl.load(k_base + pos[None, :] * skn + d[:, None] * skd,
                         mask=j_ok[None, :] & d_ok[:, None], other=0.0)
            vt = tl.load(v_base + pos[:, None] * svn + d[None, :] * svd,
                         mask=j_ok[:, None] & d_ok[None, :], other=0.0)
            word = tl.load(Bits + qi * words + start // 64, mask=row_ok, other=0)  # [BLOCK_M] int64
            bit = (word[:, None] >> (j % 64).to(tl.int64)[None, :]) & 1
            visible = (bit != 0) & j_ok[None, :]
            s = tl.dot(q, kt, input_precision=PRECISION) * scale_log2
            s = tl.where(visible, s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, vt, PRECISION)

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SINGLE:
        tl.store(Out + b * sob + h[:, None] * soh + qi[:, None] * son + d[None, :] * sod,
                 o.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        Hq = Hkv * G
        r = (b * Hq + h) * n + qi  # workspace row
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(Lse + r * num_splits + split, lse, mask=row_ok)
        tl.store(Part + (r * num_splits + split)[:, None] * D + d[None, :], o,
                 mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _tree_attn_combine(
    Part, Lse, Out, rows_total, Hq, n, D, num_splits,
    sob, soh, son, sod,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the split partials of BLOCK_R rows (row r = (b * Hq + h) * n + i) by their log2-sum-exp."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows_total
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(Lse + r * num_splits + s, mask=r_ok, other=float("-inf")))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s in range(0, num_splits):
        w = tl.exp2(tl.load(Lse + r * num_splits + s, mask=r_ok, other=float("-inf")) - m_use)
        part = tl.load(Part + (r * num_splits + s)[:, None] * D + d[None, :],
                       mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        den += w
        acc += w[:, None] * part
    o = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    b = r // (Hq * n)
    h = (r // n) % Hq
    i = r % n
    tl.store(Out + b[:, None] * sob + h[:, None] * soh + i[:, None] * son + d[None, :] * sod,
             o.to(Out.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


def launch_config(rows: int, head_dim: int, element_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_stages) of `_tree_attn_fwd` for G * n query rows of one kv head.

    BLOCK_N must divide 64 (a key block's mask bits then sit in one word per row). It shrinks for wide rows so the
    pipelined K/V tiles fit the shared memory of consumer GPUs (~99 KB a block on sm_86/sm_89); checked for
    sm_86 and sm_90 by scripts/compile_kernels.py.
    """
    BLOCK_D = max(16, triton.next_power_of_2(head_dim))
    row_bytes = BLOCK_D * element_size
    BLOCK_N = 64 if row_bytes <= 256 and element_size <= 2 else 32 if row_bytes <= 512 else 16
    BLOCK_M = max(16, min(64 if row_bytes <= 512 else 32, triton.next_power_of_2(rows)))
    return BLOCK_M, BLOCK_N, BLOCK_D, 3 if BLOCK_N == 64 else 2


MIN_CHUNK = 256  # keys per split below which splitting the prefix further does not pay


def _num_splits(q, prefix_len: int, programs: int, block_n: int, requested) -> int:
    if prefix_len == 0:
        return 1
    if requested is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        requested = min(triton.cdiv(prefix_len, MIN_CHUNK), triton.cdiv(2 * sms, programs))
    return max(1, min(int(requested), triton.cdiv(prefix_len, block_n)))


def tree_attention_triton(q, k, v, tree_bits, prefix_len: int, scale: float | None = None, num_splits=None):
    """Triton tree attention; same arguments and result as `tree_attention_ref` (see the module doc).

    num_splits: how many chunks the prefix is cut into (split-K); None picks enough to fill the GPU.
    """
    require_triton()
    B, Hq, Hkv, n, D = _check(q, k, v, tree_bits, prefix_len)
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.empty(B, n, Hq, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    if n == 0:
        return out
    bits = tree_bits.to(torch.int64).contiguous()
    BLOCK_M, BLOCK_N, BLOCK_D, num_stages = launch_config(G * n, D, q.element_size())
    blocks_m = triton.cdiv(G * n, BLOCK_M)
    splits = _num_splits(q, prefix_len, blocks_m * B * Hkv, BLOCK_N, num_splits)
    chunk = triton.cdiv(triton.cdiv(prefix_len, splits), BLOCK_N) * BLOCK_N if prefix_len else 0
    splits = triton.cdiv(prefix_len, chunk) if prefix_len else 1
    single = splits == 1
    if single:
        part = lse = out  # unused
    else:
        part = torch.empty(B * Hq * n, splits, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B * Hq * n, splits, dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # "tf32" only matters for fp32 operands
    _tree_attn_fwd[(blocks_m, B * Hkv, splits)](
        q, k, v, bits, out, part, lse,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        Hkv, n, D, prefix_len, chunk, splits, bits.shape[1], scale * LOG2E,
        G=G, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, SINGLE=single, PRECISION=precision,
        num_stages=num_stages,
    )
    if not single:
        rows = B * Hq * n
        BLOCK_R = 16
        _tree_attn_combine[(triton.cdiv(rows, BLOCK_R),)](
            part, lse, out, rows, Hq, n, D, splits, *out.stride(), BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D,
        )
    return out
