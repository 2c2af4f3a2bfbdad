"""llama.cpp as a bench peer: the GGUF writer (names, shapes, the rotary permutation, the cache), the skip note and
the one-line error when llama-cpp-python is missing or the model is unsupported, and — where llama-cpp-python is
installed — identical greedy output."""

from __future__ import annotations

import json
import os
import sys
import types

import numpy as np
import pytest
import torch

from conftest import small_draft


def importable(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """clover's cache (where the GGUF goes) inside the test's directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "clover"


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, llama_dir):
    """A one-layer Llama draft with the target's tokenizer (clover bench --draft-model)."""
    return small_draft(tmp_path_factory.mktemp("draft"), llama_dir)


@pytest.fixture
def without_llama_cpp(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    """An importable stand-in, for the checks that come after the import (they never run it)."""
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))


# ------------------------------------------------------------------------------------------------ availability

def test_missing_llama_cpp_skips_the_rows_with_one_note(llama_dir, prompts_file, run_cli, without_llama_cpp):
    code, out, err = run_cli("bench", str(llama_dir), "--prompts", str(prompts_file), "-n", "4", "--json")
    assert code == 0, err
    assert [r["method"] for r in json.loads(out)["methods"]] == ["hf", "hf-lookup", "plain", "ngram"]
    assert err.count("\n") == 1 and "llama-cpp-python is not installed" in err and "clover-cli[llama]" in err, err


@pytest.mark.parametrize("method", ["llama.cpp", "llama.cpp-lookup", "llama.cpp-draft"])
def test_asking_for_llama_cpp_without_it_is_a_one_line_error(llama_dir, draft_dir, prompts_file, run_cli,
                                                             without_llama_cpp, method):
    code, out, err = run_cli("bench", str(llama_dir), "--prompts", str(prompts_file), "--methods", f"hf,{method}",
                             "--draft-model", str(draft_dir))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"{method} cannot run" in err and "clover-cli[llama]" in err and "Traceback" not in err


def test_llama_cpp_rows_are_greedy_only(llama_dir, prompts_file, run_cli):
    code, out, err = run_cli("bench", str(llama_dir), "--prompts", str(prompts_file), "--methods", "llama.cpp",
                             "--temperature", "0.7")
    assert code == 2 and err.count("\n") == 1 and "greedy only" in err, err


@pytest.mark.skipif(not importable("gguf"), reason="gguf is not installed")
def test_unsupported_architecture(models_dir, prompts_file, run_cli, fake_llama_cpp):
    qwen = str(models_dir["qwen2"])
    code, out, err = run_cli("bench", qwen, "--prompts", str(prompts_file), "--methods", "llama.cpp")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "Llama-architecture" in err and "qwen2" in err
    code, out, err = run_cli("bench", qwen, "--prompts", str(prompts_file), "-n", "2", "--limit", "1", "--json")
    assert code == 0, err
    assert not any(r["method"].startswith("llama.cpp") for r in json.loads(out)["methods"])
    assert err.count("\n") == 1 and "no llama.cpp rows" in err and "qwen2" in err, err


def test_llama_cpp_draft_needs_a_draft_model(llama_dir, prompts_file, run_cli):
    code, out, err = run_cli("bench", str(llama_dir), "--prompts", str(prompts_file), "--methods", "llama.cpp-draft")
    assert code == 2 and out == "" and err.count("\n") == 1 and "--draft-model" in err, err


@pytest.mark.skipif(not importable("gguf"), reason="gguf is not installed")
def test_llama_cpp_draft_needs_a_llama_draft(llama_dir, prompts_file, run_cli, fake_llama_cpp, tmp_path):
    other = small_draft(tmp_path / "mistral-draft", llama_dir, family="mistral")
    code, out, err = run_cli("bench", str(llama_dir), "--prompts", str(prompts_file), "--methods",
                             "llama.cpp,llama.cpp-draft", "--draft-model", str(other))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "llama.cpp-draft cannot run: the draft model" in err and "mistral" in err, err


@pytest.mark.skipif(not importable("gguf"), reason="gguf is not installed")
@pytest.mark.parametrize("args,says", [(["--dtype", "bfloat16"], "runs bf16 weights"),
                                       (["--quantize", "int8"], "runs int8 weights")])
