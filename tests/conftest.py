"""Shared fixtures: tiny random models (Llama, Mistral, Qwen2) with a real byte-level BPE tokenizer, built here."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernels run through Triton's interpreter. Triton reads this when a kernel is decorated,
# and transformers/torch may import triton during collection, so it must be set before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# No test builds a compiled step unless it asks for one (tests/test_compiled.py), and none writes packages or
# measured step costs into the user's cache.
os.environ.setdefault("CLOVER_COMPILE", "off")
os.environ.setdefault("CLOVER_COMPILE_CACHE", tempfile.mkdtemp(prefix="clover-compiled-"))
# clover's C++ kernels (the CPU's quantized linears) built once for every test and worker: keyed by their source,
# torch and the CPU, so a directory shared between runs only saves builds
os.environ.setdefault("CLOVER_KERNEL_CACHE", str(Path(tempfile.gettempdir()) / f"clover-test-kernels-{os.getuid()}"))
# Fixed-size programs for 1 and 4 new tokens only (a user's build makes 1, 2, 4, 8 and 16): the tests still cover a
# 1-token program, a tree padded to a static size and the program for any size, in half the build time.
os.environ.setdefault("CLOVER_COMPILE_SIZES", "1,4")
# The default model (smollm2, fetched on first use) stays out of tests that do not ask for it: they get the bundled one.
os.environ.setdefault("CLOVER_MODEL", "tiny")
# A shell without job control starts a background job (`pytest &`, `nohup .ci/run &`) with Ctrl-C ignored, and
# every clover the terminal tests spawn would inherit that and never see their Ctrl-C: give them the default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
torch.set_num_threads(1)  # tiny models gain nothing from threads, and a busy machine makes them slow


def pytest_collection_modifyitems(items):
    """Test files marked `slow` (minutes of compiled builds) first: the README's command runs the files on two
    workers in collection order (`--dist loadfile --no-loadscope-reorder`), and the long ones started first end
    with the rest instead of after it."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within each part is kept


CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello! How can I help you today? I can answer questions about science, history and code.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "USER: What is the capital of France? ASSISTANT: The capital of France is Paris.",
    "Speculative decoding drafts several tokens and verifies them in one forward pass.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Emoji and accents: café naïve — “quotes”.",
]


def build_tokenizer(out: Path, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from clover_cli.templates import VICUNA_V11

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   chat_template=VICUNA_V11, clean_up_tokenization_spaces=False)
    fast.save_pretrained(out)
    return fast


def tiny_config(family: str, vocab_size: int, seed: int = 0, **over):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    base = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                eos_token_id=2, tie_word_embeddings=False)
    base.update(over)
    if family == "llama":
        return LlamaConfig(**base)
    if family == "mistral":
        return MistralConfig(sliding_window=base.pop("sliding_window", 4096), **base)
    if family == "qwen2":
        return Qwen2Config(**base)
    raise ValueError(family)


def build_model(out: Path, family: str = "llama", seed: int = 0, vocab_size: int | None = None, **over):
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer(out)
    torch.manual_seed(seed)
    cfg = tiny_config(family, vocab_size or len(tok), **over)
    model = AutoModelForCausalLM.from_config(cfg)
    # Sharper random logits make greedy continuations less tie-prone and more varied across prompts.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(out)
    return out


def small_draft(out, tokenizer_dir, family: str = "llama"):
    """A one-layer draft with the tokenizer in `tokenizer_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.save_pretrained(out)
    torch.manual_seed(0)
    cfg = tiny_config(family, len(tok), num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                      num_attention_heads=2, num_key_value_heads=1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("llama"), "llama", seed=1)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    """One directory per family, built once."""
    root = tmp_path_factory.mktemp("models")
    return {fam: build_model(root / fam, fam, seed=i + 1) for i, fam in enumerate(("llama", "mistral", "qwen2"))}


@pytest.fixture
def prompts_file(tmp_path):
    """Three bench prompts as a JSONL file (`clover bench --prompts`)."""
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": t}) for t in [
        "Tell me about the fox and the dog.", "What is 2 + 3?", "Hello! How can I help you today?"]) + "\n")
    return p


@pytest.fixture
def one_thread():
    """A tiny model runs fastest on one thread; two spin-wait for each other on a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def run_cli(capsys):
    """Run `clover ...` in-process; returns (exit code, stdout, stderr)."""
    from clover_cli.process import main

    def run(*args, stdin: str | None = None):
        old_stdin = sys.stdin
        if stdin is not None:
            import io

            sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode()), encoding="utf-8")
        try:
            main(list(args))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.stdin = old_stdin
        out = capsys.readouterr()
        return code, out.out, out.err

    return run
