"""llama.cpp as a peer in `clover bench`: the loaded target's own weights written to a GGUF, run by llama-cpp-python.

`why_unavailable` says (in one line) why the llama.cpp rows cannot run here, or None. `gguf_for` writes the GGUF
once per model (float32, like clover on a CPU) into clover's cache and returns its path; `LlamaCppRunner` runs
greedy generation from token ids: plain, with llama-cpp-python's prompt-lookup drafting, or drafted by a second
llama.cpp context on a draft model's GGUF (`DraftChain`).

GGUF layout (llama.cpp's "llama" architecture): the Hugging Face tensors renamed through gguf's own name map; q and
k projections permuted per head from Hugging Face's rotary layout (first half of each head's dimensions rotated
against the second half) to llama.cpp's (pairs of adjacent dimensions rotated together). The vocabulary is the
byte-level BPE tokenizer's tokens and merges ("gpt2"), padded to the embedding size.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

from . import atomic
from .errors import CloverError

INSTALL_HINT = "pip install 'clover-cli[llama]'"
WRITER_VERSION = 2  # part of the cache key: bump when the GGUF this module writes changes


def why_unavailable(model, tokenizer, device, dtype, load_in_8bit: bool = False, weights: str = "float") -> str | None:
    """None when the llama.cpp rows can run for this target, else the reason in one line."""
    for module, package in (("llama_cpp", "llama-cpp-python"), ("gguf", "gguf")):
        try:
            __import__(module)
        except ImportError:
            return f"{package} is not installed ({INSTALL_HINT})"
        except Exception as e:  # e.g. llama.cpp's shared library fails to load
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return f"{package} does not load ({first_line}); reinstall it: {INSTALL_HINT}"
    if load_in_8bit:
        return "llama.cpp runs the target's float32 weights, and this target is loaded in 8 bits (drop --load-in-8bit)"
    if weights != "float":  # the GGUF is written from the float32 model's own parameters
        return f"llama.cpp runs the target's float32 weights, and this target runs {weights} weights (use --dtype " \
               f"float32)"
    if str(device) != "cpu" or str(dtype) != "torch.float32":
        return f"llama.cpp runs the target's float32 weights on the CPU, and this target is " \
               f"{str(dtype).replace('torch.', '')} on {device} (use --device cpu --dtype float32)"
    return unsupported_model(model.config) or unsupported_tokenizer(tokenizer)


def unsupported_model(cfg) -> str | None:
    """Why the GGUF writer cannot express this model, or None (plain Llama architecture)."""
    if cfg.model_type != "llama":
        return f"the GGUF writer handles Llama-architecture models only, not {cfg.model_type}"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "the GGUF writer handles Llama models without biases only"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"the GGUF writer handles SiLU Llama models only, not {cfg.hidden_act}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"the GGUF writer handles plain rotary embeddings only, not {rope.get('rope_type') or rope.get('type')}"
    return None


def unsupported_tokenizer(tokenizer) -> str | None:
    spec = _tokenizer_json(tokenizer)
    if spec is None or spec["model"].get("type") != "BPE" or not _is_byte_level(spec):
        return "the GGUF writer handles byte-level BPE tokenizers only"
    return None


def _tokenizer_json(tokenizer) -> dict | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return None if backend is None else json.loads(backend.to_str())


def _is_byte_level(spec: dict) -> bool:
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return any(p.get("type") == "ByteLevel" for p in parts)


# ---- the GGUF ----

def rotary_to_interleaved(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a q/k projection, per head, from [x0..x(d/2-1), y0..y(d/2-1)] to [x0, y0, x1, y1, ...].

    Hugging Face rotates dimension i of a head with dimension i + d/2; llama.cpp rotates 2i with 2i + 1.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def interleaved_to_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `rotary_to_interleaved`."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, tokenizer, path: Path, name: str):
    """Write the model (float32) and its tokenizer as a llama.cpp "llama" GGUF at `path`, atomically."""
    import gguf

    from .target import head_size

    cfg = model.config
    head_dim = head_size(cfg)
    n_kv = cfg.num_key_value_heads or cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}

    def fill(tmp: Path):
        writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
        try:
            writer.add_name(name)
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            writer.add_context_length(cfg.max_position_embeddings)
            writer.add_embedding_length(cfg.hidden_size)
            writer.add_block_count(cfg.num_hidden_layers)
            writer.add_feed_forward_length(cfg.intermediate_size)
            writer.add_head_count(cfg.num_attention_heads)
            writer.add_head_count_kv(n_kv)
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
            writer.add_rope_dimension_count(head_dim)
            writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
            writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
            writer.add_vocab_size(cfg.vocab_size)
            _add_vocab(writer, tokenizer, cfg.vocab_size)

            names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
            for hf_name, param in model.named_parameters():  # a tied lm_head is the embedding: listed once
                gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
                if gguf_name is None:
                    raise CloverError(f"cannot write a GGUF of this model: llama.cpp has no name for its tensor "
                                      f"{hf_name}")
                data = param.detach().float().cpu().numpy()
                if hf_name.endswith("self_attn.q_proj.weight"):
                    data = rotary_to_interleaved(data, cfg.num_attention_heads)
                elif hf_name.endswith("self_attn.k_proj.weight"):
                    data = rotary_to_interleaved(data, n_kv)
                writer.add_tensor(gguf_name, np.ascontiguousarray(data))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()

    atomic.write_with(path, fill)


def _add_vocab(writer, tokenizer, n_vocab: int):
    """The byte-level BPE vocabulary: tokens by id (padded to the embedding rows), their types and the merges."""
    import gguf

    spec = _tokenizer_json(tokenizer)
    tokens = [None] * n_vocab
    types = [gguf.TokenType.UNUSED] * n_vocab
    for text, i in spec["model"]["vocab"].items():
        if i < n_vocab:
            tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for added in spec.get("added_tokens", []):
        if added["id"] < n_vocab:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    # llama.cpp's name for how text is split before BPE; only text prompts depend on it (the bench passes token ids)
    pre = spec.get("pre_tokenizer") or {}
    writer.add_tokenizer_pre("gpt-2" if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) else "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for setter, token_id in ((writer.add_bos_token_id, tokenizer.bos_token_id),
                             (writer.add_eos_token_id, tokenizer.eos_token_id),
                             (writer.add_unk_token_id, tokenizer.unk_token_id),
                             (writer.add_pad_token_id, tokenizer.pad_token_id)):
        if token_id is not None:
            setter(token_id)
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]  # does the tokenizer itself add BOS / EOS?
    writer.add_add_bos_token(tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id])
    writer.add_add_eos_token(tokenizer.eos_token_id is not None and probe[-1:] == [tokenizer.eos_token_id])
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:  # so the file chats as the model does (llama.cpp, clover)
        writer.add_chat_template(template)


def gguf_for(resolved, model, tokenizer, cache: Path, quiet: bool = False) -> Path:
    """The cached GGUF of this model, written first when missing. It is named after the model's directory and
    keyed by its revision and its weight, config and tokenizer files' sizes and modification times; a new key
    replaces the directory's older GGUF (a float32 GGUF is as large as the model in float32)."""
    from .store import model_files

    source = Path(resolved.path).resolve()
    files = model_files(source, (".safetensors", ".bin", ".json"))
    key = json.dumps([WRITER_VERSION, resolved.revision, [(f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                                         for f in files]])
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", resolved.name).strip("-.") or "model"
    prefix = f"{name}-{_digest(str(source))}-"
    path = cache / "gguf" / f"{prefix}{_digest(key)}-f32.gguf"
    if path.is_file():
        why = gguf_damage(path)
        if why is None:
            return path
        # a cache is disposable: a damaged file (truncated, overwritten) is written again, with one line
        print(f"clover: the cached GGUF {path} is damaged ({why}); writing it again", file=sys.stderr)
        path.unlink(missing_ok=True)
    size_gb = sum(p.numel() for p in model.parameters()) * 4 / 1e9
    if not quiet:
        print(f"clover: writing {resolved.name} as a float32 GGUF for llama.cpp ({size_gb:.2f} GB, once): {path}",
              file=sys.stderr)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(model, tokenizer, path, resolved.name)
    except OSError as e:
        raise CloverError(f"cannot write the GGUF {path}: {e.strerror or e}")
    for old in path.parent.glob(f"{prefix}*-f32.gguf"):
        if old != path:
            old.unlink(missing_ok=True)
    return path


def gguf_damage(path: Path) -> str | None:
    """What is wrong with the GGUF at `path` (unreadable, cut short: its header or tensors run past its end, or it
    holds no tensor), or None: gguf_model.inspect's reading, the one every GGUF clover loads gets."""
    from .gguf_model import inspect

    try:
        info = inspect(path)
    except CloverError as e:
        return str(e)
    return None if info.types else "it holds no tensor"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# ---- running it ----

class DraftChain:
    """llama-cpp-python's draft hook driven by a second llama.cpp context on a draft model's GGUF: the draft's greedy
    chain of up to `tokens` tokens after what the target has (clover's model-chain row drafts the same chain).
    The draft context keeps the keys and values of the longest prefix it shares with each new call's tokens and
    evaluates only the rest, as llama.cpp's own speculative example keeps its draft context in step."""

    def __init__(self, llm, tokens: int):
        self.llm, self.tokens = llm, tokens

    def __call__(self, input_ids, /, **kwargs):
        llm = self.llm
        n = min(llm.n_tokens, len(input_ids) - 1)  # at least one token is evaluated: fresh logits
        differ = np.flatnonzero(llm.input_ids[:n] != input_ids[:n])
        llm.n_tokens = int(differ[0]) if differ.size else n  # llm.eval drops the cache from here on
        llm.eval(input_ids[llm.n_tokens:].tolist())
        out = []
        while True:
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            if len(out) >= self.tokens or llm.n_tokens >= llm.n_ctx():
                return np.array(out, dtype=np.intc)
            llm.eval(out[-1:])


def _context(llama_cpp, path: Path, n_ctx: int, threads: int, n_batch: int, logits_all: bool, draft=None):
    # KV cache in float32 too (llama.cpp's default is float16), so both sides compute in the same precision.
    try:
        return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=min(n_batch, n_ctx), n_threads=threads,
                               n_threads_batch=threads, n_gpu_layers=0, type_k=llama_cpp.GGML_TYPE_F32,
                               type_v=llama_cpp.GGML_TYPE_F32, draft_model=draft, logits_all=logits_all,
                               verbose=False)
    except (ValueError, RuntimeError) as e:  # llama-cpp-python's "failed to load model" / context errors
        raise CloverError(f"llama.cpp cannot load {path}: {e}")


