"""Triton kernels (clover_kernels) against their torch references.

Without CUDA the kernels run through Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set here before
anything imports triton or clover_kernels), so CI checks them; with CUDA (and the interpreter off) the same
comparisons run compiled on the GPU, plus a few larger shapes and bf16. Whichever device is not available is
skipped. Shapes are small on purpose: the interpreter runs every program in Python.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import clover_kernels as ck  # noqa: E402
from clover_kernels import tree_attention as ta_mod  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERPRET = ck.interpreting()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="TRITON_INTERPRET is off: CPU tensors "
                                                 "cannot run Triton kernels")),
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="no CUDA device, or the "
                                                  "interpreter is on (it would replace the compiled kernels)")),
]
FP16_TOL = dict(atol=4e-3, rtol=1e-2)
FP32_TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter is off")
def test_interpreter_is_active_when_needed():
    """The interpreter is chosen when the kernels are decorated: clover_kernels must not be imported earlier."""
    assert ck.triton_available()
    assert type(ta_mod._tree_attn_fwd).__name__ == "InterpretedFunction", (
        "clover_kernels was imported before TRITON_INTERPRET=1 was set; its kernels are compiled for a GPU")


# ------------------------------------------------------------------------------------------------- helpers


def random_parents(n: int, rng: random.Random, kind: str = "random") -> list[int]:
    if kind == "chain":
        return [-1] + list(range(n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    # mostly recent parents (deep trees), sometimes any earlier node (wide trees)
    return [-1] + [rng.randrange(max(0, i - 3), i) if rng.random() < 0.7 else rng.randrange(i) for i in range(1, n)]


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if parents[i] >= 0:
            mask[i] = mask[parents[i]]
        mask[i, i] = True
    return mask


def children(parents: list[int]) -> list[list[int]]:
    kids = [[] for _ in parents]
    for i in range(1, len(parents)):
        kids[parents[i]].append(i)
    return kids


def sibling_distinct_tokens(parents: list[int], vocab: int, rng: random.Random) -> list[int]:
    tokens = [rng.randrange(vocab)] + [0] * (len(parents) - 1)
    for kids in children(parents):
        picks = rng.sample(range(vocab), len(kids)) if len(kids) <= vocab else [rng.randrange(vocab) for _ in kids]
        for c, t in zip(kids, picks):
            tokens[c] = t
    return tokens


def depth_of(parents: list[int]) -> list[int]:
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


# ------------------------------------------------------------------------------------------ tree attention


@pytest.mark.parametrize("n", [1, 3, 63, 64, 65, 128])
def test_pack_tree_mask_roundtrip_and_layout(n):
    mask = torch.rand(n, n, generator=torch.Generator().manual_seed(n)) < 0.5
    mask[:, -1] = True  # bit 63 of a word (the sign bit) when n is a multiple of 64
    bits = ck.pack_tree_mask(mask)
    assert bits.dtype == torch.int64 and bits.shape == (n, (n + 63) // 64)
    assert torch.equal(ck.unpack_tree_mask(bits, n), mask)
    # the documented layout: bit j % 64 of word j // 64 of row i, nothing past n
    for i, row in enumerate(mask.tolist()):
        for w in range((n + 63) // 64):
            want = sum(1 << (j % 64) for j in range(64 * w, min(n, 64 * w + 64)) if row[j])
            assert int(bits[i, w]) & (2**64 - 1) == want


ATTN_CASES = [
    # n, D, Hkv, G, prefix, splits, B
    (1, 16, 1, 1, 0, None, 1),
    (3, 32, 2, 2, 5, None, 1),
    (17, 64, 2, 4, 130, 3, 1),
    (33, 16, 1, 2, 100, 2, 1),
    (5, 24, 2, 1, 200, 4, 1),  # head dim not a power of two; chunks not a multiple of the prefix
    (70, 32, 1, 1, 64, None, 1),  # two mask words a row
    (128, 16, 1, 1, 7, 1, 1),
    (9, 16, 2, 2, 40, 2, 2),  # batch of 2
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: "n{}-D{}-kv{}-G{}-L{}-S{}-B{}".format(*c))
def test_tree_attention_matches_reference(case, dtype, device):
    n, D, Hkv, G, L, splits, B = case
    rng = random.Random(zlib.crc32(repr(case).encode()))
    gen = torch.Generator().manual_seed(rng.randrange(10**6))
    kind = rng.choice(["random", "chain", "star"]) if n > 2 else "random"
    bits = ck.pack_tree_mask(ancestor_mask(random_parents(n, rng, kind))).to(device)
    capacity = L + n + 11  # K/V are views into a larger preallocated buffer, as TreeKVCache hands them over
    q = torch.randn(B, Hkv * G, n, D, generator=gen).to(device, dtype)
    kbuf = torch.randn(B, Hkv, capacity, D, generator=gen).to(device, dtype)
    vbuf = torch.randn(B, Hkv, capacity, D, generator=gen).to(device, dtype)
    k, v = kbuf[:, :, :L + n], vbuf[:, :, :L + n]
    scale = rng.choice([None, 0.3])
    out = ck.tree_attention_triton(q, k, v, bits, L, scale, num_splits=splits)
    ref = ck.tree_attention_ref(q, k, v, bits, L, scale)
    assert out.shape == ref.shape == (B, Hkv * G, n, D) and out.dtype == dtype
    assert out.transpose(1, 2).is_contiguous()  # the layout transformers wants back, without a copy
    torch.testing.assert_close(out.float(), ref.float(), **(FP32_TOL if dtype == torch.float32 else FP16_TOL))
    # The whole buffer may be passed: positions past prefix + n are ignored.
    whole = ck.tree_attention_triton(q, kbuf, vbuf, bits, L, scale, num_splits=splits)
    torch.testing.assert_close(whole, out, atol=0, rtol=0)


@pytest.mark.skipif(not ck.triton_available(), reason="neither a CUDA device nor TRITON_INTERPRET=1")
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_split_count_does_not_change_the_result(splits):
    device = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
    rng = random.Random(splits)
    n, L = 11, 300
    bits = ck.pack_tree_mask(ancestor_mask(random_parents(n, rng))).to(device)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, t, 32, generator=gen).to(device) for t in (n, L + n, L + n))
    out = ck.tree_attention_triton(q, k, v, bits, L, num_splits=splits)
    torch.testing.assert_close(out, ck.tree_attention_ref(q, k, v, bits, L), **FP32_TOL)


def test_tree_attention_reference_is_what_target_computes():
    """The reference equals the torch SDPA call that clover_cli.target.tree_attention makes on CPU."""
    from clover_cli.target import tree_attention

    rng = random.Random(3)
    n, L, Hkv, G, D = 13, 21, 2, 3, 16
    tree = ancestor_mask(random_parents(n, rng))
    mask = torch.ones(1, 1, n, L + n, dtype=torch.bool)
    mask[0, 0, :, L:] = tree
    q, k, v = torch.randn(1, Hkv * G, n, D), torch.randn(1, Hkv, L + n, D), torch.randn(1, Hkv, L + n, D)
    module = torch.nn.Module().eval()
    sdpa, _ = tree_attention(module, q, k, v, mask, scaling=None)
    ref = ck.tree_attention_ref(q, k, v, ck.pack_tree_mask(tree), L)
    torch.testing.assert_close(ref.transpose(1, 2), sdpa, **FP32_TOL)


# ------------------------------------------------------------------------------------------ verify / accept


def planted_logits(parents, tokens, vocab, rng, gen, ties=False):
    """Random logits [n, V] with a planted agreeing path from the root (random length), so that deep paths occur."""
    n = len(parents)
    logits = (torch.randint(0, 3, (n, vocab), generator=gen).float() if ties
              else torch.randn(n, vocab, generator=gen))
    kids = children(parents)
    node = 0
    while kids[node] and rng.random() < 0.85:
        child = rng.choice(kids[node])
        logits[node, tokens[child]] = logits[node].max() + (0 if ties else 1.0)  # ties: equal max, first wins
        node = child
    return logits


VERIFY_CASES = [(1, 7), (3, 50), (17, 1000), (33, 300), (100, 64)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,vocab", VERIFY_CASES + [(4, 9000)])  # 9000: ties within one lane of the row scan
def test_verify_greedy_matches_reference(n, vocab, device):
    rng = random.Random(n * 1000 + vocab)
    gen = torch.Generator().manual_seed(n)
    for trial in range(4):
        parents = random_parents(n, rng, ["random", "chain", "star", "random"][trial])
        tokens = sibling_distinct_tokens(parents, vocab, rng)
        logits = planted_logits(parents, tokens, vocab, rng, gen, ties=trial == 3).to(device)
        tok_t = torch.tensor(tokens, device=device)
        par_t = torch.tensor(parents, device=device)
        max_depth = max(depth_of(parents))
        for md in (None, max_depth + 2):
            got = ck.verify_greedy_triton(logits, tok_t, par_t, md)
            want = ck.verify_greedy_ref(logits, tok_t, par_t, md)
            for g, w in zip(got, want):
                assert g.device.type == device and g.dtype == torch.int64
                assert torch.equal(g.cpu(), w.cpu()), (parents, tokens, got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_verify_greedy_bonus_is_the_first_maximum(device):
    """Root-only trees: the bonus is argmax with the first index on ties, also across the row scan's blocks."""
    vocab = 9000  # the row is scanned in blocks of 4096: ties at the same lane of different blocks
    for first, others in [(7, [7 + 4096, 7 + 8192]), (4100, [4101, 8196]), (8999, []), (0, [4096, 1, 5000])]:
        logits = torch.zeros(1, vocab)
        logits[0, [first] + others] = 1.0
        for fn in (ck.verify_greedy_ref, ck.verify_greedy_triton):
            path, k, bonus = fn(logits.to(device), torch.tensor([5], device=device),
                                torch.tensor([-1], device=device))
            assert path.tolist() == [0] and int(k) == 0 and int(bonus) == first, fn.__name__


