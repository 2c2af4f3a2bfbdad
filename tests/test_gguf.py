"""GGUF models (issue #46 item 5): files written here with the `gguf` package (tiny random Llama and Qwen2 models
with the byte-level BPE tokenizer conftest builds, their tensors in F32, F16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and a
Q4_K_M-like mix), converted by `resolve_model` into clover's cache, then:

  - the converted weights are exactly what the gguf package dequantizes from the file (a float file: exactly the
    model it was written from, logits included), and the tokenizer and chat template survive the trip;
  - every drafter (none, n-gram, self, a GGUF draft model, random Clover-2 / Medusa / EAGLE / EAGLE-3 heads, heads
    merged with n-gram lookup) gives exactly transformers' greedy `generate` on the converted model;
  - `clover generate FILE.gguf` works end to end and a second run (or a copy of the file elsewhere) converts nothing;
  - bad input (a truncated file, an unsupported architecture, a text file named .gguf, a folder of two GGUFs, a
    missing file, a damaged file that still parses) fails in one line and leaves nothing in the cache, and neither
    does a conversion interrupted half-way.

A slow test runs the real SmolLM2 Q4_1 file when it is on this machine (CLOVER_SMOLLM2_GGUF, else the package
source's cached copy): n-gram and plain decoding equal transformers' greedy output on two chat prompts.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from clover_cli import aliases, gguf_model, hub, store  # noqa: E402
from clover_cli.errors import CloverError  # noqa: E402
from conftest import CORPUS, build_tokenizer, tiny_config  # noqa: E402
from helpers import hf_greedy, offline, run_engine  # noqa: E402

# Found before any test redirects XDG_CACHE_HOME: CLOVER_SMOLLM2_GGUF, else where the user's package cache keeps
# smollm2's GGUF (only its path here: its hash is checked in the test, whose cache is its own).
SMOLLM2_PACKAGE = aliases.ALIASES["smollm2"].package
REAL_SMOLLM2 = Path(os.environ.get("CLOVER_SMOLLM2_GGUF") or SMOLLM2_PACKAGE.path())

# ------------------------------------------------------------------------------------------------- the writer

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, CONTEXT = 256, 512, 4, 4, 2, 512  # rows of 256 values: K-quant blocks fit
ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}
Q = gguf.GGMLQuantizationType


def _half_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_K blocks of `w` (rows of 256 values: 8 sub-blocks of 32 with 6-bit scales and mins under two
    fp16 super-scales, 4-bit codes), rounded to nearest: gguf.quants reads Q4_K but cannot write it."""
    rows = w.shape[0]
    x = w.astype(np.float32).reshape(-1, 8, 32)
    nb = x.shape[0]
    low = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - low) / 15
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = (-low.min(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / np.where(dmin > 0, dmin, 1)), 0, 63).astype(np.uint8)
    step, offset = d * sc, dmin * mn
    q = np.clip(np.rint((x + offset[..., None]) / np.where(step > 0, step, 1)[..., None]), 0, 15).astype(np.uint8)
    # the 12 bytes of scales: the low 6 bits of scales 0-3 and mins 0-3, then 4-7 split into nibbles and top bits
    scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(nb, 128)  # each 32 bytes: sub-block 2j low, 2j + 1 high
    return np.concatenate([_half_bytes(d), _half_bytes(dmin), scales, qs], axis=1).reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """llama.cpp's Q6_K blocks of `w` (rows of 256 values: 16 sub-blocks of 16 with int8 scales under one fp16
    scale, 6-bit codes stored as 4 low bits and 2 high bits), rounded to nearest."""
    rows = w.shape[0]
    x = w.astype(np.float32).reshape(-1, 16, 16)
    nb = x.shape[0]
    scale = np.abs(x).max(-1) / 31
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)), 1, 127).astype(np.int8)
    q = np.clip(np.rint(x / (d * sc)[..., None]), -32, 31).astype(np.int16)
    u = (q + 32).astype(np.uint8).reshape(nb, 2, 4, 32)
    lo, hi = u & 15, u >> 4
    ql = (lo[:, :, 0:2] | (lo[:, :, 2:4] << 4)).reshape(nb, 128)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(nb, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _half_bytes(d)], axis=1).reshape(rows, -1)


