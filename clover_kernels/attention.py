"""Attention on the CPU whose rows do not depend on the batch (attention_cpu.cpp, built into the quantized kernels'
library by quant.load), beside its reference.

Each query row is computed from its own query and the keys it may see, in buffer order, by the same instructions
whatever the other rows are: a draft tree's verify gives every node bit for bit what a one-token step gives it
after the same accepted path. torch's SDPA does not (its sums depend on the number of rows and keys, ~1e-7
relative); with activations rounded to int8 before every product that noise grows into other tokens.

    exact_rows(query, key, value, mask, scale, softcap=0.0)   [B, Hq, n, D] x [B, Hkv, L, D] -> [B, n, Hq, D]
                                                              (query float32; keys and values float32 or float16)
    attention_ref(...)                                        the same attention in float64 (torch)
"""

from __future__ import annotations

import torch


HEAD_SIZES = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256)  # those attention_cpu.cpp is built for


def avx512() -> bool:
    """Whether the loaded kernel library runs exact_rows' AVX-512 path."""
    from .quant import _native

    native = _native()
    return native is not None and bool(native.clover_attention_avx512())


def simd() -> bool:
    """Whether the loaded kernel library runs exact_rows with SIMD (AVX-512, or AVX2 with FMA and F16C; else its
    portable C++, ~10x slower). Every path gives the same bits."""
    from .quant import _native

    native = _native()
    return native is not None and bool(native.clover_attention_avx512() or native.clover_attention_avx2())


def exact_rows(query, key, value, mask=None, scale: float | None = None, softcap: float = 0.0) -> torch.Tensor:
    """mask: bool [B|1, 1, n, L] (True = may attend; the first batch entry's is used for all) or None (causal after
    the L - n committed keys). Grouped-query attention when Hq is a multiple of Hkv. Returns [B, n, Hq, D]."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.clover_attention.exact_rows(query, key, value, mask, float(scale), float(softcap or 0.0))


def attention_ref(query, key, value, mask=None, scale: float | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Softmax attention in float64, the same contract as exact_rows; rows that see no key give zeros."""
    B, Hq, n, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    scale = D ** -0.5 if scale is None else scale
    k = key.double().repeat_interleave(Hq // Hkv, dim=1)
    v = value.double().repeat_interleave(Hq // Hkv, dim=1)
    s = torch.matmul(query.double(), k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is None:
        visible = torch.ones(n, L, dtype=torch.bool).tril(L - n)
    else:
        visible = mask.reshape(-1, n, L)[0].bool()
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.matmul(p, v).transpose(1, 2).float()