def test_verify_greedy_reference_is_the_engine_rule():
    from clover_cli.decode.verify import Sampling, accept
    from clover_cli.decode.tree import DraftTree

    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        n, vocab = rng.choice([1, 4, 17, 40]), rng.choice([5, 60])
        parents = random_parents(n, rng)
        tokens = sibling_distinct_tokens(parents, vocab, rng)
        logits = planted_logits(parents, tokens, vocab, rng, gen, ties=trial % 3 == 0)
        path, bonus = accept(DraftTree(tokens, parents), logits, Sampling(), torch.Generator())
        p, k, b = ck.verify_greedy_ref(logits, torch.tensor(tokens), torch.tensor(parents))
        assert p[:int(k) + 1].tolist() == path and int(b) == bonus


def planted_probs(parents, tokens, vocab, rng, gen):
    """Warped-looking probabilities: random, some zeroed (top-p), some rows unnormalised, planted likely path."""
    n = len(parents)
    probs = torch.softmax(torch.randn(n, vocab, generator=gen) * 2, -1)
    probs[torch.rand(n, vocab, generator=gen) < 0.3] = 0.0
    kids = children(parents)
    node = 0
    while kids[node] and rng.random() < 0.85:
        child = rng.choice(kids[node])
        probs[node, tokens[child]] += rng.choice([0.5, 5.0, 100.0, 100.0]) * probs[node].sum()
        node = child
    if n > 2 and kids[0]:
        row = rng.randrange(n)  # a row whose whole mass is on one child: always accepted
        if kids[row]:
            probs[row] = 0.0
            probs[row, tokens[rng.choice(kids[row])]] = 1.0
    return probs * torch.tensor([rng.choice([1.0, 1.0, 0.25, 4.0]) for _ in range(n)])[:, None]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,vocab", VERIFY_CASES[1:] + [(9, 5000)])
