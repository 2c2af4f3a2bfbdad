"""clover_kernels.attention.exact_rows: the CPU attention whose rows do not depend on the batch (issue #47: the int8
activations of a GGUF's blocks need every row of a verify to be the bits of a one-token step).

  - it is softmax attention (against attention_ref in float64): grouped-query heads, a tree mask, the causal default,
    a soft cap, rows that see nothing;
  - each row gives the same bits as that row alone over only the keys it sees (what a one-token step computes);
  - the portable C++ path gives the same bits as the AVX-512 one (the same operations in the same order);
  - float16 keys and values (a float16 KV cache) give the bits of their float32 widening, rows still alone.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clover_cli import store
from clover_kernels import quant
from clover_kernels.attention import attention_ref, exact_rows


@pytest.fixture(scope="module", autouse=True)
def kernels():
    quant.load(store.kernels_dir())


def inputs(n: int, past: int, heads=(6, 2), D=64, seed=0, spare=7):
    """q [1, Hq, n, D]; k, v [1, Hkv, L, D] views of larger buffers (as the cache's are); a tree mask over the n new
    tokens (each sees the committed ones, a few ancestors and itself)."""
    g = torch.Generator().manual_seed(seed)
    Hq, Hkv = heads
    L = past + n
    q = torch.randn(1, Hq, n, D, generator=g)
    k = torch.randn(1, Hkv, L + spare, D, generator=g)[:, :, :L]
    v = torch.randn(1, Hkv, L + spare, D, generator=g)[:, :, :L]
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    tree = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            tree[i] |= tree[p]
    mask = torch.zeros(1, 1, n, L, dtype=torch.bool)
    mask[..., :past] = True
    mask[0, 0, :, past:] = tree
    return q, k, v, mask


@pytest.mark.parametrize("n,past,heads,D", [(1, 0, (4, 4), 64), (1, 37, (6, 2), 64), (9, 50, (6, 2), 64),
                                            (17, 300, (9, 3), 64), (5, 20, (2, 1), 128), (3, 11, (4, 2), 32)])
def test_exact_rows_is_softmax_attention(n, past, heads, D):
    q, k, v, mask = inputs(n, past, heads, D)
    for m in (mask, None):
        got = exact_rows(q, k, v, m)
        want = attention_ref(q, k, v, m)
        assert got.shape == (1, n, heads[0], D)
        assert (got - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max())), m is None
    capped = exact_rows(q, k, v, mask, scale=0.3, softcap=2.0)
    assert (capped - attention_ref(q, k, v, mask, 0.3, 2.0)).abs().max() <= 1e-5


def test_a_row_that_sees_nothing_gives_zeros_and_batches_share_the_mask():
    q, k, v, mask = inputs(4, 10)
    mask[0, 0, 2] = False
    got = exact_rows(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), mask)
    assert torch.equal(got[:, 2], torch.zeros_like(got[:, 2])) and torch.equal(got[0], got[1])


@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,past", [(16, 300), (33, 129), (6, 0)])
def test_each_row_is_the_bits_of_that_row_alone(n, past, kv):
    """A row of a tree verify against the same query alone over only the keys it sees, as a one-token step after the
    same accepted path would compute it (the keys gathered into a buffer of their own): the same bits."""
    q, k, v, mask = inputs(n, past, (9, 3), seed=n)
    k, v = k.to(kv), v.to(kv)
    together = exact_rows(q, k, v, mask)
    for i in range(n):
        seen = mask[0, 0, i].nonzero().flatten()
        alone = exact_rows(q[:, :, i:i + 1], k[:, :, seen].contiguous(), v[:, :, seen].contiguous(), None)
        assert torch.equal(alone[:, 0], together[:, i]), i
    causal = exact_rows(q, k, v, None)  # the same rows over every committed key and the new ones before them
    for i in (0, n - 1):
        alone = exact_rows(q[:, :, i:i + 1], k[:, :, :past + i + 1], v[:, :, :past + i + 1], None)
        assert torch.equal(alone[:, 0], causal[:, i])


@pytest.mark.parametrize("n,past,D", [(1, 300, 64), (9, 50, 64), (5, 20, 128)])
def test_float16_keys_and_values_are_widened_exactly(n, past, D):
    """A float16 cache: the same bits as float32 keys and values holding the same numbers (each element widened
    exactly, then the same arithmetic), for a tree mask and the causal default, with a soft cap too; keys and values
    of different dtypes are refused in one line."""
    q, k, v, mask = inputs(n, past, (9, 3), D, seed=D + n)
    k16, v16 = k.half(), v.half()
    assert not torch.equal(k16.float(), k)  # the rounding is real: float32 keys give other numbers
    for m in (mask, None):
        assert torch.equal(exact_rows(q, k16, v16, m), exact_rows(q, k16.float(), v16.float(), m))
    assert torch.equal(exact_rows(q, k16, v16, mask, scale=0.3, softcap=2.0),
                       exact_rows(q, k16.float(), v16.float(), mask, scale=0.3, softcap=2.0))
    # a static step's buffers reach past the keys any row sees: those are never read
    g = torch.Generator().manual_seed(n)
    k_span = torch.cat([k16, torch.randn(1, 3, 20, D, generator=g).half()], 2)
    v_span = torch.cat([v16, torch.randn(1, 3, 20, D, generator=g).half()], 2)
    span_mask = torch.cat([mask, torch.zeros(1, 1, n, 20, dtype=torch.bool)], -1)
    assert torch.equal(exact_rows(q, k_span, v_span, span_mask), exact_rows(q, k16, v16, mask))
    with pytest.raises(RuntimeError, match="float32 or float16 keys and values"):
        exact_rows(q, k16, v, mask)


def test_the_portable_path_gives_the_same_bits(tmp_path):
    """The portable C++ (no AVX-512; its own process: one kernel library per process) computes the same operations in
    the same order as the AVX-512 path (which takes the query heads of a key/value head together): the same outputs,
    bit for bit (float16 keys and values, and a soft cap, too)."""
    cases = [inputs(n, past, (9, 3), D, seed=n) for n, past, D in ((1, 40, 64), (13, 200, 64), (4, 9, 128))]
    cases += [(q, k.half(), v.half(), m) for q, k, v, m in cases[:2]]
    # query heads per key/value head past what the AVX-512 path takes together (4 at 64 dims, 2 at 128, 1 at 256):
    # its chunks of heads, even and uneven
    chunked = [inputs(n, past, heads, D, seed=D + n) for n, past, heads, D in
               ((3, 30, (8, 1), 64), (2, 25, (7, 1), 64), (2, 21, (2, 1), 64), (3, 17, (6, 2), 128),
                (2, 10, (4, 2), 256), (1, 33, (4, 4), 16))]
    cases += chunked + [(q, k.half(), v.half(), m) for q, k, v, m in chunked[:4]]
    capped = [exact_rows(q, k, v, m, scale=0.3, softcap=2.0) for q, k, v, m in cases]  # the soft cap's branch
    outs = [exact_rows(q, k, v, m) for q, k, v, m in cases]
    torch.save({"cases": cases, "outs": outs, "capped": capped}, tmp_path / "cases.pt")
    code = f"""
import sys, torch
sys.path[:0] = {sys.path!r}
from clover_kernels import quant
from clover_kernels.attention import exact_rows, simd
quant.load({str(tmp_path / "build")!r}, generic=True)
assert not quant.avx512() and not simd()
saved = torch.load({str(tmp_path / "cases.pt")!r})
for (q, k, v, m), out, capped in zip(saved["cases"], saved["outs"], saved["capped"]):
    assert torch.equal(exact_rows(q, k, v, m), out), q.shape
    assert torch.equal(exact_rows(q, k, v, m, scale=0.3, softcap=2.0), capped), q.shape
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       cwd=Path(__file__).parent)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
