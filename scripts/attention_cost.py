"""What one attention call costs on the CPU: clover_kernels.attention.exact_rows over float32 and float16 keys and
values (the KV cache's two dtypes) and torch's SDPA, at a few row counts over one context, in µs per call.

    python scripts/attention_cost.py --context 300 --rows 1,2,4,16 --heads 9,3 --head-size 64

Each round times every variant once, in turn, the order reversed every other round (ABBA); the table gives each
variant's median over the rounds. One layer's call: multiply by the model's layers for a step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clover_cli import store  # noqa: E402
from clover_kernels import quant  # noqa: E402
from clover_kernels.attention import exact_rows  # noqa: E402


def inputs(rows: int, context: int, hq: int, hkv: int, d: int, spare: int = 64):
    """A query of `rows` new tokens; keys and values as views of a cache buffer with room to spare; a causal mask
    over the new tokens after the committed ones."""
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(1, hq, rows, d, generator=g)
    k = torch.randn(1, hkv, context + spare, d, generator=g)[:, :, :context]
    v = torch.randn(1, hkv, context + spare, d, generator=g)[:, :, :context]
    mask = torch.ones(rows, context, dtype=torch.bool).tril(context - rows)[None, None]
    return q, k, v, mask


def timed(fn, repeats: int) -> float:
    for _ in range(10):  # the first calls start the thread pool and fault in buffers (~1 ms once)
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=300, help="Keys each call sees (committed and new).")
    ap.add_argument("--rows", default="1,2,4,16", help="Row counts (new tokens), comma-separated.")
    ap.add_argument("--heads", default="9,3", help="Query heads, key/value heads (SmolLM2-135M: 9,3).")
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=200, help="Calls per timing.")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    quant.load(store.kernels_dir())
    hq, hkv = (int(x) for x in a.heads.split(","))
    print(f"{a.context} keys, {hq}/{hkv} heads of {a.head_size}, {torch.get_num_threads()} threads; "
          f"median µs per call over {a.rounds} rounds of {a.repeats} calls")
    print("| rows | exact_rows, float32 KV | exact_rows, float16 KV | float16 / float32 | SDPA, float32 KV |")
    print("|---|---|---|---|---|")
    for rows in (int(x) for x in a.rows.split(",")):
        q, k, v, mask = inputs(rows, a.context, hq, hkv, a.head_size)
        k16, v16 = k.half(), v.half()
        variants = {
            "f32": lambda: exact_rows(q, k, v, mask),
            "f16": lambda: exact_rows(q, k16, v16, mask),
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                             enable_gqa=hq != hkv),
        }
        times = {name: [] for name in variants}
        with torch.inference_mode():
            for r in range(a.rounds):
                for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                    times[name].append(timed(variants[name], a.repeats))
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"| {rows} | {med['f32']:.1f} | {med['f16']:.1f} | {med['f16'] / med['f32']:.3f} | {med['sdpa']:.1f} |")


if __name__ == "__main__":
    main()