def test_verify_sample_matches_reference(n, vocab, device):
    rng = random.Random(n * 7 + vocab)
    gen = torch.Generator().manual_seed(n + vocab)
    lengths = []
    for trial in range(4):
        parents = random_parents(n, rng, ["random", "chain", "star", "random"][trial])
        tokens = sibling_distinct_tokens(parents, vocab, rng)
        probs = planted_probs(parents, tokens, vocab, rng, gen).to(device)
        tok_t, par_t = torch.tensor(tokens, device=device), torch.tensor(parents, device=device)
        for _ in range(3):
            u = torch.rand(n, generator=gen).to(device)
            got = ck.verify_sample_triton(probs, tok_t, par_t, u)
            want = ck.verify_sample_ref(probs, tok_t, par_t, u)
            for g, w in zip(got, want):
                assert g.device.type == device and g.dtype == torch.int64
                assert torch.equal(g.cpu(), w.cpu()), (parents, tokens, u, got, want)
            lengths.append(int(want[1]))
            final = int(want[0][int(want[1])])
            rejected = {tokens[c] for c in children(parents)[final]}
            assert int(want[2]) not in rejected and probs[final, int(want[2])] > 0
    assert max(lengths) >= 2  # planted paths were accepted deep, not just the root's bonus


@pytest.mark.parametrize("device", DEVICES)
def test_verify_sample_rejected_siblings_leave_their_mass(device):
    """Hand-checked cases: a rejected sibling's mass leaves the distribution the next sibling is tested against."""
    probs = torch.zeros(4, 6)
    probs[0, 3], probs[0, 1], probs[0, 4], probs[0, 5] = 0.3, 0.3, 0.2, 0.2
    probs[1:] = torch.tensor([0.0, 0.2, 0.3, 0.1, 0.25, 0.15])
    tokens, parents = torch.tensor([0, 3, 1, 4]), torch.tensor([-1, 0, 0, 0])  # children tried: 3, then 1, then 4
    cases = [  # uniforms (index 0: bonus, c: node c), expected path, expected bonus
        ([0.0, 0.9, 0.4, 0.0], [0, 2], 1),  # 3 rejected (.9 >= .3); 1 tested against .7: .28 < .3, accepted;
                                            # bonus with u = 0: the first token with mass (token 0 has none)
        ([0.0, 0.9, 0.5, 0.0], [0, 3], 1),  # 1 rejected too (.35 >= .3); 4 tested against .4: accepted
        ([0.5, 0.9, 0.5, 0.9], [0], 5),  # 4 rejected (.36 >= .2): only token 5 is left for the bonus
        ([0.55, 0.2, 0.0, 0.0], [0, 1], 3),  # bonus at node 1: CDF 0 .2 .5 .6 crosses .55 at token 3
    ]
    for u, path, bonus in cases:
        for fn in (ck.verify_sample_ref, ck.verify_sample_triton):
            got = fn(probs.to(device), tokens.to(device), parents.to(device), torch.tensor(u, device=device))
            assert got[0].tolist() == path + [-1] * (2 - len(path)), (fn.__name__, u)
            assert int(got[1]) == len(path) - 1 and int(got[2]) == bonus, (fn.__name__, u)


