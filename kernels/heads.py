"""Clover-2 head step kernels: RMSNorm, the cosine gate + residual of `GatedFusion`, and vocabulary top-k.

GatedFusion (clover_cli/heads.py) computes, per row of H = heads * hd features,

    q = Wq rmsnorm(state) + bq,  k = Wk emb + bk,  v = Wv emb + bv                       (three GEMMs)
    out = state + concat_h( cos(q_h, k_h) * v_h )

The GEMMs stay with cuBLAS (F.linear). What torch runs as a chain of small element-wise and reduction kernels
around them is fused here into two row kernels:

  * `_rmsnorm` (one program a row): fp32 mean of squares, x * rsqrt(mean + eps) rounded to x's dtype, times the
    weight; the same rounding points as `clover_cli.heads.RMSNorm`.
  * `_cosine_gate` (one program a row, a [heads, hd] tile): per head the dot product and the two norms (fp32),
    gate = dot / (max(|q|, eps) * max(|k|, eps)) as torch's cosine_similarity, rounded to v's dtype, then
    state + gate * v with torch's rounding order.

`gated_fusion_ref/triton(state, emb, norm_weight, eps, wq, bq, wk, bk, wv, bv, heads)` is the whole block.
Whether the fusion measurably helps has to be measured on a GPU (it saves ~10 small launches per call).

Top-k over the vocabulary without a sort (`topk_ref/topk_triton(logits [rows, V], k)`): values descending;
among equal values the LOWEST index comes first (the reference uses a stable descending sort, so both agree
exactly; NaN is not supported).

  * `_topk_chunks` (grid rows x V / BLOCK_V): each program selects its block's k best by k rounds of
    "max value, then the smallest index holding it", removing the winner each round. Candidates beyond the
    block's valid entries get index -1.
  * `_topk_merge` (grid rows): the same k rounds over the chunks' k candidates each, comparing original indices
    on ties, so the result is the global top-k with the lowest-index tie-break.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import require_triton, tl, triton

__all__ = ["rmsnorm_ref", "rmsnorm_triton", "cosine_gate_ref", "cosine_gate_triton", "gated_fusion_ref",
           "gated_fusion_triton", "topk_ref", "topk_triton"]

GATE_EPS = 1e-6  # GatedFusion's cosine_similarity eps


# ----------------------------------------------------------------------------------------------- RMSNorm


def rmsnorm_ref(x, weight, eps: float):
    """clover_cli.heads.RMSNorm.forward."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