OWN_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


def tensor_type(file_type: str, gguf_name: str, ndim: int) -> str:
    """The type a tensor is stored in, in a file of `file_type`: 1-D tensors (norms, biases) stay F32 as llama.cpp
    writes them; Q4_K_M keeps the output, value and down projections in Q6_K, the rest in Q4_K, as llama.cpp's mix
    does."""
    if ndim == 1:
        return "F32"
    if file_type == "Q4_K_M":
        return "Q6_K" if gguf_name.split(".")[-2] in ("output", "attn_v", "ffn_down") else "Q4_K"
    return file_type


def encode(a: np.ndarray, type_name: str) -> tuple[np.ndarray, object]:
    """(data, raw_dtype) for GGUFWriter.add_tensor."""
    if type_name == "F32":
        return a.astype(np.float32), None
    if type_name == "F16":
        return a.astype(np.float16), None
    qtype = getattr(Q, type_name)
    if type_name in OWN_QUANTIZERS:
        return OWN_QUANTIZERS[type_name](a), qtype
    return gguf.quants.quantize(a.astype(np.float32), qtype), qtype


def decode(data: np.ndarray, type_name: str, shape) -> np.ndarray:
    """What the gguf package dequantizes the stored data to."""
    if type_name in ("F32", "F16"):
        return data.astype(np.float32).reshape(shape)
    return gguf.quants.dequantize(data, getattr(Q, type_name)).reshape(shape)


def source_model(tokenizer, arch: str, seed: int):
    """The random transformers model a GGUF is written from: 4 layers, hidden 256, sharpened logits, Qwen2's q/k/v
    biases random too."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, len(tokenizer), hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=CONTEXT)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.05)
    return model


def write_gguf(path: Path, tokenizer, model, arch: str = "llama", file_type: str = "F32", *,
               architecture: str | None = None, drop_tensors: tuple[str, ...] = (),
               metadata: dict | None = None) -> dict[str, torch.Tensor]:
    """Write `model` (built by source_model) and `tokenizer` as a llama.cpp GGUF of `file_type`; returns what each
    of the model's weights must be after conversion: the stored data as the gguf package dequantizes it, the rotary
    permutation of Llama's q/k undone. `architecture` names another architecture in the file; `drop_tensors` (GGUF
    names) leaves tensors out; `metadata` (keys without the architecture prefix) changes values, None leaves one out."""
    from clover_cli.llamacpp import _add_vocab, interleaved_to_rotary, rotary_to_interleaved

    cfg = model.config
    name = architecture or gguf.MODEL_ARCH_NAMES[ARCHS[arch]]
    writer = gguf.GGUFWriter(path, name)
    writer.add_name(f"tiny-{arch}")
    meta = {"context_length": ("uint32", CONTEXT), "embedding_length": ("uint32", HIDDEN),
            "block_count": ("uint32", LAYERS), "feed_forward_length": ("uint32", FFN),
            "attention.head_count": ("uint32", HEADS), "attention.head_count_kv": ("uint32", KV_HEADS),
            "rope.dimension_count": ("uint32", HIDDEN // HEADS), "rope.freq_base": ("float32", 10000.0),
            "attention.layer_norm_rms_epsilon": ("float32", cfg.rms_norm_eps), "vocab_size": ("uint32", cfg.vocab_size)}
    for key, (kind, value) in meta.items():
        value = (metadata or {}).get(key, value)
        if value is not None:
            getattr(writer, f"add_{kind}")(f"{name}.{key}", value)
    if arch == "qwen2":  # llama.cpp names Qwen2's own pre-tokenizer, and transformers applies it to any qwen2 model
        writer.add_tokenizer_pre = lambda pre: gguf.GGUFWriter.add_tokenizer_pre(writer, "qwen2")
    _add_vocab(writer, tokenizer, cfg.vocab_size)
    writer.add_chat_template(tokenizer.chat_template)
    names = gguf.get_tensor_name_map(ARCHS[arch], LAYERS)
    expected = {}
    for hf_name, param in model.named_parameters():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        a = param.detach().numpy()
        heads = {"q_proj.weight": HEADS, "k_proj.weight": KV_HEADS}.get(".".join(hf_name.split(".")[-2:]))
        permute = arch == "llama" and heads is not None  # llama.cpp rotates pairs of adjacent dimensions
        if permute:
            a = rotary_to_interleaved(a, heads)
        kind = tensor_type(file_type, gguf_name, a.ndim)
        data, raw_dtype = encode(np.ascontiguousarray(a), kind)
        back = decode(data, kind, a.shape)
        expected[hf_name] = torch.from_numpy(interleaved_to_rotary(back, heads) if permute else back.copy())
        if gguf_name not in drop_tensors:
            writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@dataclass
class Written:
    path: Path
    arch: str
    file_type: str
    expected: dict  # hf name -> the weight the conversion must give
    model: object  # the float model it was written from


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, tokenizer):
    """written(arch, file_type, seed=0): a GGUF of the random model (arch, seed), written once per module."""
    root = tmp_path_factory.mktemp("ggufs")
    made: dict = {}
    models: dict = {}

    def written(arch: str = "llama", file_type: str = "F32", seed: int = 0) -> Written:
        key = (arch, file_type, seed)
        if key not in made:
            if (arch, seed) not in models:
                models[(arch, seed)] = source_model(tokenizer, arch, seed)
            model = models[(arch, seed)]
            path = root / f"tiny-{arch}-{seed}-{file_type}.gguf"
            made[key] = Written(path, arch, file_type, write_gguf(path, tokenizer, model, arch, file_type), model)
        return made[key]

    return written


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Conversions go to a private cache (returned), stats nowhere, the Hub offline."""
    offline(tmp_path, monkeypatch)
    monkeypatch.delenv("CLOVER_GGUF_CACHE", raising=False)
    root = store.gguf_cache_root()
    assert root == tmp_path / "xdg" / "clover" / "gguf"
    return root