def test_verify_sample_reference_is_the_engine_rule():
    """Same acceptances as clover_cli.decode.verify.accept when fed the uniforms the engine draws, in its order."""
    from clover_cli.decode.verify import Sampling, accept, warp
    from clover_cli.decode.tree import DraftTree

    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    deep = 0
    for trial in range(40):
        n, vocab = rng.choice([2, 5, 17, 30]), rng.choice([8, 100])
        parents = random_parents(n, rng)
        tokens = sibling_distinct_tokens(parents, vocab, rng)
        logits = planted_logits(parents, tokens, vocab, rng, gen) * 2
        s = Sampling(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]))
        engine_rng = torch.Generator().manual_seed(trial)
        replay = torch.Generator().manual_seed(trial)
        path, bonus = accept(DraftTree(tokens, parents), logits, s, engine_rng)
        # The engine draws one uniform per child it tries: along the path up to each accepted child, then all the
        # children of the last node.
        kids = children(parents)
        u = torch.full((n,), 0.5)
        for node, nxt in zip(path, path[1:] + [None]):
            for c in kids[node]:
                u[c] = torch.rand((), generator=replay)
                if c == nxt:
                    break
        probs = torch.stack([warp(logits[i], s) for i in range(n)])
        p, k, b = ck.verify_sample_ref(probs, torch.tensor(tokens), torch.tensor(parents), u)
        assert p[:int(k) + 1].tolist() == path
        deep += len(path) > 2
        final = path[-1]
        assert int(b) not in {tokens[c] for c in kids[final]} and probs[final, int(b)] > 0
    assert deep > 3


# ------------------------------------------------------------------------------------------------ KV commit