def test_only_float32_on_the_cpu(llama_dir, prompts_file, run_cli, fake_llama_cpp, args, says):
    """The GGUF llama.cpp runs is written from the float32 model's parameters: weights clover runs in another format
    (bfloat16, quantized) are refused in one line, not written half."""
    code, out, err = run_cli("bench", str(llama_dir), "--prompts", str(prompts_file), "--methods", "llama.cpp", *args)
    assert code == 2 and err.count("\n") == 1 and says in err and "--dtype float32" in err, err


def test_unsupported_configs_are_named():
    from transformers import LlamaConfig

    from clover_cli.llamacpp import unsupported_model

    assert unsupported_model(LlamaConfig()) is None
    assert "biases" in unsupported_model(LlamaConfig(attention_bias=True))
    assert "llama3" in unsupported_model(LlamaConfig(rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                                                      "rope_theta": 5e5, "low_freq_factor": 1.0,
                                                                      "high_freq_factor": 4.0,
                                                                      "original_max_position_embeddings": 8192}))


# ------------------------------------------------------------------------------------------------ the GGUF

def rope_half(x, pos, theta=10000.0):
    """Hugging Face's rotary embedding: dimension i turns with dimension i + d/2."""
    d = x.shape[-1]
    angle = pos * theta ** (-np.arange(d // 2) * 2 / d)
    a, b = x[: d // 2], x[d // 2:]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)])


def rope_pairs(x, pos, theta=10000.0):
    """llama.cpp's rotary embedding for Llama: dimension 2i turns with 2i + 1."""
    d = x.shape[-1]
    angle = pos * theta ** (-np.arange(d // 2) * 2 / d)
    a, b = x[0::2], x[1::2]
    out = np.empty_like(x)
    out[0::2], out[1::2] = a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)
    return out


def test_rotary_permutation_keeps_attention_scores():
    """q·k after each side's own rotary embedding is the same for the permuted weights, at every distance."""
    from clover_cli.llamacpp import interleaved_to_rotary, rotary_to_interleaved

    rng = np.random.default_rng(0)
    n_heads, n_kv, d, hidden = 4, 2, 16, 32
    wq, wk = rng.standard_normal((n_heads * d, hidden)), rng.standard_normal((n_kv * d, hidden))
    gq, gk = rotary_to_interleaved(wq, n_heads), rotary_to_interleaved(wk, n_kv)
    assert not np.array_equal(gq, wq)
    np.testing.assert_array_equal(interleaved_to_rotary(gq, n_heads), wq)
    np.testing.assert_array_equal(interleaved_to_rotary(gk, n_kv), wk)
    x, y = rng.standard_normal(hidden), rng.standard_normal(hidden)
    for head in range(n_heads):
        kv = head // (n_heads // n_kv)
        rows_q, rows_k = slice(head * d, (head + 1) * d), slice(kv * d, (kv + 1) * d)
        for pq, pk in [(0, 0), (5, 2), (37, 11)]:
            hf = rope_half(wq[rows_q] @ x, pq) @ rope_half(wk[rows_k] @ y, pk)
            cpp = rope_pairs(gq[rows_q] @ x, pq) @ rope_pairs(gk[rows_k] @ y, pk)
            assert hf == pytest.approx(cpp, rel=1e-9)
            unpermuted = rope_pairs(wq[rows_q] @ x, pq) @ rope_pairs(wk[rows_k] @ y, pk)
            if pq != pk:
                assert hf != pytest.approx(unpermuted, rel=1e-6)  # the permutation is needed


@pytest.fixture(scope="module")
def llama_model(llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(llama_dir), AutoTokenizer.from_pretrained(llama_dir)


def test_gguf_reads_back(llama_model, tmp_path):
    gguf = pytest.importorskip("gguf")
    from clover_cli.llamacpp import interleaved_to_rotary, write_gguf

    model, tok = llama_model
    cfg = model.config
    path = tmp_path / "m.gguf"
    write_gguf(model, tok, path, "test")
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # no temporary file left behind
    reader = gguf.GGUFReader(path)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "llama"
    assert field("llama.block_count") == cfg.num_hidden_layers
    assert field("llama.attention.head_count") == cfg.num_attention_heads
    assert field("llama.attention.head_count_kv") == cfg.num_key_value_heads
    assert field("llama.rope.dimension_count") == cfg.hidden_size // cfg.num_attention_heads
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.eos_token_id") == tok.eos_token_id
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == cfg.vocab_size and tokens[tok.eos_token_id] == "</s>"
    assert tokens[tok.convert_tokens_to_ids("Ġfox")] == "Ġfox"
    assert field("tokenizer.chat_template") == tok.chat_template  # the file chats as the model does
    other = tmp_path / "other"
    other.mkdir()
    saved, tok.chat_template = tok.chat_template, None
    try:
        write_gguf(model, tok, other / "m.gguf", "test")
    finally:
        tok.chat_template = saved
    assert "tokenizer.chat_template" not in gguf.GGUFReader(other / "m.gguf").fields

    tensors = {t.name: t for t in reader.tensors}
    per_block = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down"]
    assert set(tensors) == {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(cfg.num_hidden_layers) for n in per_block}
    params = dict(model.named_parameters())
    for hf_name, gguf_name in [("model.embed_tokens.weight", "token_embd.weight"), ("lm_head.weight", "output.weight"),
                               ("model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight"),
                               ("model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight"),
                               ("model.layers.0.self_attn.v_proj.weight", "blk.0.attn_v.weight")]:
        t = tensors[gguf_name]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32 and t.data.dtype == np.float32
        np.testing.assert_array_equal(t.data, params[hf_name].detach().numpy())
    for proj, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads)):
        stored, hf = tensors[f"blk.1.attn_{proj}.weight"].data, params[f"model.layers.1.self_attn.{proj}_proj.weight"]
        assert list(tensors[f"blk.1.attn_{proj}.weight"].shape) == list(hf.shape[::-1])  # GGUF lists dims inner first
        assert not np.array_equal(stored, hf.detach().numpy())
        np.testing.assert_array_equal(interleaved_to_rotary(np.array(stored), heads), hf.detach().numpy())


def test_gguf_is_cached_and_rewritten_when_the_weights_change(llama_model, llama_dir, tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from clover_cli import llamacpp
    from clover_cli.errors import CloverError
    from clover_cli.hub import ResolvedModel

    model, tok = llama_model
    resolved = ResolvedModel(name="some/model", path=llama_dir, spec=None)
    first = llamacpp.gguf_for(resolved, model, tok, tmp_path, quiet=True)
    assert first.is_file() and first.parent == tmp_path / "gguf" and first.name.startswith("some-model-")
    write = llamacpp.write_gguf
    monkeypatch.setattr(llamacpp, "write_gguf", lambda *a: pytest.fail("the cached GGUF was written again"))
    assert llamacpp.gguf_for(resolved, model, tok, tmp_path, quiet=True) == first
    monkeypatch.setattr(llamacpp, "write_gguf", write)
    weights = llama_dir / "model.safetensors"
    stat = weights.stat()
    try:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        second = llamacpp.gguf_for(resolved, model, tok, tmp_path, quiet=True)
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert second != first and list((tmp_path / "gguf").iterdir()) == [second]  # the stale one is gone
    (tmp_path / "blocked").write_text("")
    with pytest.raises(CloverError, match="cannot write the GGUF"):
        llamacpp.gguf_for(resolved, model, tok, tmp_path / "blocked", quiet=True)


# ------------------------------------------------------------------------------------------------ running it

@pytest.mark.skipif(not (importable("llama_cpp") and importable("gguf")), reason="llama-cpp-python is not installed")
def test_llama_cpp_rows_match_hf_greedy(llama_dir, prompts_file, run_cli, cache_home):
    args = ("bench", str(llama_dir), "--prompts", str(prompts_file), "-n", "24", "--json", "--methods",
            "hf,llama.cpp,llama.cpp-lookup")
    code, out, err = run_cli(*args)
    assert code == 0, err
    report = json.loads(out)
    rows = {r["method"]: r for r in report["methods"]}
    for name in ("llama.cpp", "llama.cpp-lookup"):
        assert rows[name]["identical"] is True and rows[name]["new_tokens"] == 3 * 24, rows[name]
        assert rows[name]["tokens_per_s"] > 0
    peer = report["llama_cpp"]
    assert peer["threads"] == torch.get_num_threads() and peer["lookup_tokens"] == 10
    (gguf,) = (cache_home / "gguf").iterdir()
    assert peer["gguf"] == str(gguf)
    mtime = gguf.stat().st_mtime_ns
    code, out, err = run_cli(*args[:-1], "hf,llama.cpp")
    assert code == 0 and json.loads(out)["methods"][1]["identical"] is True, err
    assert list((cache_home / "gguf").iterdir()) == [gguf] and gguf.stat().st_mtime_ns == mtime  # not rewritten


@pytest.mark.skipif(not (importable("llama_cpp") and importable("gguf")), reason="llama-cpp-python is not installed")
def test_llama_cpp_draft_row_matches_hf_greedy(llama_dir, draft_dir, prompts_file, run_cli, cache_home):
    code, out, err = run_cli("bench", str(llama_dir), "--prompts", str(prompts_file), "-n", "24", "--json",
                             "--methods", "hf,model-chain,llama.cpp-draft", "--draft-model", str(draft_dir))
    assert code == 0, err
    report = json.loads(out)
    row = {r["method"]: r for r in report["methods"]}["llama.cpp-draft"]
    assert row["identical"] is True and row["new_tokens"] == 3 * 24 and row["tokens_per_s"] > 0, row
    peer = report["llama_cpp"]
    assert peer["draft_tokens"] == 8 and peer["draft_gguf"] != peer["gguf"]
    assert sorted(p.name for p in (cache_home / "gguf").iterdir()) == sorted(
        os.path.basename(peer[k]) for k in ("gguf", "draft_gguf"))


@pytest.mark.skipif(not (importable("llama_cpp") and importable("gguf")), reason="llama-cpp-python is not installed")
def test_draft_chain_is_the_drafts_greedy_continuation(llama_model, tmp_path):
    """The draft hook with the target itself as the draft: each call returns the target's own greedy continuation
    of what it is given, whether that extends, repeats or departs from the previous call's tokens."""
    import llama_cpp

    from clover_cli.llamacpp import DraftChain, _context, write_gguf
    from helpers import hf_greedy

    model, tok = llama_model
    write_gguf(model, tok, tmp_path / "m.gguf", "test")
    chain = DraftChain(_context(llama_cpp, tmp_path / "m.gguf", 128, 1, 16, True), tokens=5)
    ids = tok("The quick brown fox jumps over the lazy dog. The quick", add_special_tokens=False)["input_ids"]
    calls = [ids, ids + hf_greedy(model, ids, 3), ids[:7], ids[:7] + [(ids[7] + 1) % len(tok)], ids]
    for given in calls:
        drafted = chain(np.array(given, dtype=np.intc))
        assert drafted.dtype == np.intc and drafted.tolist() == hf_greedy(model, given, 5), given


@pytest.mark.skipif(not (importable("llama_cpp") and importable("gguf")), reason="llama-cpp-python is not installed")
@pytest.mark.parametrize("lookup", [0, 10])
def test_runner_stops_at_eos_and_after_max_tokens(llama_model, tmp_path, lookup):
    from clover_cli.llamacpp import LlamaCppRunner, write_gguf

    model, tok = llama_model
    write_gguf(model, tok, tmp_path / "m.gguf", "test")
    # prompt + reply longer than a batch (a draft of 10 and its root still fit in one)
    runner = LlamaCppRunner(tmp_path / "m.gguf", n_ctx=128, threads=1, lookup_tokens=lookup, n_batch=16)
    ids = tok("The quick brown fox jumps over the lazy dog. The quick", add_special_tokens=False)["input_ids"]
    assert len(ids) + 12 > 16
    new, decode_s, total_s = runner.generate(ids, 12, eos_ids={tok.eos_token_id})
    assert len(new) == 12 and 0 < decode_s <= total_s
    stop = new[5]
    cut, _, _ = runner.generate(ids, 12, eos_ids={stop})
    assert cut == new[:new.index(stop) + 1]  # the run ends on the first EOS, which it keeps


def test_binaries_script_needs_the_built_binaries(tmp_path):
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "llamacpp_binaries.py"
    p = subprocess.run([sys.executable, str(script), "--bin", str(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and "no llama-lookup in" in p.stderr and "build it first" in p.stderr, p.stderr