def leftovers(root: Path) -> list[str]:
    """What a failed or interrupted conversion left in the cache: anything but the content-hash index."""
    if not root.exists():
        return []
    return sorted(p.name for p in root.iterdir() if p.name != "hashes.json")


def converted_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []


def load_converted(path: Path):
    from clover_cli.loading import load

    loaded = load(path, device="cpu", dtype="float32")
    return loaded.model, loaded.tokenizer


# ------------------------------------------------------------------------------------------------ the writer itself


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_own_k_quantizers_round_trip_through_the_gguf_package(type_name):
    """The test's own K-quant packers write blocks the gguf package reads back as close to the input as the bits
    allow (a mispacked scale or nibble would be off by whole steps)."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 512)) * 0.02).astype(np.float32)
    data, qtype = encode(w, type_name)
    assert data.dtype == np.uint8 and data.shape == (8, 512 // 256 * gguf.GGML_QUANT_SIZES[qtype][1])
    back = decode(data, type_name, w.shape)
    bound = {"Q4_K": 0.06, "Q6_K": 0.02}[type_name]
    assert np.abs(back - w).max() < bound * np.abs(w).max()


CONVERSIONS = [("llama", t) for t in ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q4_K_M")] + \
              [("qwen2", t) for t in ("F32", "Q8_0", "Q4_K_M")]
# every drafter on these (~4 s each); Q4_0 and Q6_K alone only in the conversion test above
LOSSLESS = [("llama", t) for t in ("F32", "F16", "Q8_0", "Q4_1", "Q4_K")] + [("qwen2", t) for t in ("F32", "Q8_0")] + \
           [pytest.param(arch, "Q4_K_M", marks=pytest.mark.slow) for arch in ("llama", "qwen2")]
DRAFTERS = ("none", "ngram", "self", "model", "clover", "medusa", "eagle", "eagle3", "merged")
PROMPTS = ["Tell me about the quick brown fox and the lazy dog.",
           "What is the capital of France? The capital of France is"]


def make_drafter(kind: str, model, target, draft_model, seed: int):
    from clover_cli.drafters.base import NoDrafter
    from clover_cli.drafters.merged import MergedDrafter
    from clover_cli.drafters.clover2 import CloverDrafter
    from clover_cli.drafters.draft_model import ModelDrafter
    from clover_cli.drafters.eagle import EagleDrafter
    from clover_cli.drafters.eagle3 import Eagle3Drafter
    from clover_cli.drafters.medusa import MedusaDrafter
    from clover_cli.drafters.ngram import NgramDrafter
    from clover_cli.drafters.self_draft import SelfDrafter
    from test_lossless import random_heads

    if kind == "none":
        return NoDrafter()
    if kind == "ngram":
        return NgramDrafter()
    if kind == "self":
        return SelfDrafter(target, tree="mcsd", skip=[1, 2])
    if kind == "model":
        return ModelDrafter(draft_model, target)
    if kind == "merged":
        return MergedDrafter(make_drafter("clover", model, target, draft_model, seed), NgramDrafter())
    arch = {"clover": "clover2"}.get(kind, kind)
    heads = random_heads(model, arch, seed, num_heads=3, num_layers=1)
    cls = {"clover": CloverDrafter, "medusa": MedusaDrafter, "eagle": EagleDrafter, "eagle3": Eagle3Drafter}[kind]
    return cls(heads, target)


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------------------ conversion


@pytest.mark.parametrize("arch,file_type", CONVERSIONS)
def test_conversion_gives_what_the_gguf_package_dequantizes(arch, file_type, ggufs, tokenizer, cache):
    """The converted weights are exactly the file's tensors as the gguf package dequantizes them (Llama's q/k
    permutation undone); a float file gives back the very model it was written from. The tokenizer is the one
    transformers reads from the file, with no token past the file's vocabulary, and the chat template is kept."""
    from transformers import AutoTokenizer

    written = ggufs(arch, file_type)
    resolved = hub.resolve_model(str(written.path), quiet=True)
    assert resolved.gguf == written.path and converted_dirs(cache) == [resolved.path]
    assert leftovers(cache) == [resolved.path.name]
    record = gguf_model.source_of(resolved.path)
    want_types = {tensor_type(file_type, "x.output.weight", 2), tensor_type(file_type, "x.attn_q.weight", 2), "F32"}
    assert record["architecture"] == arch and set(record["tensor_types"]) == want_types

    model, tok = load_converted(resolved.path)
    assert model.config.model_type == arch and model.config.num_hidden_layers == LAYERS
    state = model.state_dict()
    for name, want in written.expected.items():
        assert torch.equal(state[name], want), name
    if file_type == "F32":
        ids = torch.tensor([chat_ids(tokenizer, PROMPTS[0])])
        with torch.no_grad():
            assert torch.allclose(model(ids).logits, written.model(ids).logits, atol=1e-5)

    # transformers adds GPT-2's <|endoftext|> to a byte-level vocabulary that lacks it, as this one (and Llama 3's)
    # does: one token past the embedding, which the conversion must not keep
    from_file = AutoTokenizer.from_pretrained(written.path.parent, gguf_file=written.path.name)
    assert len(tok) == len(tokenizer) == model.config.vocab_size
    for text in CORPUS:
        ids = tok(text)["input_ids"]
        assert ids == from_file(text)["input_ids"] and tok.decode(ids) == text
        if arch == "llama":  # its pre-tokenizer is the one the file was written from (qwen2 gets Qwen2's)
            assert ids == tokenizer(text)["input_ids"]
    assert tok.chat_template == tokenizer.chat_template
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (1, 2, 0)