def random_path(n_tree: int, length: int, rng: random.Random) -> list[int]:
    return [0] + sorted(rng.sample(range(1, n_tree), length - 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layers,heads,D,start,n_tree", [(1, 1, 16, 0, 1), (3, 2, 24, 5, 9), (4, 4, 64, 17, 20)])
def test_kv_commit_matches_reference(layers, heads, D, start, n_tree, dtype, device):
    rng = random.Random(layers * 100 + D + start)
    gen = torch.Generator().manual_seed(D)
    capacity = start + n_tree + 3
    for trial in range(3):
        length = rng.randint(1, n_tree)
        path = random_path(n_tree, length, rng)
        if trial == 1 and n_tree > 3:
            path = [0, 2, 3][:min(length, 3)] if length > 1 else [0]  # slot j read just before it is written
        pad = [-1] * rng.randint(0, 2)
        path_t = torch.tensor(path + pad, device=device)
        ks = [torch.randn(1, heads, capacity, D, generator=gen).to(device, dtype) for _ in range(layers)]
        vs = [torch.randn(1, heads, capacity, D, generator=gen).to(device, dtype) for _ in range(layers)]
        k_ref, v_ref = [t.clone() for t in ks], [t.clone() for t in vs]
        count = len(path) if trial != 2 else torch.tensor(len(path), device=device)  # host int or device tensor
        ck.kv_commit_ref(k_ref, v_ref, start, path_t, count)
        ck.kv_commit_triton(ks, vs, start, path_t, count)
        for got, want in zip(ks + vs, k_ref + v_ref):
            assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_commit_stacked_buffers_and_table_reuse(device):
    rng = random.Random(5)
    table = ck.PointerTable()
    stacked_k = torch.randn(3, 2, 30, 16).to(device)
    stacked_v = torch.randn(3, 2, 30, 16).to(device)
    ref_k, ref_v = stacked_k.clone(), stacked_v.clone()
    for start in (0, 4, 9):
        path = torch.tensor(random_path(8, rng.randint(1, 8), rng), device=device)
        ck.kv_commit_ref(ref_k, ref_v, start, path, path.numel())
        ck.kv_commit_triton(stacked_k, stacked_v, start, path, path.numel(), table=table)
        assert torch.equal(stacked_k, ref_k) and torch.equal(stacked_v, ref_v)


# ------------------------------------------------------------------------------------------------ head step


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 16), (3, 96), (17, 64)])
def test_rmsnorm_matches_reference(rows, hidden, dtype, device):
    gen = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(device, dtype)
    w = torch.randn(hidden, generator=gen).to(device, dtype)
    got, want = ck.rmsnorm_triton(x, w, 1e-6), ck.rmsnorm_ref(x, w, 1e-6)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, **(FP32_TOL if dtype == torch.float32 else FP16_TOL))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,heads,hd", [(1, 1, 16), (3, 4, 16), (5, 6, 5), (2, 8, 8)])
def test_cosine_gate_matches_reference(rows, heads, hd, dtype, device):
    gen = torch.Generator().manual_seed(rows * heads + hd)
    state, q, k, v = (torch.randn(2, rows, heads * hd, generator=gen).to(device, dtype) for _ in range(4))
    q[0, 0, :hd] = 0.0  # a zero vector: the eps clamp
    got, want = ck.cosine_gate_triton(state, q, k, v, heads), ck.cosine_gate_ref(state, q, k, v, heads)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, **(FP32_TOL if dtype == torch.float32 else FP16_TOL))


@pytest.mark.parametrize("device", DEVICES)
def test_gated_fusion_matches_the_module(device):
    from clover_cli.drafters.clover2 import GatedFusion

    torch.manual_seed(0)
    fusion = GatedFusion(64, 4, 1e-6).to(device).eval()
    with torch.no_grad():
        for p in fusion.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    state, emb = torch.randn(2, 5, 64, device=device), torch.randn(2, 5, 64, device=device)
    args = (state, emb, fusion.norm.weight, fusion.norm.eps, fusion.q.weight, fusion.q.bias, fusion.k.weight,
            fusion.k.bias, fusion.v.weight, fusion.v.bias, fusion.heads)
    with torch.no_grad():
        module = fusion(state, emb)
        torch.testing.assert_close(ck.gated_fusion_ref(*args), module, atol=0, rtol=0)
        torch.testing.assert_close(ck.gated_fusion_triton(*args), module, **FP32_TOL)


