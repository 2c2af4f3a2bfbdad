"""Eager GPU steps under each SDPA backend: does a new key length per step cost a plan build?

    python scripts/sdpa_backends.py                 # a 7B-shaped Llama cut to 4 layers, random fp16, on cuda

The eager target step attends with torch's scaled_dot_product_attention over exactly the committed tokens, so
every decoding step has a new key length. A backend that builds an execution plan per shape pays that at every
step. Times the median 1-token step (a) with a new length each step and (b) at one fixed length, under torch's
default backend choice and with each backend forced. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--profile", action="store_true", help="also print the top CUDA/CPU ops of 8 default steps")
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from clover_cli.target import Target

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=args.layers, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.float16).eval()
    target = Target(model, initial_capacity=args.context + 4 * args.steps)
    prompt = torch.randint(3, 32000, (args.context,), device="cuda")
    token = torch.tensor([5], device="cuda")

    def steps(moving: bool) -> float:
        target.reset(0)
        target.forward(prompt)
        target.cache.append(args.context)
        times = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            target.forward(token)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            if moving:
                target.cache.append(1)
        return round(1000 * sorted(times)[len(times) // 2], 3)

    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "layers": args.layers}
    settings = {"default": None, "flash": [SDPBackend.FLASH_ATTENTION], "efficient": [SDPBackend.EFFICIENT_ATTENTION],
                "cudnn": [SDPBackend.CUDNN_ATTENTION], "math": [SDPBackend.MATH]}
    for name, backends in settings.items():
        try:
            if backends is None:
                moving, fixed = steps(True), steps(False)
            else:
                with sdpa_kernel(backends):
                    moving, fixed = steps(True), steps(False)
            report[name] = {"new_length_ms": moving, "fixed_length_ms": fixed}
        except RuntimeError as e:
            report[name] = f"failed: {str(e).splitlines()[0][:120]}"
    print(json.dumps(report, indent=2))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            args.steps = 8
            steps(True)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