# ----------------------------------------------------------------------------------------------------- losslessness


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("shared-gguf-cache")


@pytest.mark.parametrize("arch,file_type", LOSSLESS)
def test_every_drafter_is_lossless_on_a_converted_gguf(arch, file_type, ggufs, shared_cache, monkeypatch):
    """Every drafter, over two chat prompts and 24 new tokens each, gives exactly transformers' greedy `generate` on
    the converted model; the draft model is the same weights in another quantization, converted from a GGUF too."""
    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import StopCheck
    from clover_cli.target import Target

    monkeypatch.setenv("CLOVER_GGUF_CACHE", str(shared_cache))  # the draft model's conversion is shared
    model, tok = load_converted(hub.resolve_model(str(ggufs(arch, file_type).path), quiet=True).path)
    draft_type = "Q4_0" if file_type != "Q4_0" else "Q8_0"
    draft_model, _ = load_converted(hub.resolve_model(str(ggufs(arch, draft_type).path), quiet=True).path)
    target = Target(model)
    prompts = [chat_ids(tok, text) for text in PROMPTS]
    references = [hf_greedy(model, p, 24) for p in prompts]
    accepted = {}
    for i, kind in enumerate(DRAFTERS):
        engine = Engine(target, make_drafter(kind, model, target, draft_model, seed=i), budget=16, auto_budget=False)
        accepted[kind] = 0
        for prompt, reference in zip(prompts, references):
            out, events = run_engine(engine, prompt, StopCheck(24))
            assert out == reference, (kind, prompt)
            accepted[kind] += sum(e.accepted for e in events)
    assert accepted["model"] > 12 and accepted["ngram"] > 0, accepted  # deep paths were verified