TOPK_CASES = [(1, 1, 1), (3, 7, 3), (2, 1000, 5), (5, 3001, 8), (2, 64, 64), (1, 20000, 24)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,vocab,k", TOPK_CASES)
def test_topk_matches_reference(rows, vocab, k, dtype, device):
    gen = torch.Generator().manual_seed(vocab + k)
    for kind in ("random", "ties", "inf"):
        if kind == "ties":  # many equal values: the lowest index must come first
            x = torch.randint(0, 4, (rows, vocab), generator=gen).float()
        else:
            x = torch.randn(rows, vocab, generator=gen)
        if kind == "inf":
            x[torch.rand(rows, vocab, generator=gen) < 0.9] = float("-inf")
        x = x.to(device, dtype)
        values, indices = ck.topk_triton(x, k)
        want_v, want_i = ck.topk_ref(x, k)
        assert values.dtype == dtype and indices.dtype == torch.int64
        assert torch.equal(values, want_v) and torch.equal(indices, want_i), kind
        assert torch.equal(values, torch.topk(x, k, dim=-1).values)  # same values as torch.topk


# ------------------------------------------------------------------------------ integration with the target


def _tiny_model(family: str, seed: int, device: str):
    from transformers import AutoModelForCausalLM

    from conftest import tiny_config

    torch.manual_seed(seed)
    cfg = tiny_config(family, 96, **({"sliding_window": 24} if family == "mistral" else {}))
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.to(device)


@pytest.fixture
def kernels_on(monkeypatch, request):
    """Route the target's tree attention and KV commit through the kernels on `device`, counting the calls."""
    import clover_cli.target as target_mod

    device = request.param
    monkeypatch.setattr(target_mod, "TRITON_DEVICE_TYPES", (device,))
    calls = {"attention": 0, "commit": 0}
    attn, commit = ck.tree_attention_triton, ck.kv_commit_triton

    def counted_attention(*a, **k):
        calls["attention"] += 1
        return attn(*a, **k)

    def counted_commit(*a, **k):
        calls["commit"] += 1
        return commit(*a, **k)

    monkeypatch.setattr(ck, "tree_attention_triton", counted_attention)
    monkeypatch.setattr(ck, "kv_commit_triton", counted_commit)
    return device, calls


@pytest.mark.parametrize("kernels_on", DEVICES, indirect=True)
def test_target_forward_and_commit_through_kernels(kernels_on):
    """Logits and cache after tree forwards and commits: kernel path == torch path (same model, fp32)."""
    import clover_cli.target as target_mod
    from clover_cli.target import Target

    device, calls = kernels_on
    model = _tiny_model("llama", 0, device)
    rng = random.Random(0)
    fast, slow = Target(model), Target(model)
    prompt = torch.tensor([rng.randrange(3, 96) for _ in range(9)], device=device)
    for t in (fast, slow):
        t.forward(prompt)
        t.cache.append(prompt.numel())
    for step in range(3):
        n = rng.choice([5, 12])
        parents = random_parents(n, rng)
        tokens = torch.tensor([rng.randrange(96) for _ in range(n)], device=device)
        depth = torch.tensor(depth_of(parents), device=device)
        mask = ancestor_mask(parents).to(device)
        _, logits_fast = fast.forward(tokens, fast.length + depth, mask)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(target_mod, "TRITON_DEVICE_TYPES", ())
            _, logits_slow = slow.forward(tokens, slow.length + depth, mask)
            path = [0, 1]
            while path[-1] == len(path) - 1:  # one that moves keys: nodes 0..k are already in place
                path = random_path(n, rng.randint(2, min(n, 4)), rng)
            slow.cache.commit(path)
        fast.cache.commit(path)
        torch.testing.assert_close(logits_fast, logits_slow, atol=1e-4, rtol=1e-4)
        assert fast.length == slow.length
        for a, b in zip(fast.cache.layers, slow.cache.layers):
            torch.testing.assert_close(a.keys[:, :, :fast.length], b.keys[:, :, :slow.length], atol=1e-5, rtol=0)
            torch.testing.assert_close(a.values[:, :, :fast.length], b.values[:, :, :slow.length], atol=1e-5,
                                       rtol=0)
    assert calls == {"attention": 3 * model.config.num_hidden_layers, "commit": 3}
    before = [layer.keys.clone() for layer in fast.cache.layers]
    fast.forward(tokens[:3], fast.length + torch.arange(3, device=device), torch.ones(3, 3, dtype=torch.bool,
                                                                                      device=device).tril())
    fast.cache.commit([0, 1, 2])  # a path drafted first is already in place: no launch, nothing moved
    assert calls["commit"] == 3 and fast.length == slow.length + 3
    for layer, old in zip(fast.cache.layers, before):
        torch.testing.assert_close(layer.keys[:, :, :slow.length], old[:, :, :slow.length], atol=0, rtol=0)


@pytest.mark.parametrize("kernels_on", DEVICES, indirect=True)
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_engine_through_kernels_is_lossless(kernels_on, family):
    """Greedy speculative decoding with the kernels equals transformers' greedy generate (Mistral's 24-token
    window also exercises the fallback to SDPA once the window is active)."""
    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import StopCheck
    from clover_cli.target import Target
    from helpers import OracleDrafter, hf_greedy, run_engine

    device, calls = kernels_on
    model = _tiny_model(family, 1, device)
    cpu_model = model if device == "cpu" else _tiny_model(family, 1, "cpu")
    rng = random.Random(family)
    prompt = [rng.randrange(3, 96) for _ in range(12)]
    n = 20
    reference = hf_greedy(cpu_model, prompt, n)
    engine = Engine(Target(model), OracleDrafter(reference, len(prompt), 96, 0.9, 1), budget=8, auto_budget=False)
    out, events = run_engine(engine, prompt, StopCheck(n))
    assert out == reference
    assert calls["attention"] > 0 and calls["commit"] > 0
    assert max(e.accepted for e in events) >= 2


# ------------------------------------------------------------------------------------ GPU compiler, no GPU


def test_kernels_compile_for_gpus():
    """Triton's real compiler (not the interpreter) accepts every kernel for sm_90 and sm_86, and each fits the
    architecture's shared memory, with the wrappers' launch configurations. Needs no GPU."""
    import subprocess
    import sys
    from pathlib import Path

    import triton.backends

    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this triton build has no NVIDIA backend")
    script = Path(__file__).resolve().parents[1] / "scripts" / "compile_kernels.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, str(script), "--quick", "--arch", "90", "86"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]


# ---------------------------------------------------------------------------------------- GPU-only extras


cuda_only = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA device (compiled kernels)")


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,D,Hkv,G,L", [(128, 128, 8, 4, 4000), (31, 64, 2, 7, 1500), (64, 256, 4, 2, 3000)])
def test_tree_attention_cuda_large(n, D, Hkv, G, L, dtype):
    rng = random.Random(n + D)
    bits = ck.pack_tree_mask(ancestor_mask(random_parents(n, rng)).cuda())
    q = torch.randn(1, Hkv * G, n, D, device="cuda", dtype=dtype)
    k = torch.randn(1, Hkv, L + n, D, device="cuda", dtype=dtype)
    v = torch.randn(1, Hkv, L + n, D, device="cuda", dtype=dtype)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else FP16_TOL
    torch.testing.assert_close(ck.tree_attention_triton(q, k, v, bits, L).float(),
                               ck.tree_attention_ref(q, k, v, bits, L).float(), **tol)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_and_topk_cuda_large_vocab(dtype):
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    vocab, n = 152064, 64
    parents = random_parents(n, rng)
    tokens = sibling_distinct_tokens(parents, vocab, rng)
    logits = planted_logits(parents, tokens, vocab, rng, gen).cuda().to(dtype)
    tok_t, par_t = torch.tensor(tokens, device="cuda"), torch.tensor(parents, device="cuda")
    for g, w in zip(ck.verify_greedy_triton(logits, tok_t, par_t), ck.verify_greedy_ref(logits, tok_t, par_t)):
        assert torch.equal(g, w)
    probs = torch.softmax(logits.float(), -1)
    u = torch.rand(n, generator=gen).cuda()
    for g, w in zip(ck.verify_sample_triton(probs, tok_t, par_t, u), ck.verify_sample_ref(probs, tok_t, par_t, u)):
        assert torch.equal(g, w)
    values, indices = ck.topk_triton(logits, 10)
    want_v, want_i = ck.topk_ref(logits, 10)
    assert torch.equal(values, want_v) and torch.equal(indices, want_i)
