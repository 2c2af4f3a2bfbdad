"""llama.cpp's own binaries on the GGUF that `clover bench` writes: plain and prompt-lookup decode rates, to see
whether the bench's llama.cpp rows (run through llama-cpp-python) stand for llama.cpp itself.

Build the binaries from the llama.cpp that llama-cpp-python vendors (its sdist's vendor/llama.cpp), e.g.

    cmake -S vendor/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build build -j2 --target llama-lookup llama-bench

then

    python scripts/llamacpp_binaries.py --bin build/bin --limit 5      # prints one JSON object

For each of the first --limit built-in bench prompts (the chat-rendered text, which starts with <s>), llama-lookup
runs greedy twice: drafting nothing (--spec-draft-n-max 0: plain decoding) and drafting up to --draft-max tokens per
match (its n-gram cache lookup, which differs from llama-cpp-python's prompt lookup). Both use --threads, -n tokens,
--kv-cache (f32 by default, as the bench rows use) and --flash-attn (off by default, as llama-cpp-python and so the
bench rows run; llama.cpp's own defaults are an f16 KV cache and flash attention on: `--kv-cache f16
--flash-attn auto`). The rate is (tokens - 1) / decode seconds as llama-lookup reports
them, summed over prompts, as `clover bench` counts. The script also checks that llama.cpp tokenizes each text to
clover's prompt ids and that the generated text equals transformers' greedy reply, and adds llama-bench's
text-generation rate from an empty context when llama-bench is there (its KV cache is float16: it has no f32).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
from datetime import date
from pathlib import Path

DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")


def run_lookup(binary: Path, gguf: Path, text: str, n: int, threads: int, draft_max: int, kv: str,
               flash_attn: str) -> tuple[int, float, str]:
    """(tokens decoded, seconds, stdout) of one greedy llama-lookup run."""
    cmd = [str(binary), "-m", str(gguf), "-p", text, "-n", str(n - 1),  # it decodes n_predict + 1 tokens
           "-t", str(threads), "-tb", str(threads), "-c", "2048", "-ctk", kv, "-ctv", kv, "--temp", "0",
           "-fa", flash_attn, "--spec-draft-n-max", str(draft_max)]
    p = subprocess.run(cmd, capture_output=True, timeout=600)
    err = p.stderr.decode(errors="replace")
    found = DECODED.search(err)
    if p.returncode != 0 or not found:
        sys.exit(f"{binary.name} failed ({p.returncode}): {err[-2000:]}")
    return int(found.group(1)), float(found.group(2)), p.stdout.decode(errors="replace")


def llama_bench(binary: Path, gguf: Path, n: int, threads: int, flash_attn: str) -> float:
    cmd = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(n), "-t", str(threads), "-fa", flash_attn, "-r", "5",
           "-o", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        sys.exit(f"llama-bench failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout)[0]["avg_ts"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", type=Path, required=True, help="Directory with llama-lookup (and llama-bench).")
    ap.add_argument("--model", default=None, help="clover model (default: the bundled tiny).")
    ap.add_argument("--limit", type=int, default=5, help="First N built-in bench prompts.")
    ap.add_argument("-n", type=int, default=128, help="Tokens per prompt.")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-max", type=int, default=10, help="Tokens llama-lookup drafts per match.")
    ap.add_argument("--flash-attn", choices=("on", "off", "auto"), default="off")
    ap.add_argument("--kv-cache", choices=("f32", "f16"), default="f32")
    ap.add_argument("--gguf", type=Path, default=None, help="Run llama.cpp on this GGUF instead of the float32 one "
                    "written from the clover model (e.g. the model's original quantized file: its text may then "
                    "differ from transformers' greedy reply on the dequantized weights, and the report says so).")
    args = ap.parse_args()
    lookup_bin = args.bin / "llama-lookup"
    if not lookup_bin.is_file():
        sys.exit(f"no llama-lookup in {args.bin}: build it first (see the top of this script)")

    import torch

    try:  # llama.cpp's own tokenizer, to check it reads the rendered prompt as clover's ids (the [llama] extra)
        import llama_cpp
    except ImportError:
        llama_cpp = None

    from clover_cli.bench import load_prompts
    from clover_cli.llamacpp import gguf_for, why_unavailable
    from clover_cli.session import Options, Session
    from clover_cli.stats import cache_dir

    s = Session(Options(model=args.model, draft="none"), quiet=True)
    gguf = args.gguf
    if gguf is None:  # the float32 GGUF of the model's weights, written by clover (llama-cpp-python's writer)
        why = why_unavailable(s.model, s.tokenizer, s.device, s.dtype)
        if why:
            sys.exit(f"no GGUF for {s.resolved.name}: {why}")
        gguf = gguf_for(s.resolved, s.model, s.tokenizer, cache_dir())
    vocab = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False) if llama_cpp is not None else None

    totals = {"plain": [0, 0.0], "lookup": [0, 0.0]}
    same_ids, same_text = True, {"plain": 0, "lookup": 0}  # prompts whose reply equals transformers' greedy one
    for prompt in load_prompts(None, args.limit):
        ids = s.encode_chat(prompt["messages"])
        text = s.tokenizer.decode(ids, skip_special_tokens=False)
        if vocab is not None:
            same_ids &= vocab.tokenize(text.encode(), add_bos=False, special=True) == ids
        with torch.inference_mode():
            x = torch.tensor([ids])
            ref = s.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.n, do_sample=False,
                                   eos_token_id=sorted(s.eos_ids))[0, len(ids):].tolist()
        reply = s.tokenizer.decode(ref, skip_special_tokens=False)
        for mode, draft_max in (("plain", 0), ("lookup", args.draft_max)):
            tokens, seconds, out = run_lookup(lookup_bin, gguf, text, args.n, args.threads, draft_max, args.kv_cache,
                                              args.flash_attn)
            totals[mode][0] += tokens - 1
            totals[mode][1] += seconds
            start = out.find(text)  # llama-lookup prints the prompt, then the reply (lookup may run a few tokens on)
            same_text[mode] += start >= 0 and out[start + len(text):].startswith(reply)
    report = {
        "model": s.resolved.name, "gguf": str(gguf), "prompts": args.limit, "max_new_tokens": args.n,
        "threads": args.threads, "draft_max": args.draft_max, "flash_attn": args.flash_attn, "kv_cache": args.kv_cache,
        "plain_tokens_per_s": round(totals["plain"][0] / totals["plain"][1], 1),
        "lookup_tokens_per_s": round(totals["lookup"][0] / totals["lookup"][1], 1),
        "same_prompt_ids": same_ids if vocab is not None else None, "same_text_as_hf_greedy": same_text,
        "weights": s.weights,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "date": date.today().isoformat(),
    }
    if (args.bin / "llama-bench").is_file():
        rate = llama_bench(args.bin / "llama-bench", gguf, args.n, args.threads, args.flash_attn)
        report[f"llama_bench_tg{args.n}_kv_f16_tokens_per_s"] = round(rate, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