# ------------------------------------------------------------------------------------------------- the command line


def test_generate_converts_a_gguf_once(run_cli, ggufs, cache, tmp_path):
    """`clover generate FILE.gguf` converts it once, saying so in one line; a second run, a copy of the file in a
    folder (the same content) and other drafters convert nothing and give the same text; `--draft model` takes a GGUF
    draft model, converted once too."""
    target, draft = ggufs("llama", "Q4_K_M"), ggufs("llama", "Q4_0")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPTS[0])
    common = ("-f", str(prompt), "-n", "24", "--stats-file", "off")

    code, text, err = run_cli("generate", str(target.path), *common, "--draft", "none")
    assert code == 0, err
    lines = err.splitlines()
    assert lines[0].startswith(f"clover: converting {target.path.name} (llama, Q4_K/") and "cached in" in lines[0]
    assert lines[1].startswith("clover: converted in ") and len(text) > 10
    [converted] = converted_dirs(cache)
    stamps = {p.name: p.stat().st_mtime_ns for p in converted.iterdir()}

    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(target.path, folder / "model.gguf")
    for model, drafter in ((target.path, "none"), (target.path, "ngram"), (folder, "none"),
                           (folder / "model.gguf", "auto")):
        code, out, err = run_cli("generate", str(model), *common, "--draft", drafter)
        assert code == 0, err
        assert "convert" not in err and out == text, (model, drafter, err)
    assert converted_dirs(cache) == [converted]
    assert {p.name: p.stat().st_mtime_ns for p in converted.iterdir()} == stamps

    for again in (False, True):
        code, out, err = run_cli("generate", str(target.path), *common, "--draft", "model", "--draft-model",
                                 str(draft.path))
        assert code == 0, err
        assert out == text and " · model · " in err
        assert ("converting " + draft.path.name in err) != again and target.path.name not in err, err
    assert len(converted_dirs(cache)) == 2 and converted in converted_dirs(cache)


# ------------------------------------------------------------------------------------------------------- bad input


def one_line_error(result, *needles, code=2):
    """One `clover: error:` line, last, holding `needles`; before it at most the line saying a conversion began."""
    rc, out, err = result
    assert rc == code, result
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("clover: error: "), err
    assert all(line.startswith("clover: converting ") for line in lines[:-1]) and len(lines) <= 2, err
    for needle in needles:
        assert needle.lower() in lines[-1].lower(), (needle, lines[-1])
    return lines[-1]


