"""The CPU's quantized linears (issue #47): clover_kernels.quant's C++ kernel beside its torch reference, a GGUF's
blocks decoded exactly, and models run on them losslessly.

  - the kernel equals qlinear_ref (the same float32 sums, in the same order) for every layout it packs, its portable
    C++ path too, and each row's result is the same whatever rows come with it (a verify gives a row what a one-row
    step gives); against the dequantized weights' float32 product it differs by float32 rounding only;
  - every GGUF type clover runs in its own blocks decodes to exactly what the gguf package dequantizes it to;
  - a converted GGUF (Llama with its q/k rows reordered by transformers, Qwen2 with biases) gets every linear packed,
    checked against transformers' weights; run on them, every drafter gives exactly transformers' greedy `generate`
    on the same quantized model, and so does the compiled step;
  - --quantize int8 / int4 quantizes any float model within the bound its bits allow, losslessly run too;
  - bad --quantize values and combinations fail in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from clover_cli import hub, quantized, store  # noqa: E402
from clover_kernels import quant  # noqa: E402
from helpers import hf_greedy, offline, run_engine  # noqa: E402

# (bits, group, affine, float32 scales)
LAYOUTS = [(4, 32, True, False), (4, 32, False, False), (8, 32, False, False), (8, 16, False, True),
           (8, 32, True, True), (4, 16, True, False), (4, 32, True, True)]
SHAPES = [(48, 64), (37, 96), (200, 256)]  # N not a multiple of 16, K of 32 and more


@pytest.fixture(scope="module", autouse=True)
def kernels():
    quant.load(store.kernels_dir())


def random_packed(n: int, k: int, bits: int, group: int, affine: bool, f32: bool, seed: int = 0):
    g = np.random.default_rng(seed)
    q = g.integers(0, 16, (n, k)) if bits == 4 else g.integers(-128, 128, (n, k))
    d = (g.random((n, k // group)) * 0.01 + 1e-4).astype(np.float32)
    m = (g.standard_normal((n, k // group)) * 0.01).astype(np.float32) if affine else None
    if not f32:  # scales float16 holds exactly: packed in float16
        d = d.astype(np.float16).astype(np.float32)
        m = None if m is None else m.astype(np.float16).astype(np.float32)
    else:
        d = d + np.float32(1e-9)  # not float16 values
    packed = quant.pack(q, d, m, bits)
    assert quant.kind_of(packed.kind) == (bits, group, affine, f32)
    return packed, q, d, m


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_equals_its_reference_row_by_row(layout):
    """The kernel's outputs are the reference's (an ulp apart at most, where the reference's float64 rounding of a
    fused multiply-add differs); each row alone gives the same bits as in any batch of rows; the packed records
    unpack to the integers and scales they were made from."""
    for n, k in SHAPES:
        packed, q, d, m = random_packed(n, k, *layout)
        uq, ud, um = packed.unpack()
        assert np.array_equal(uq.numpy(), q) and np.array_equal(ud.numpy(), d)
        assert (um is None) == (m is None) and (um is None or np.array_equal(um.numpy(), m))
        x = torch.randn(17, k)
        y = quant.qlinear(x, packed)
        ref = quant.qlinear_ref(x, packed)
        assert y.shape == (17, n) and ulps(y, ref) <= 1 and (y == ref).float().mean() > 0.99
        for rows in (1, 2, 3, 5, 8, 13):
            assert torch.equal(quant.qlinear(x[:rows], packed), y[:rows])
        assert torch.equal(quant.qlinear(x[9:10], packed), y[9:10])
        assert torch.equal(quant.qlinear(x[4:17], packed), y[4:17])  # a row in another place among others


def random_bf16(n: int, k: int, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).float()
    packed = quant.pack_bf16(w)
    assert packed.kind == quant.BF16 and quant.kind_of(packed.kind)[0] == 16
    return packed, w


def test_bf16_kernel_equals_its_reference_row_by_row():
    """bfloat16 weights: the kernel's outputs are the reference's (fma(w[k], x[k], acc), k in order; an ulp apart at
    most), each row alone the same bits as in any batch; the records hold the weights exactly; weights bfloat16
    cannot hold are refused."""
    for n, k in SHAPES:
        packed, w = random_bf16(n, k)
        assert packed.in_features == k + (-k % 32) and torch.equal(packed.dequantize()[:, :k], w)
        x = torch.randn(17, k)
        y = quant.qlinear(x, packed)
        assert y.shape == (17, n) and ulps(y, quant.qlinear_ref(x, packed)) <= 1
        want = torch.nn.functional.linear(x.double(), w.double()).float()
        assert (y - want).abs().max() <= 2e-5 * want.abs().max()  # float32 rounding apart, no more
        for rows in (1, 2, 3, 5, 8, 13):
            assert torch.equal(quant.qlinear(x[:rows], packed), y[:rows])
        assert torch.equal(quant.qlinear(x[4:17], packed), y[4:17])
    with pytest.raises(ValueError, match="not bfloat16 values"):
        quant.pack_bf16(torch.full((16, 32), 1.0 + 2**-10))


def test_kernel_is_the_dequantized_product_up_to_rounding():
    """Against F.linear with the dequantized float32 weights: float32 rounding apart, no more (no rounding of the
    activations, which would show at ~1e-2)."""
    for layout in LAYOUTS:
        packed, *_ = random_packed(96, 256, *layout, seed=3)
        x = torch.randn(8, 256)
        want = torch.nn.functional.linear(x.double(), packed.dequantize().double()).float()
        got = quant.qlinear(x, packed)
        assert (got - want).abs().max() <= 2e-5 * want.abs().max(), layout


def with_act8(packed):
    """The same weights with int8 activations (the kind QuantLinear runs integers with; its lines in VNNI order)."""
    out = quant.act8_records(packed)
    assert out.kind == packed.kind | quant.ACT8 and not torch.equal(out.data, packed.data)
    for a, b in zip(out.unpack(), packed.unpack()):
        assert (a is None and b is None) or torch.equal(a, b)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_int8_activations_kernel_equals_its_reference_row_by_row(layout):
    """ACT8: the kernel (VNNI where the CPU has it) equals its reference (each group's integer sum exact, then the
    same float32 steps), and each row alone gives the same bits as in any batch of rows."""
    for n, k in SHAPES:
        packed = with_act8(random_packed(n, k, *layout)[0])
        x = torch.randn(17, k) * torch.rand(17, 1) * 4
        x[3, :16] = 0.0  # a group of zeros (scale 0)
        y = quant.qlinear(x, packed)
        ref = quant.qlinear_ref(x, packed)
        assert y.shape == (17, n) and ulps(y, ref) <= 1 and (y == ref).float().mean() > 0.99
        for rows in (1, 2, 3, 5, 8, 13, 16):
            assert torch.equal(quant.qlinear(x[:rows], packed), y[:rows])
        assert torch.equal(quant.qlinear(x[4:17], packed), y[4:17])


def test_int8_activations_are_the_product_with_the_rounded_activations():
    """ACT8 computes the dequantized weights' product with each row rounded per group to int8 (xs = max|x| / 127):
    float32 rounding apart from F.linear on the rounded activations, and visibly apart from the float product (the
    rounding, within int8's bound). Inside float_activations() the same records multiply the floats as they are."""
    for layout in LAYOUTS:
        plain, *_ = random_packed(96, 256, *layout, seed=3)
        packed = with_act8(plain)
        x = torch.randn(8, 256)
        xq, xs = quant.act8(x, packed.group)
        assert xq.abs().max() == 127 and torch.equal(xq, xq.round())
        rounded = (xq.view(8, -1, packed.group) * xs[..., None]).view(8, 256)
        w = packed.dequantize().double()
        got = quant.qlinear(x, packed)
        want = torch.nn.functional.linear(rounded.double(), w).float()
        assert (got - want).abs().max() <= 2e-5 * want.abs().max(), layout
        exact = torch.nn.functional.linear(x.double(), w).float()
        assert 1e-4 < float((got - exact).abs().max() / exact.abs().max()) < 3e-2, layout
        with quant.float_activations():
            assert torch.equal(quant.qlinear(x, packed), quant.qlinear(x, plain))
        assert torch.equal(quant.qlinear(x, packed), got)  # and back


def test_kernel_takes_any_leading_shape_and_pads_inputs():
    packed, *_ = random_packed(40, 96, 4, 32, True, False)
    x = torch.randn(2, 3, 96)
    assert torch.equal(quant.qlinear(x, packed), quant.qlinear(x.reshape(6, 96), packed).reshape(2, 3, 40))
    narrow = quant.pack(np.zeros((16, 40), np.uint8), np.ones((16, 2), np.float32), None, 4)  # K 40 -> 64
    assert narrow.in_features == 64
    assert torch.equal(quant.qlinear(torch.randn(3, 40), narrow), torch.zeros(3, 16))
    assert quant.qlinear(torch.randn(0, 96), packed).shape == (0, 40)


def test_portable_path_equals_the_reference(tmp_path):
    """The portable C++ (machines without AVX-512) computes the same sums as the reference, in a process of its own
    (one kernel library per process)."""
    code = f"""
import sys, torch
sys.path[:0] = {sys.path!r}
from clover_kernels import quant
from test_quantized import LAYOUTS, random_bf16, random_packed, ulps
quant.load({str(tmp_path)!r}, generic=True)
assert not quant.avx512() and not quant.avx2() and not quant.int8_activations()
from test_quantized import with_act8
plain = [random_packed(37, 96, *layout)[0] for layout in LAYOUTS]
for packed in plain + [with_act8(p) for p in plain] + [random_bf16(37, 70)[0]]:
    x = torch.randn(11, packed.in_features)
    y = quant.qlinear(x, packed)
    assert ulps(y, quant.qlinear_ref(x, packed)) <= 1, packed.kind
    assert torch.equal(quant.qlinear(x[3:4], packed), y[3:4])
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       cwd=Path(__file__).parent)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_the_avx2_path_gives_the_native_paths_bits(tmp_path):
    """The AVX2 path (CPUs without AVX-512: each 16-lane tile as two halves of 8, int8 products by VPMADDUBSW) runs
    the same operations in the same order as the AVX-512 path and the portable C++: built for AVX2 in a process of its
    own, it gives the native library's outputs bit for bit, for every layout with float32 and int8 activations,
    bfloat16 weights, and exact_rows' attention (float32 and float16 keys and values)."""
    flags = set(quant._cpu_flags().split())
    if not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("this CPU has no AVX2 with FMA and F16C")
    from clover_kernels.attention import exact_rows
    from test_exact_rows import inputs

    g = torch.Generator().manual_seed(5)
    plain = [random_packed(37, 96, *layout, seed=i)[0] for i, layout in enumerate(LAYOUTS)]
    weights = plain + [with_act8(p) for p in plain] + [random_bf16(37, 70)[0]]
    xs = [torch.randn(11, p.in_features, generator=g) for p in weights]
    linear = [quant.qlinear(x, p) for x, p in zip(xs, weights)]
    cases = [inputs(n, past, (9, 3), D, seed=n) for n, past, D in ((1, 40, 64), (13, 200, 64), (4, 9, 128))]
    cases += [(q, k.half(), v.half(), m) for q, k, v, m in cases[:2]]
    # query heads per key/value head that the AVX-512 path splits into chunks (8 at 64 dimensions, 6/2 at 128)
    chunked = [inputs(n, past, heads, D, seed=D) for n, past, heads, D in ((3, 30, (8, 1), 64), (3, 17, (6, 2), 128))]
    cases += chunked + [(q, k.half(), v.half(), m) for q, k, v, m in chunked]
    attention = [exact_rows(*case) for case in cases]
    torch.save({"weights": [(p.data, p.out_features, p.in_features, p.kind) for p in weights], "xs": xs,
                "linear": linear, "cases": cases, "attention": attention}, tmp_path / "cases.pt")
    code = f"""
import sys, torch
sys.path[:0] = {sys.path!r}
from clover_kernels import quant
from clover_kernels.attention import exact_rows, simd
quant.load({str(tmp_path / "build")!r}, avx2=True)
assert quant.avx2() and not quant.avx512() and quant.int8_activations() and simd()
saved = torch.load({str(tmp_path / "cases.pt")!r})
for (data, n, k, kind), x, want in zip(saved["weights"], saved["xs"], saved["linear"]):
    assert torch.equal(torch.ops.clover_quant.linear(x, data, n, k, kind), want), kind
for case, want in zip(saved["cases"], saved["attention"]):
    assert torch.equal(exact_rows(*case), want), case[0].shape
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       cwd=Path(__file__).parent)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_pack_refuses_integers_out_of_range():
    with pytest.raises(ValueError, match="0..15"):
        quant.pack(np.full((16, 32), 16), np.ones((16, 1), np.float32), None, 4)
    with pytest.raises(ValueError, match="groups of 16 or 32"):
        quant.pack(np.zeros((16, 64)), np.ones((16, 1), np.float32), None, 8)


# ------------------------------------------------------------------------------------------ a GGUF's own blocks

def gguf_data(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Blocks of `type_name` for a random [n, k] weight: written by the gguf package, or by test_gguf's own K-quant
    writers, or (Q5_K) random bytes with sane scales."""
    from test_gguf import encode

    w = (np.random.default_rng(seed).standard_normal((n, k)) * 0.05).astype(np.float32)
    if type_name == "Q5_K":
        raw = np.random.default_rng(seed).integers(0, 256, (n, k // 256 * 176), dtype=np.uint8).reshape(-1, 176)
        raw[:, 0:4] = np.array([0.01, 0.003], np.float16).view(np.uint8)  # d, dmin
        return raw.reshape(n, -1)
    data, _ = encode(w, type_name)
    return data


@pytest.mark.parametrize("type_name", sorted(quantized.GGUF_TYPES))
def test_gguf_blocks_decode_to_what_the_gguf_package_dequantizes(type_name):
    n, k = 40, 512
    data = gguf_data(type_name, n, k)
    q, d, m, bits = quantized.decode(type_name, data, n, k)
    assert (bits, k // d.shape[1]) == quantized.GGUF_TYPES[type_name]
    packed = quant.pack(q, d, m, bits)
    want = gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, type_name)).reshape(n, k)
    assert np.array_equal(packed.dequantize().numpy(), want)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """GGUFs of test_gguf's random Llama and Qwen2 models in a few types (written once for the module)."""
    from conftest import build_tokenizer
    from test_gguf import source_model, write_gguf

    root = tmp_path_factory.mktemp("quantized-ggufs")
    tok = build_tokenizer(root / "tokenizer")
    files = {}
    for arch, file_type in (("llama", "Q4_K_M"), ("llama", "Q4_1"), ("qwen2", "Q8_0"), ("llama", "F16")):
        path = root / f"{arch}-{file_type}.gguf"
        write_gguf(path, tok, source_model(tok, arch, 0), arch, file_type)
        files[(arch, file_type)] = path
    return files


@pytest.fixture
def cache(tmp_path, monkeypatch):
    offline(tmp_path, monkeypatch)
    monkeypatch.delenv("CLOVER_GGUF_CACHE", raising=False)


def quantized_model(path: Path, weights: str = "gguf"):
    from clover_cli.loading import load

    resolved = hub.resolve_model(str(path), quiet=True)
    loaded = load(resolved.path, device="cpu", dtype="float32")
    float_model = load(resolved.path, device="cpu", dtype="float32").model
    note = quantized.apply(loaded.model, resolved.path, weights)
    return loaded.model, float_model, loaded.tokenizer, resolved, note


@pytest.mark.parametrize("arch,file_type,formats", [("llama", "Q4_K_M", {"Q4_K", "Q6_K"}), ("llama", "Q4_1", {"Q4_1"}),
                                                    ("qwen2", "Q8_0", {"Q8_0"})])
def test_a_converted_gguf_runs_every_linear_in_its_own_blocks(arch, file_type, formats, written, cache):
    """The conversion writes the blocks file; every linear of the model (the tied output embedding included) becomes a
    QuantLinear whose weight is exactly transformers' float weight, with the file's own formats."""
    model, float_model, _, resolved, note = quantized_model(written[(arch, file_type)])
    assert (resolved.path / quantized.BLOCKS_FILE).is_file()
    assert quantized.weights_for(None, "auto", torch.device("cpu"), resolved.path) == "gguf"
    assert quantized.weights_for(None, "float32", torch.device("cpu"), resolved.path) == "float"
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    quants = {name: m for name, m in model.named_modules() if isinstance(m, quantized.QuantLinear)}
    assert not linears and {m.format for m in quants.values()} == formats
    assert "float" not in note and note.startswith(tuple(formats))
    floats = dict(float_model.named_modules())
    for name, module in quants.items():
        assert torch.equal(module.weight, floats[name].weight), name
        if floats[name].bias is not None:
            assert torch.equal(module.bias, floats[name].bias), name


def test_a_float_gguf_has_no_blocks(written, cache):
    resolved = hub.resolve_model(str(written[("llama", "F16")]), quiet=True)
    assert not (resolved.path / quantized.BLOCKS_FILE).exists()
    assert quantized.weights_for(None, "auto", torch.device("cpu"), resolved.path) == "float"


@pytest.mark.parametrize("kv16", ["1", "0"])
def test_a_tree_verify_gives_each_node_the_bits_of_one_token_steps(kv16, written, cache, monkeypatch):
    """int8 activations (a GGUF's blocks): the model's attention runs clover's exact_rows, so a verify over a tree
    gives every node exactly the logits one-token steps give it along its path, bit for bit (without it, SDPA's
    float32 noise, rounded to int8 at the next linear, made the two ~2% apart on SmolLM2). Its KV cache holds
    float16 keys and values, as llama.cpp's does (float32 with CLOVER_KV16=0): bit for bit either way."""
    from clover_cli.target import EXACT_ROWS, Target
    from clover_cli.tree import DraftTree

    if not quant.int8_activations():
        pytest.skip("no AVX-512 VNNI or AVX2 here: the blocks run with float32 activations")
    monkeypatch.setenv("CLOVER_KV16", kv16)
    model, *_ = quantized_model(written[("llama", "Q4_1")])
    assert getattr(model, EXACT_ROWS, False) and getattr(model.model.layers[0].self_attn, EXACT_ROWS, False)
    target = Target(model)
    prefix = list(range(5, 25))
    tokens, parents = [7, 8, 9, 10, 11, 12, 13], [-1, 0, 0, 1, 3, 2, 4]
    target.reset(0)
    target.forward(torch.tensor(prefix))
    target.cache.append(len(prefix))
    assert target.cache.layers[0].keys.dtype == (torch.float16 if kv16 == "1" else torch.float32)
    ids, depths, mask = DraftTree(tokens, parents).tensors(torch.device("cpu"))
    _, together = target.forward(ids, len(prefix) + depths, mask)
    for node in range(len(tokens)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        target.cache.truncate(len(prefix))
        for j in reversed(path):
            _, alone = target.forward(torch.tensor([tokens[j]]))
            target.cache.append(1)
        assert torch.equal(alone[0], together[node]), node


def make(kind: str, model, target, seed: int):
    from test_gguf import make_drafter

    return make_drafter(kind, model, target, None, seed)


PROMPTS = ["Tell me about the quick brown fox and the lazy dog.", "What is the capital of France?"]


@pytest.mark.parametrize("arch,file_type", [("llama", "Q4_K_M"), ("qwen2", "Q8_0")])
def test_every_drafter_is_lossless_on_the_quantized_target(arch, file_type, written, cache):
    """On the file's own blocks, each drafter gives exactly transformers' greedy `generate` run on the same quantized
    model; and the quantized model's greedy text stays close to the dequantized float model's (counted, not
    required equal: float32 sums in another order)."""
    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import StopCheck
    from clover_cli.target import Target
    from test_gguf import chat_ids

    model, float_model, tok, _, _ = quantized_model(written[(arch, file_type)])
    target = Target(model)
    prompts = [chat_ids(tok, text) for text in PROMPTS]
    references = [hf_greedy(model, p, 24) for p in prompts]
    same_as_float = sum(r == hf_greedy(float_model, p, 24) for r, p in zip(references, prompts))
    for i, kind in enumerate(("none", "ngram", "self", "clover", "medusa", "eagle", "merged")):
        engine = Engine(target, make(kind, model, target, seed=i), budget=16, auto_budget=False)
        for prompt, reference in zip(prompts, references):
            out, _ = run_engine(engine, prompt, StopCheck(24))
            assert out == reference, (kind, prompt)
    assert same_as_float >= 1


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_any_float_model(bits, llama_dir):
    """--quantize: groupwise round to nearest with float16 scales, within half a step of the weight; the output
    embedding in 8 bits; the model runs losslessly against transformers' greedy generate on it."""
    from transformers import AutoModelForCausalLM

    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import StopCheck
    from clover_cli.drafters.ngram import NgramDrafter
    from clover_cli.target import Target

    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    originals = {name: m.weight.detach().clone() for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear)}
    note = quantized.apply(model, Path("."), f"int{bits}")
    assert note.startswith(f"int{bits}") and "float" not in note
    out_embed = model.get_output_embeddings()
    assert out_embed.format == "int8"
    for name, module in model.named_modules():
        if isinstance(module, quantized.QuantLinear):
            w, want = module.weight, originals[name]
            b = 8 if module is out_embed else bits
            groups = want.view(want.shape[0], -1, 32)
            step = (groups.abs().amax(2) / 127 if b == 8 else (groups.amax(2) - groups.amin(2)) / 15)
            slack = groups.abs().amax(2, keepdim=True) * 2**-10 + 1e-7  # the float16 rounding of d and m
            assert ((w - want).view_as(groups).abs() <= step[..., None] * 0.5 + slack).all(), name
    target = Target(model)
    prompt = list(range(5, 25))
    reference = hf_greedy(model, prompt, 20)
    for drafter in (None, NgramDrafter()):
        engine = Engine(target, drafter or make("none", model, target, 0), budget=8, auto_budget=False)
        out, _ = run_engine(engine, prompt, StopCheck(20))
        assert out == reference


def test_bf16_weights_of_any_float_model(llama_dir):
    """--dtype bfloat16 on a CPU: every parameter rounded to bfloat16 (the model becomes a bfloat16 checkpoint loaded
    in float32), the linears kept so for the kernel, RoPE's frequencies untouched; decoding on it gives exactly
    transformers' greedy generate on the same model, and the tokens the float32 model with the rounded weights and
    torch's own products gives."""
    import copy

    from transformers import AutoModelForCausalLM

    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import StopCheck
    from clover_cli.drafters.ngram import NgramDrafter
    from clover_cli.target import Target

    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    rounded = copy.deepcopy(model).to(torch.bfloat16).float()  # what the weights become, run by torch
    for name, b in rounded.named_buffers():
        b.copy_(buffers[name])
    note = quantized.apply(model, Path("."), "bf16")
    assert note.startswith("bf16") and "float" not in note
    assert all(isinstance(m, quantized.QuantLinear) for m in model.modules() if isinstance(m, torch.nn.Linear))
    want = dict(rounded.named_parameters())
    for name, p in model.named_parameters():  # norms, embeddings (the linears' weights are the kernels' now)
        assert torch.equal(p, want[name]), name
    for name, module in model.named_modules():
        if isinstance(module, quantized.QuantLinear):
            assert torch.equal(module.weight, rounded.get_submodule(name).weight), name
    assert all(torch.equal(b, buffers[name]) for name, b in model.named_buffers() if name in buffers)
    assert any("rotary" in name for name in buffers)
    target = Target(model)
    assert target.cache.kv_dtype is None  # float32 keys and values: transformers' generate on the same weights
    prompt = list(range(5, 25))
    reference = hf_greedy(model, prompt, 20)
    assert hf_greedy(rounded, prompt, 20) == reference
    for drafter in (None, NgramDrafter()):
        engine = Engine(target, drafter or make("none", model, target, 0), budget=8, auto_budget=False)
        out, _ = run_engine(engine, prompt, StopCheck(20))
        assert out == reference


def test_quantize_options_fail_in_one_line(run_cli, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hi")
    for args, says in ((["--quantize", "int3"], "--quantize must be int8 or int4"),
                       (["--quantize", "int8", "--load-in-8bit"], "exclude each other"),
                       (["--quantize", "int4", "--dtype", "bfloat16"], "drop --dtype bfloat16")):
        code, out, err = run_cli("generate", "tiny", "-f", str(prompt), "-n", "2", "--stats-file", "off", *args)
        assert code == 2 and says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for args, says in ((["--quantize", "int3"], "--quantize must be int8 or int4"),  # clover compile: the same check
                       (["--quantize", "int8", "--dtype", "bfloat16"], "drop --dtype bfloat16")):
        code, out, err = run_cli("compile", "tiny", *args)
        assert code == 2 and says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_generate_runs_quantized_and_says_so(run_cli, tmp_path):
    import json

    prompt = tmp_path / "p.txt"
    prompt.write_text("Tell me a story.")
    outs = {}
    for q in ("int8", "int4"):
        code, out, err = run_cli("generate", "tiny", "-f", str(prompt), "-n", "16", "--stats-file", "off",
                                 "--quantize", q, "--json")
        assert code == 0, err
        result = json.loads(out)
        assert result["weights"].startswith(q), result["weights"]
        outs[q] = result["text"]
    assert all(outs.values())


def test_bench_rows_of_a_quantized_model_equal_transformers_generate(run_cli, monkeypatch):
    """--quantize int4 on a CPU with VNNI: clover's cache holds float16 keys and values, and bench's hf row generates
    with its cache rounded the same way (target.Float16KV): every row gives hf's tokens; with CLOVER_KV16=0 likewise
    with float32 caches on both sides."""
    import json

    for kv16 in ("1", "0"):
        monkeypatch.setenv("CLOVER_KV16", kv16)
        code, out, err = run_cli("bench", "tiny", "--quantize", "int4", "--methods", "hf,plain,ngram", "--limit", "3",
                                 "-n", "24", "--compile", "off", "--json")
        assert code == 0, err
        report = json.loads(out)
        assert report["weights"].startswith("int4"), report["weights"]
        assert all(r["identical"] is True for r in report["methods"]), (kv16, report["methods"])


def test_the_cache_is_float16_only_under_clovers_attention(written, cache, monkeypatch):
    """kv_dtype: float16 for a model with int8 activations that runs clover's attention (which widens float16 keys
    and values); float32 once the model runs another attention, or with CLOVER_KV16=0."""
    from clover_cli.target import ATTN_NAME, kv_dtype

    if not quant.int8_activations():
        pytest.skip("no AVX-512 VNNI or AVX2 here: the blocks run with float32 activations")
    model, *_ = quantized_model(written[("llama", "Q4_1")])
    model.set_attn_implementation(ATTN_NAME)
    monkeypatch.setenv("CLOVER_KV16", "1")
    assert kv_dtype(model) == torch.float16
    monkeypatch.setenv("CLOVER_KV16", "0")
    assert kv_dtype(model) is None
    monkeypatch.setenv("CLOVER_KV16", "1")
    model.set_attn_implementation("sdpa")
    assert kv_dtype(model) is None


@pytest.mark.parametrize("flags, want", [("fpu avx2 fma f16c avx512f avx512dq avx512bw", True),
                                         ("fpu avx2 fma f16c", False)])
def test_the_float16_cache_by_default_only_where_the_cpu_has_avx512(flags, want, monkeypatch):
    """CLOVER_KV16 unset (or empty): float16 keys and values where the CPU has AVX-512 (a step measured faster), float32
    on an AVX2 CPU (measured slower); 1 and 0 decide on any CPU."""
    from clover_cli import options

    monkeypatch.setattr(quant, "_cpu_flags", lambda: flags)
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv("CLOVER_KV16", raising=False)
        else:
            monkeypatch.setenv("CLOVER_KV16", value)
        assert options.kv16() is want
    monkeypatch.setenv("CLOVER_KV16", "1")
    assert options.kv16() is True
    monkeypatch.setenv("CLOVER_KV16", "0")
    assert options.kv16() is False


def test_fused_products_equal_the_ones_they_replace(written, cache):
    """fused_linears (the compiled step's q/k/v and gate/up as one call each) changes no bit of the forward, and
    puts the model back as it was."""
    from clover_cli.quantized import SliceOf, fused_linears

    model, *_ = quantized_model(written[("llama", "Q4_K_M")])
    ids = torch.tensor([list(range(3, 40))])
    with torch.inference_mode():
        want = model(ids).logits
        with fused_linears(model) as swapped:
            assert swapped and any(isinstance(m, SliceOf) for m in model.modules())
            got = model(ids).logits
    assert not any(isinstance(m, SliceOf) for m in model.modules())
    assert torch.equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["int4", "bf16"])
def test_the_compiled_step_runs_quantized_weights_losslessly(weights, tmp_path):
    """A quantized (or bfloat16) model's compiled step (its kernel called from the AOTInductor program, q/k/v and
    gate/up fused) passes the build's checks against the eager step (and, with int8 activations, that every program
    gives a row the same bits), and decoding on it is exact: n-gram lookup and Clover-2 heads merged with it give
    plain decoding's tokens (bfloat16: transformers' greedy generate on the same model)."""
    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import StopCheck
    from clover_cli.step.aot import Package, step_weights
    from clover_cli.step.aot_export import build_for
    from clover_cli.target import Target
    from test_lossless import drafter_for, make_model

    import random

    model = make_model("llama", seed=3)
    quantized.apply(model, Path("."), weights)
    target = Target(model)
    meta = build_for(target, tmp_path / "pkg", log=lambda text: None, static=(1,), autotune=False)
    assert set(meta["ranges"]) == {"step-1.pt2", "step.pt2"}
    # the programs were built without the weights and read the model's: its tensors, or (the records streamed at
    # every step) one copy of them in large pages
    assert sorted(meta["weights_outside"]) == ["step-1.pt2", "step.pt2"]
    package = Package.find(tmp_path / "pkg")
    with pytest.raises(ValueError, match="built without their weights"):
        package.load()  # nothing to read them from
    step = package.load(model)
    named = step_weights(model)
    assert set(step._shared) == {"step-1.pt2", "step.pt2"}
    for constants in step._shared.values():
        assert constants and set(constants) <= set(named)
        for name, t in constants.items():
            assert torch.equal(t, named[name]) and (t.data_ptr() == named[name].data_ptr()) != (t.dtype == torch.uint8)
    target = Target(model)
    target.attach_program(step)
    prompt = list(range(5, 30))
    # bfloat16 weights multiply floats: transformers' generate (eager) is the reference. int8 activations: the
    # compiled step is exact with respect to itself (its build checked every program gives a row the same bits),
    # not to the eager step's bits, so the reference is its own plain decoding
    reference = hf_greedy(model, prompt, 24) if weights == "bf16" else None
    for kind in ("none", "ngram", "merged"):
        drafter = drafter_for(kind, model, target, random.Random(0), prompt, 0)
        out, events = run_engine(Engine(target, drafter, budget=8, auto_budget=False), prompt, StopCheck(24))
        reference = reference or out
        assert out == reference, kind


@pytest.mark.parametrize("arch", ["clover2", "medusa", "eagle"])
def test_heads_beside_a_quantized_target_run_as_int8_copies_and_decoding_stays_exact(arch):
    """Beside a target of integers (int8 activations) Clover-2, Medusa and EAGLE heads run their linears, and a draft
    vocabulary's shortlist, as 8-bit integers: a copy, the heads given (which training goes on with) left as they
    are. Their drafts change, the output does not: the default drafter on them gives plain decoding's tokens."""
    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import StopCheck
    from clover_cli.drafters.base import NoDrafter
    from clover_cli.drafters.clover2 import CloverDrafter
    from clover_cli.drafters.eagle import EagleDrafter
    from clover_cli.drafters.medusa import MedusaDrafter
    from clover_cli.drafters.merged import MergedDrafter
    from clover_cli.drafters.ngram import NgramDrafter
    from clover_cli.quantized import QuantLinear
    from clover_cli.target import Target
    from test_lossless import make_model, random_heads

    cls = {"clover2": CloverDrafter, "medusa": MedusaDrafter, "eagle": EagleDrafter}[arch]
    model = make_model("llama", seed=3)
    heads = random_heads(model, arch, 5, 3, 1)
    heads.draft_vocab = torch.arange(3, model.config.vocab_size // 2)
    assert not cls(heads, Target(model)).int8  # a float target: float heads
    quantized.apply(model, Path("."), "int4")
    if not quantized.runs_quantized(model):
        pytest.skip("this CPU's kernel has no SIMD int8 activations")
    drafter = cls(heads, Target(model))
    linears = [m for m in drafter.heads.modules() if isinstance(m, (torch.nn.Linear, QuantLinear))]
    assert drafter.int8 and linears and all(isinstance(m, QuantLinear) for m in linears)
    assert isinstance(drafter.project.linear, QuantLinear)
    assert not any(isinstance(m, QuantLinear) for m in heads.modules())
    prompt = list(range(5, 30))
    plain, _ = run_engine(Engine(Target(model), NoDrafter(), budget=8, auto_budget=False), prompt, StopCheck(32))
    target = Target(model)
    merged = MergedDrafter(cls(heads, target), NgramDrafter())
    out, events = run_engine(Engine(target, merged, budget=8, auto_budget=False), prompt, StopCheck(32))
    assert out == plain
    assert any(e.proposed for e in events)  # the heads (or lookup) drafted


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["clover2", "medusa"])
def test_int8_heads_programs_read_the_drafters_weights_and_decode_exactly(arch, tmp_path):
    """The compiled programs of heads of 8-bit integers (beside a quantized target) are built without their weights
    (no copy of the target's embedding in each) and read the drafter's own tensors; loaded without heads to read them
    from they are refused in one line; with them, the merged drafter on the compiled heads gives plain decoding's
    tokens."""
    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import StopCheck
    from clover_cli.drafters.base import NoDrafter
    from clover_cli.drafters.clover2 import CloverDrafter
    from clover_cli.drafters.medusa import MedusaDrafter
    from clover_cli.drafters.merged import MergedDrafter
    from clover_cli.drafters.ngram import NgramDrafter
    from clover_cli.step.aot import HeadsPrograms, heads_program_names, heads_weights
    from clover_cli.step.aot_export import build_heads_for
    from clover_cli.target import Target
    from test_lossless import make_model, random_heads

    cls = {"clover2": CloverDrafter, "medusa": MedusaDrafter}[arch]
    model = make_model("llama", seed=3)
    heads = random_heads(model, arch, 5, 3, 1)
    heads.draft_vocab = torch.arange(3, model.config.vocab_size // 2)  # a shortlist, mapped back to token ids
    quantized.apply(model, Path("."), "int4")
    if not quantized.runs_quantized(model):
        pytest.skip("this CPU's kernel has no SIMD int8 activations")
    builder = cls(heads, Target(model))
    assert builder.int8
    meta = build_heads_for(builder, 512, tmp_path / "heads", log=lambda text: None, autotune=False)
    names = heads_program_names(meta["kind"], meta["augment_ranges"])
    assert sorted(meta["weights_outside"]) == sorted(names)
    with pytest.raises(ValueError, match="built without their weights"):
        HeadsPrograms(tmp_path / "heads", meta["kind"], meta["capacity"], meta["augment_ranges"],
                      meta["weights_outside"])
    target = Target(model)
    drafter = cls(heads, target)
    programs = HeadsPrograms(tmp_path / "heads", meta["kind"], meta["capacity"], meta["augment_ranges"],
                             meta["weights_outside"], drafter, meta["weight_shapes"])
    for name in names:  # the drafter's own tensors, not copies
        named = heads_weights(drafter, name)
        assert programs._shared[name] and all(t.data_ptr() == named[n].data_ptr()
                                              for n, t in programs._shared[name].items())
    drafter.attach_programs(programs)
    prompt = list(range(5, 30))
    plain, _ = run_engine(Engine(Target(model), NoDrafter(), budget=8, auto_budget=False), prompt, StopCheck(32))
    out, events = run_engine(Engine(target, MergedDrafter(drafter, NgramDrafter()), budget=8, auto_budget=False),
                             prompt, StopCheck(32))
    assert out == plain
    assert any(e.proposed for e in events)


@pytest.mark.parametrize("dtype,runs", [("auto", {"Q4_1"}), ("float32", set())])
def test_regeneration_runs_a_gguf_targets_own_blocks(dtype, runs, written, cache, tmp_path, run_cli, monkeypatch):
    """`clover train --regenerate` of a GGUF target on a CPU gets its replies from the GGUF's own blocks (the target a
    session runs by default), in batches, from a copy: the features and the heads' training read the float model as
    loaded. `--dtype float32` regenerates on the float weights, as a session with it runs."""
    from transformers import GenerationMixin

    from clover_cli.train import data as train_data
    from clover_cli.train import features as train_features
    from clover_cli.train import loop as train_loop

    monkeypatch.setattr(train_data, "BATCHED_CPU_PARAMS", 0)  # the test model is small: force the batched path
    generated, featured = [], []
    real_generate, real_hidden = GenerationMixin.generate, train_features._hidden

    def spy_generate(self, *a, **k):
        generated.append({m.format for m in self.modules() if isinstance(m, quantized.QuantLinear)})
        return real_generate(self, *a, **k)

    def spy_hidden(model, x):
        featured.append(any(isinstance(m, quantized.QuantLinear) for m in model.modules()))
        return real_hidden(model, x)

    monkeypatch.setattr(GenerationMixin, "generate", spy_generate)
    monkeypatch.setattr(train_features, "_hidden", spy_hidden)
    monkeypatch.setattr(train_loop, "_hidden", spy_hidden)
    chats = [{"conversations": [{"from": "human", "value": f"Tell me about the number {i}."},
                                {"from": "gpt", "value": f"The number {i} is a number."}]} for i in range(6)]
    data = tmp_path / "chats.json"
    data.write_text(json.dumps(chats))
    out = tmp_path / "heads"
    code, _, err = run_cli("train", str(written[("llama", "Q4_1")]), "--data", str(data), "--out", str(out),
                           "--heads", "2", "--layers", "1", "--max-steps", "1", "--batch-tokens", "2048",
                           "--max-len", "384", "--regenerate", "--regen-max-tokens", "12", "--dtype", dtype)
    assert code == 0, err
    assert generated and all(formats == runs for formats in generated), generated
    assert ("regenerating on the GGUF's own weights" in err) == bool(runs)
    assert featured and not any(featured)
    assert len((out / "regenerated.jsonl").read_text().splitlines()) == 6