@triton.jit
def _rmsnorm(X, W, Out, H, sx, so, eps, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_H)
    ok = c < H
    x = tl.load(X + row * sx + c, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(W + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * so + c, (normed * w).to(Out.dtype.element_ty), mask=ok)


def _rows(x):
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rmsnorm_triton(x, weight, eps: float):
    require_triton()
    H = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x2.shape[0]:
        _rmsnorm[(x2.shape[0],)](x2, weight.contiguous(), out, H, x2.stride(0), out.stride(0), float(eps),
                                 BLOCK_H=triton.next_power_of_2(H))
    return out.view(*x.shape[:-1], H)


# ------------------------------------------------------------------------------------- cosine gate + residual


def cosine_gate_ref(state, q, k, v, heads: int):
    """The tail of GatedFusion.forward: state + concat_h(cos(q_h, k_h) * v_h)."""
    shape = (*state.shape[:-1], heads, -1)
    q, k, v = q.view(shape), k.view(shape), v.view(shape)
    gate = F.cosine_similarity(q.float(), k.float(), dim=-1, eps=GATE_EPS).to(v.dtype)
    return state + (gate.unsqueeze(-1) * v).flatten(-2)


@triton.jit
def _cosine_gate(S, Q, K, V, Out, heads, hd, ss, sq, sk, sv, so, eps,
                 BLOCK_HEADS: tl.constexpr, BLOCK_HD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, BLOCK_HEADS)
    e = tl.arange(0, BLOCK_HD)
    ok = (hh[:, None] < heads) & (e[None, :] < hd)
    col = hh[:, None] * hd + e[None, :]
    q = tl.load(Q + row * sq + col, mask=ok, other=0.0).to(tl.float32)
    k = tl.load(K + row * sk + col, mask=ok, other=0.0).to(tl.float32)
    v = tl.load(V + row * sv + col, mask=ok, other=0.0)
    s = tl.load(S + row * ss + col, mask=ok, other=0.0)
    qn = tl.maximum(tl.sqrt(tl.sum(q * q, 1)), eps)
    kn = tl.maximum(tl.sqrt(tl.sum(k * k, 1)), eps)
    gate = tl.sum((q / qn[:, None]) * (k / kn[:, None]), 1)
    gate = gate.to(v.dtype).to(tl.float32)  # torch rounds the gate to v's dtype
    gv = (gate[:, None] * v.to(tl.float32)).to(v.dtype).to(tl.float32)
    tl.store(Out + row * so + col, (s.to(tl.float32) + gv).to(Out.dtype.element_ty), mask=ok)


def cosine_gate_triton(state, q, k, v, heads: int):
    require_triton()
    H = state.shape[-1]
    if H % heads:
        raise ValueError(f"hidden size {H} is not a multiple of {heads} heads")
    s2, q2, k2, v2 = _rows(state), _rows(q), _rows(k), _rows(v)
    out_dtype = torch.promote_types(state.dtype, v.dtype)
    out = torch.empty(s2.shape, dtype=out_dtype, device=state.device)
    hd = H // heads
    if s2.shape[0]:
        _cosine_gate[(s2.shape[0],)](s2, q2, k2, v2, out, heads, hd, s2.stride(0), q2.stride(0), k2.stride(0),
                                     v2.stride(0), out.stride(0), GATE_EPS,
                                     BLOCK_HEADS=triton.next_power_of_2(heads),
                                     BLOCK_HD=triton.next_power_of_2(hd))
    return out.view(*state.shape[:-1], H)


def gated_fusion_ref(state, emb, norm_weight, eps, wq, bq, wk, bk, wv, bv, heads: int):
    """clover_cli.heads.GatedFusion.forward with its parameters passed explicitly."""
    q = F.linear(rmsnorm_ref(state, norm_weight, eps), wq, bq)
    return cosine_gate_ref(state, q, F.linear(emb, wk, bk), F.linear(emb, wv, bv), heads)


def gated_fusion_triton(state, emb, norm_weight, eps, wq, bq, wk, bk, wv, bv, heads: int):
    """GatedFusion with the norm and the gate epilogue as Triton kernels and the three GEMMs as F.linear."""
    q = F.linear(rmsnorm_triton(state, norm_weight, eps), wq, bq)
    return cosine_gate_triton(state, q, F.linear(emb, wk, bk), F.linear(emb, wv, bv), heads)


# --------------------------------------------------------------------------------------------------- top-k


def topk_ref(logits, k: int):
    """(values, indices) of the k largest entries of each row, descending, lowest index first on ties."""
    values, indices = torch.sort(logits, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


@triton.jit
def _topk_chunks(X, sx, V, CandVal, CandIdx, chunks, K, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    vocab = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    avail = vocab < V
    x = tl.load(X + row * sx + vocab, mask=avail, other=float("-inf")).to(tl.float32)
    out = (row * chunks + chunk) * K
    for t in range(0, K):
        best = tl.max(tl.where(avail, x, float("-inf")), 0)
        pick = tl.min(tl.where(avail & (x == best), vocab, 2147483647), 0)
        got = pick < 2147483647
        tl.store(CandVal + out + t, tl.where(got, best, float("-inf")))
        tl.store(CandIdx + out + t, tl.where(got, pick, -1).to(tl.int64))
        avail = avail & (vocab != pick)


@triton.jit
def _topk_merge(CandVal, CandIdx, OutVal, OutIdx, n_cand, K, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    idx = tl.load(CandIdx + row * n_cand + c, mask=c < n_cand, other=-1)
    val = tl.load(CandVal + row * n_cand + c, mask=c < n_cand, other=float("-inf"))
    avail = idx >= 0
    big = 9223372036854775807
    for t in range(0, K):
        best = tl.max(tl.where(avail, val, float("-inf")), 0)
        pick = tl.min(tl.where(avail & (val == best), idx, big), 0)
        tl.store(OutVal + row * K + t, best.to(OutVal.dtype.element_ty))
        tl.store(OutIdx + row * K + t, pick)
        avail = avail & (idx != pick)


def topk_triton(logits, k: int):
    """Two launches: per-block top-k candidates, then a per-row merge. Same result as `topk_ref`."""
    require_triton()
    V = logits.shape[-1]
    if not 0 < k <= V:
        raise ValueError(f"k must be in [1, {V}], got {k}")
    x = _rows(logits)
    rows = x.shape[0]
    BLOCK_V = min(1024, triton.next_power_of_2(V))
    while triton.cdiv(V, BLOCK_V) * k > 8192 and BLOCK_V < 8192:  # keep the merge vector bounded
        BLOCK_V *= 2
    chunks = triton.cdiv(V, BLOCK_V)
    cand_val = torch.empty(rows, chunks, k, dtype=torch.float32, device=x.device)
    cand_idx = torch.empty(rows, chunks, k, dtype=torch.int64, device=x.device)
    values = torch.empty(rows, k, dtype=logits.dtype, device=x.device)
    indices = torch.empty(rows, k, dtype=torch.int64, device=x.device)
    if rows:
        _topk_chunks[(rows, chunks)](x, x.stride(0), V, cand_val, cand_idx, chunks, k, BLOCK_V=BLOCK_V)
        _topk_merge[(rows,)](cand_val, cand_idx, values, indices, chunks * k, k,
                             BLOCK_C=triton.next_power_of_2(chunks * k))
    shape = (*logits.shape[:-1], k)
    return values.view(shape), indices.view(shape)
