"""Issue #45 items 9, 10 and 16: a model, heads or data gone wrong end in one line that names the real problem, and
draft heads that compute garbage never stop a reply (the target verifies every token)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from test_reliability import TRAIN, isolated, one_line_error  # noqa: F401 (isolated: an autouse fixture)

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "clover_cli" / "bundled" / "tiny"


@pytest.fixture
def prompt(tmp_path) -> Path:
    p = tmp_path / "prompt.txt"
    p.write_text("Hello there, how are you?")
    return p


def copy_tiny(tmp_path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(TINY, out, ignore=shutil.ignore_patterns("heads", "draft"))
    return out


# --- 9. a tokenizer with more tokens than the model embeds ------------------------------------------------------


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_in_one_line(run_cli, tmp_path, prompt):
    """Tokens past the model's embedding: a prompt holding one is refused when it is encoded (a tokenizer merely
    larger still loads: transformers adds such a token to some, unused); a special token past it, at load."""
    from transformers import AutoTokenizer

    model = copy_tiny(tmp_path, "big-tokenizer")
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_tokens([f"zzqx{i}" for i in range(20)])
    tok.save_pretrained(model)
    prompt.write_text("hello zzqx3 there")  # a token the model has no embedding for
    one_line_error(run_cli("generate", str(model), "-f", str(prompt), "-n", "4"), "'zzqx3'", "8212 tokens",
                   "embeds only 8192")
    prompt.write_text("hello there")  # none of them: the model runs
    code, _, err = run_cli("generate", str(model), "-f", str(prompt), "-n", "4")
    assert code == 0, err
    tok.add_special_tokens({"additional_special_tokens": ["<zzqx-special>"]})
    tok.chat_template = "<zzqx-special>{% for m in messages %}{{ m['content'] }}{% endfor %}"  # in every prompt
    tok.save_pretrained(model)
    one_line_error(run_cli("generate", str(model), "-f", str(prompt), "-n", "4", "--raw"), "chat template writes",
                   "<zzqx-special>", "embeds only 8192")  # at load: not even a raw prompt gets through


# --- 10. heads whose weights are NaN ----------------------------------------------------------------------------


@pytest.fixture
def nan_heads(tmp_path) -> Path:
    from safetensors.torch import load_file, save_file

    out = tmp_path / "nan-heads"
    shutil.copytree(TINY / "heads", out)
    state = load_file(out / "model.safetensors")
    save_file({k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in state.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("draft", ["clover", "auto"])
@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_heads_that_compute_nan_never_stop_a_reply(run_cli, nan_heads, prompt, draft, temperature):
    args = ("-f", str(prompt), "-n", "24", "--temperature", temperature, "--seed", "5", "--json")
    code, out, err = run_cli("generate", "tiny", "--heads", str(nan_heads), "--draft", draft, *args)
    assert code == 0, err
    if temperature != "0":  # sampled: an exact sample of the target, not the same draws as plain decoding's
        assert json.loads(out)["new_tokens"] == 24
        return
    code, plain, err = run_cli("generate", "tiny", "--draft", "none", *args)
    assert code == 0, err
    assert json.loads(out)["text"] == json.loads(plain)["text"]  # the target's own reply


def test_a_chat_with_nan_heads_answers_every_message(run_cli, nan_heads):
    code, out, err = run_cli("chat", "tiny", "--heads", str(nan_heads), "-n", "8", stdin="hi\nhow are you?\n")
    assert code == 0, err
    assert "error" not in err.lower(), err


# --- 16. messages that named the wrong problem ------------------------------------------------------------------


def test_8bit_on_the_cpu_runs_or_blames_the_quantization_not_the_architecture(run_cli, prompt):
    pytest.importorskip("bitsandbytes")
    args = ("-f", str(prompt), "-n", "16", "--json", "--load-in-8bit", "--device", "cpu")
    code, out, err = run_cli("generate", "tiny", *args)
    if code != 0:  # a bitsandbytes that cannot quantize here is refused before loading, in its own words
        assert "llama models" not in err and "cannot run" in err and "bit" in err, err
        return
    code, plain, err = run_cli("generate", "tiny", "--draft", "none", *args)
    assert code == 0, err
    assert json.loads(out)["text"] == json.loads(plain)["text"]


def test_weights_that_do_not_fit_the_config_are_named(run_cli, tmp_path, prompt):
    model = copy_tiny(tmp_path, "wrong-vocab")
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = 8000
    (model / "config.json").write_text(json.dumps(config))
    error = one_line_error(run_cli("generate", str(model), "-f", str(prompt)), "embed_tokens.weight",
                           "[8192, 256]", "[8000, 256]")
    assert "report" not in error


def test_a_missing_tokenizer_is_said_in_a_whole_sentence(run_cli, tmp_path, prompt):
    model = copy_tiny(tmp_path, "no-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    error = one_line_error(run_cli("generate", str(model), "-f", str(prompt)), "tokenizer", "holds none of")
    assert not error.rstrip().endswith(":"), error
    (model / "tokenizer_config.json").write_text((TINY / "tokenizer_config.json").read_text())
    error = one_line_error(run_cli("generate", str(model), "-f", str(prompt)), "tokenizer")
    assert not error.rstrip().endswith(":") and "(1)" in error, error  # the sentence goes on past its colon


def _conversations(n: int, reply_words: int = 6) -> list[dict]:
    return [{"id": f"m{i}", "conversations": [
        {"from": "human", "value": f"Say something about the number {i}, please, in a few words."},
        {"from": "gpt", "value": " ".join(["number"] * reply_words)}]} for i in range(n)]


def test_train_with_nothing_held_out_says_so(run_cli, llama_dir, tmp_path):
    from clover_cli.data import is_heldout

    rows = [c for c in _conversations(200) if not is_heldout(c["id"])][:12]  # not one of them held out
    data = tmp_path / "train-only.json"
    data.write_text(json.dumps(rows))
    out = tmp_path / "heads"
    code, _, err = run_cli("train", str(llama_dir), "--data", str(data), "--out", str(out), "--max-steps", "2", *TRAIN)
    assert code == 0, err
    assert "held-out τ 0.0" not in err and "nothing held out" in err, err
    saved = json.loads((out / "config.json").read_text())
    assert saved["training"]["heldout_tau"] is None


def test_train_whose_turns_start_past_max_len_names_max_len(run_cli, llama_dir, tmp_path):
    data = tmp_path / "long.json"
    data.write_text(json.dumps(_conversations(12)))
    args = [a for a in TRAIN]
    args[args.index("--max-len") + 1] = "16"  # shorter than the template and the first user turn
    result = run_cli("train", str(llama_dir), "--data", str(data), "--out", str(tmp_path / "h"), "--max-steps", "2",
                     *args)
    one_line_error(result, "--max-len 16", alone=False)


def test_a_quantized_target_that_differs_blames_the_quantization(llama_dir):
    """check_exact's refusal of a quantized target names the quantization and the flags, not the architecture (the
    branch an 8-bit CPU run took before its tolerance was the quantized one)."""
    from transformers import AutoModelForCausalLM

    from clover_cli.errors import CloverError
    from clover_cli.target import Target, check_exact

    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    target = Target(model)
    check_exact(target)  # float32, not quantized: exact
    model.hf_quantizer = object()  # what transformers sets on a model it quantized
    with pytest.raises(CloverError) as e:
        check_exact(target, tolerance=-1.0)  # any difference at all is too much
    assert "quantized" in str(e.value) and "--load-in-8bit" in str(e.value) and "llama models" not in str(e.value)