def bad_input(case: str, tmp_path: Path, ggufs, tokenizer) -> tuple[Path, tuple[str, ...]]:
    """(the path to run, what its error line must say)."""
    good = ggufs("llama", "Q8_0")
    path = tmp_path / "bad.gguf"
    if case == "truncated":
        data = good.path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
        return path, ("truncated",)
    if case == "truncated-header":
        path.write_bytes(good.path.read_bytes()[:4000])  # cut inside the vocabulary
        return path, ("truncated",)
    if case == "unsupported-architecture":
        write_gguf(path, tokenizer, good.model, architecture="rwkv6")
        return path, ("rwkv6", "architecture")
    if case == "text":
        path = tmp_path / "x.gguf"
        path.write_text("This is not a model.\n")
        return path, ("not a GGUF",)
    if case == "two-ggufs":
        folder = tmp_path / "two"
        folder.mkdir()
        for name in ("a.gguf", "b.gguf"):
            shutil.copy(good.path, folder / name)
        return folder, ("2 GGUF files", "a.gguf", "b.gguf", "name one")
    if case == "missing":
        return tmp_path / "absent.gguf", ("no such file",)
    if case == "missing-tensor":
        write_gguf(path, tokenizer, good.model, drop_tensors=("blk.1.ffn_up.weight",))
        return path, ("damaged", "1 weights", "model.layers.1.mlp.up_proj.weight")
    if case == "too-few-layers":  # the tensors of layers 2 and 3 would be left out
        write_gguf(path, tokenizer, good.model, metadata={"block_count": 2})
        return path, ("damaged", "llama.block_count", "2 layers", "hold 4")
    if case == "no-layer-count":  # llama's default, 32 layers: 28 of them random
        write_gguf(path, tokenizer, good.model, metadata={"block_count": None})
        return path, ("damaged", "llama.block_count", "32 layers", "hold 4")
    raise ValueError(case)


BAD = ["truncated", "truncated-header", "unsupported-architecture", "text", "two-ggufs", "missing",
       "missing-tensor", "too-few-layers", "no-layer-count"]


@pytest.mark.parametrize("case", BAD)
def test_bad_ggufs_fail_in_one_line_and_leave_nothing(case, run_cli, ggufs, tokenizer, cache, tmp_path):
    path, needles = bad_input(case, tmp_path, ggufs, tokenizer)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Hello")
    one_line_error(run_cli("generate", str(path), "-f", str(prompt), "-n", "4", "--stats-file", "off"),
                   *needles)
    assert leftovers(cache) == []
    if case in ("text", "two-ggufs", "missing"):  # told before the file is read for its hash: nothing written
        assert not cache.exists()
    with pytest.raises(CloverError):  # and through the API, the same
        hub.resolve_model(str(path), quiet=True)
    assert leftovers(cache) == []


@pytest.mark.parametrize("arch,reads", [("qwen2moe", True), ("qwen3moe", True), ("gpt-oss", True), ("qwen35", True),
                                        ("gemma3", True), ("rwkv6", False), ("general", False), ("tokenizer", False)])
def test_which_architectures_are_taken(arch, reads, tmp_path):
    """The architectures transformers reads from GGUF, under llama.cpp's names (qwen2moe is transformers' qwen2_moe,
    qwen35 is read by its newer loader); the sections of its config mapping are no architectures."""
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if reads:
        assert gguf_model.inspect(path).architecture == arch
    else:
        with pytest.raises(CloverError, match=f"holds a {arch} model, an architecture transformers cannot read") as e:
            gguf_model.inspect(path)
        assert "general" not in str(e.value).split("(it reads")[1] and "\n" not in str(e.value)