class LlamaCppRunner:
    """One llama.cpp context on the GGUF: greedy generation from token ids, plain, with prompt lookup
    (`lookup_tokens`), or drafted by a draft model's GGUF (`draft_gguf`, its chain up to `draft_tokens` long)."""

    def __init__(self, path: Path, n_ctx: int, threads: int, lookup_tokens: int = 0, n_batch: int = 512,
                 draft_gguf: Path | None = None, draft_tokens: int = 8):
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = None
        if draft_gguf is not None:
            draft = DraftChain(_context(llama_cpp, draft_gguf, n_ctx + draft_tokens, threads, n_batch, True),
                               draft_tokens)
        elif lookup_tokens:
            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens)
        # Drafting keeps every position's logits; logits_all=True must be said too, or llama-cpp-python sizes that
        # buffer for n_batch positions only and fails once a prompt and its reply pass n_batch tokens.
        self.llm = _context(llama_cpp, path, n_ctx, threads, n_batch, draft is not None, draft)

    def generate(self, ids: list[int], max_new_tokens: int, eos_ids) -> tuple[list[int], float, float]:
        """(new token ids, seconds after the first new token, seconds in all). Stops after an EOS token (kept)."""
        self.llm.reset()  # forget the previous run: the prompt is evaluated from scratch, as every method does
        new, first = [], None
        t0 = time.perf_counter()
        for token in self.llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
            new.append(int(token))
            if first is None:
                first = time.perf_counter()
            if token in eos_ids or len(new) >= max_new_tokens:
                break
        t1 = time.perf_counter()
        return new, t1 - (first or t0), t1 - t0
