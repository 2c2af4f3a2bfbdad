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