def test_an_interrupted_conversion_leaves_nothing_and_the_next_one_succeeds(ggufs, cache, monkeypatch):
    written = ggufs("llama", "Q4_1")
    real = gguf_model._write_converted

    def interrupted(info, sha, dtype, tmp, quiet):
        tmp.mkdir(parents=True)
        (tmp / "model.safetensors").write_bytes(b"half a model")
        (tmp / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_model, "_write_converted", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hub.resolve_model(str(written.path), quiet=True)
    assert leftovers(cache) == []

    def failing(info, sha, dtype, tmp, quiet):
        real(info, sha, dtype, tmp, quiet)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_model, "_write_converted", failing)
    with pytest.raises(CloverError, match="No space left on device"):
        hub.resolve_model(str(written.path), quiet=True)
    assert leftovers(cache) == []

    monkeypatch.setattr(gguf_model, "_write_converted", real)
    resolved = hub.resolve_model(str(written.path), quiet=True)
    assert converted_dirs(cache) == [resolved.path] and gguf_model.is_converted(resolved.path)
    assert leftovers(cache) == [resolved.path.name]


def test_a_killed_conversions_leftovers_are_removed_and_a_damaged_one_rebuilt(ggufs, cache):
    """A temporary directory a killed converter left (its pid gone) goes at the next conversion; a converted
    directory that lost its weights, or that an older converter made, is converted again."""
    written = ggufs("llama", "Q4_1")
    out = store.converted_dir(store.content_hash(written.path), "float32")
    stale = out.with_name(f".{out.name}.clover-999999999.tmp")
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    resolved = hub.resolve_model(str(written.path), quiet=True)
    assert resolved.path == out and not stale.exists() and leftovers(cache) == [out.name]
    for f in out.glob("*.safetensors"):
        f.unlink()
    assert not gguf_model.is_converted(out)
    assert hub.resolve_model(str(written.path), quiet=True).path == out and gguf_model.is_converted(out)
    assert leftovers(cache) == [out.name]
    record = out / gguf_model.SOURCE_FILE  # an older converter's directory is converted again
    record.write_text(json.dumps({**json.loads(record.read_text()), "converter": gguf_model.CONVERTER - 1}))
    assert not gguf_model.is_converted(out)
    assert hub.resolve_model(str(written.path), quiet=True).path == out and gguf_model.is_converted(out)
    assert leftovers(cache) == [out.name]


# ------------------------------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def real_smollm2(tmp_path_factory):
    """The real file converted once for the tests below, into a private offline cache: (its converted directory, the
    cache root, the conversions found there)."""
    if not REAL_SMOLLM2.is_file():
        pytest.skip("SmolLM2's GGUF is not on this machine (set CLOVER_SMOLLM2_GGUF to a copy)")
    if store.content_hash(REAL_SMOLLM2) != SMOLLM2_PACKAGE.sha256:
        pytest.skip(f"{REAL_SMOLLM2} is not the pinned SmolLM2 file (a partial or other copy)")
    with pytest.MonkeyPatch.context() as monkeypatch:
        offline(tmp_path_factory.mktemp("real-smollm2"), monkeypatch)
        monkeypatch.delenv("CLOVER_GGUF_CACHE", raising=False)
        root = store.gguf_cache_root()
        resolved = hub.resolve_model(str(REAL_SMOLLM2), quiet=True)
        assert resolved.gguf == REAL_SMOLLM2
        return resolved.path, root, converted_dirs(root)


@pytest.mark.slow
def test_real_smollm2_gguf_is_lossless(real_smollm2, cache):
    """The real SmolLM2-135M-Instruct Q4_1 file: converted, its chat template applied, n-gram and plain decoding and
    the Clover-2 heads the package ships for it (found for the alias offline; alone and as the default drafter,
    merged with n-gram) give exactly transformers' greedy output over 32 tokens of two chat prompts, the heads'
    drafts accepted."""
    from clover_cli.drafters import registry
    from clover_cli.drafters.base import NoDrafter
    from clover_cli.drafters.factory import make_drafter
    from clover_cli.drafters.ngram import NgramDrafter
    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import StopCheck
    from clover_cli.target import Target

    path, _, converted = real_smollm2
    assert converted == [path]
    record = gguf_model.source_of(path)
    assert record["architecture"] == "llama" and "Q4_1" in record["tensor_types"]
    model, tok = load_converted(path)
    target = Target(model)
    for text in ("What is the capital of France?", "Write a Python function that adds two numbers."):
        prompt = chat_ids(tok, text)
        reference = hf_greedy(model, prompt, 32)
        assert len(set(reference)) > 4  # real text, not one token repeated
        for drafter in (NoDrafter(), NgramDrafter()):
            out, _ = run_engine(Engine(target, drafter, budget=16, auto_budget=False), prompt, StopCheck(32))
            assert out == reference, (drafter, text)
        alias = hub.ResolvedModel("smollm2", path, aliases.ALIASES["smollm2"])
        shipped = registry.resolve_heads(None, alias)
        assert shipped == aliases.bundled_heads("smollm2")
        heads = registry.load(shipped, model)
        for name in ("clover", "auto"):
            drafter = make_drafter(name, target, heads=heads)
            out, events = run_engine(Engine(target, drafter, budget=16, auto_budget=False), prompt, StopCheck(32))
            assert out == reference, (name, text)
            if name == "clover":
                assert sum(e.accepted for e in events) > 0, text  # its drafts, not only the target's tokens


@pytest.mark.slow
def test_real_smollm2_heads_sample_the_targets_distribution(real_smollm2, cache):
    """Sampling at temperature 0.7, top-p 0.9 and the model's repetition penalty 1.1 with the Clover-2 heads the
    package ships for smollm2, on a real chat prompt: the first two tokens' joint distribution equals the target's own, computed exactly
    (every first token of the top-p set, then every second token after it), within a TV bound that exact sampling
    meets; no pair outside the target's support is ever drawn, and the heads' drafts are accepted."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from clover_cli.drafters import registry
    from clover_cli.drafters.factory import make_drafter
    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import Sampling, StopCheck, warp
    from clover_cli.target import Target
    from test_engine import _null_tv_bound, _tv

    path = real_smollm2[0]
    model, tok = load_converted(path)
    s = Sampling(0.7, 0.9, repetition_penalty=1.1)
    # the reply begun as "My favourite colour": its next token is all but certain (" is"), the colour after it open
    # (dozens of tokens above top-p's cut): the position where the heads' drafts are taken or refused
    prompt = chat_ids(tok, "Name a colour.") + tok("My favourite colour", add_special_tokens=False)["input_ids"]
    processor = RepetitionPenaltyLogitsProcessor(1.1)

    @torch.no_grad()
    def probs(ids):
        logits = model(torch.tensor([ids])).logits[:, -1].float()
        return warp(processor(torch.tensor([ids]), logits)[0], s)

    p1 = probs(prompt)
    pairs, exact = [], []
    for a in p1.nonzero().flatten().tolist():
        p2 = probs(prompt + [a])
        for b in p2.nonzero().flatten().tolist():
            pairs.append((a, b))
            exact.append(float(p1[a] * p2[b]))
    exact = np.array(exact) / sum(exact)
    assert 4 <= len(pairs) <= 5000  # a real spread of continuations, few enough to count
    index = {p: i for i, p in enumerate(pairs)}

    alias = hub.ResolvedModel("smollm2", path, aliases.ALIASES["smollm2"])
    target = Target(model)
    drafter = make_drafter("clover", target, heads=registry.load(registry.resolve_heads(None, alias), model))
    engine = Engine(target, drafter, budget=8, auto_budget=False)
    n = 600
    counts, outside, accepted = np.zeros(len(pairs)), 0, 0
    for i in range(n):  # three tokens: the second can then come from a draft (the last one never does)
        out, events = run_engine(engine, prompt, StopCheck(3), Sampling(0.7, 0.9, seed=i, repetition_penalty=1.1))
        if (out[0], out[1]) in index:
            counts[index[(out[0], out[1])]] += 1
        else:
            outside += 1
        accepted += sum(e.accepted for e in events)
    assert outside == 0
    assert accepted > n * 0.1  # the heads' drafts were taken, not only the target's own tokens
    assert _tv(counts, exact) < _null_tv_bound(exact, n, np.random.default_rng(1))
