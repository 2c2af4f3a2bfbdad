"""GPU step profile: is a speculative step barely dearer than a plain decode step?

    python scripts/gpu_bench.py                      # 7B-shaped Llama, random fp16 weights, on cuda
    python scripts/gpu_bench.py --shape tiny --device cpu --repeats 3     # dry run anywhere

Measures (speed does not depend on weight values, so the 7B target has random weights):
  1. memory roofline: weight bytes / measured device copy bandwidth, against plain decode ms/token (our engine),
     eager and (on CUDA) with the static step captured as CUDA graphs (clover_cli/step/graphs.py);
  2. verify-step time for trees of 1/16/32/64/128 nodes, relative to a 1-token step, at a 512-token context, both
     ways (128 nodes are past the graphs' largest size: they run eager);
  3. draft time of 5 Clover-2 heads (dynamic tree, 64-node budget), relative to a 1-token step, and of their catch-up
     over 3 new positions; eager, and as static calls (CUDA graphs on a GPU);
  4. HF generate() greedy ms/token on the same model;
  5. end-to-end tokens/s of the bundled model with and without speculation (clover vs none), with the session's
     default step (CUDA graphs on a GPU).
Prints one JSON object; --markdown also prints table rows for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date

import torch

SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=1024),
}


def timer(device):
    if device.type == "cuda":
        def measure(fn, repeats):
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            return sorted(times)[len(times) // 2]
    else:
        def measure(fn, repeats):
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return sorted(times)[len(times) // 2]
    return measure


def random_model(shape: str, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(max_position_embeddings=4096, **SHAPES[shape])
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg).to(device)  # its buffers were on meta
    return model.eval()


def copy_bandwidth(device, measure) -> float:
    n = (1 << 28) if device.type == "cuda" else (1 << 24)
    a = torch.empty(n, dtype=torch.float16, device=device)
    b = torch.empty_like(a)
    t = measure(lambda: b.copy_(a), 10)
    return 2 * a.numel() * a.element_size() / t  # bytes read + written per second


def main():
    from clover_cli.drafters.base import NoDrafter
    from clover_cli.drafters.clover2 import CloverDrafter
    from clover_cli.step import capacity_for
    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import StopCheck
    from clover_cli.step.graphs import attach, heads_graphs
    from clover_cli.drafters.common import HeadsConfig
    from clover_cli.drafters.registry import build_heads
    from clover_cli.target import Target
    from clover_cli.tree import DraftTree

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="7b", choices=SHAPES)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--eager-only", action="store_true", help="skip the CUDA-graph step")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    measure = timer(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    report = {"date": date.today().isoformat(), "device": torch.cuda.get_device_name(0) if device.type == "cuda"
              else platform.processor() or platform.machine(), "shape": args.shape, "dtype": str(dtype),
              "torch": torch.__version__}

    model = random_model(args.shape, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth(device, measure)
    report["weight_gb"] = round(weight_bytes / 1e9, 3)
    report["copy_bandwidth_gb_s"] = round(bw / 1e9, 1)
    report["roofline_ms_per_token"] = round(1000 * weight_bytes / bw, 3)

    target = Target(model, initial_capacity=args.context + 4 * args.new_tokens)
    prompt = torch.randint(3, model.config.vocab_size, (args.context,)).tolist()
    g = torch.Generator().manual_seed(0)
    trees = {}
    for n in (1, 16, 32, 64, 128):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        trees[n] = DraftTree([5] * n, parents).tensors(device)

    def plain_and_verify(step: str):
        # 1. plain decode through our engine (median ms per step after the prefill)
        engine = Engine(target, NoDrafter(), budget=0, auto_budget=False)
        for _ in engine.generate(prompt, StopCheck(8)):
            pass
        steps = []
        for ev in engine.generate(prompt, StopCheck(args.new_tokens)):
            if not ev.prefill:
                steps.append(ev.elapsed_s)
        plain_ms = 1000 * sorted(steps)[len(steps) // 2]
        report[f"plain_ms_per_token_{step}"] = round(plain_ms, 3)
        report[f"roofline_share_{step}"] = round(report["roofline_ms_per_token"] / plain_ms, 3)
        # 2. verify steps for several tree sizes (random trees), after the prompt is in the cache
        engine.reset()
        target.reset(0)
        target.forward(torch.tensor(prompt, device=device))
        target.cache.append(len(prompt))
        verify = {}
        for n, (tokens, depths, mask) in trees.items():
            fn = lambda: target.forward(tokens, target.length + depths, mask)  # noqa: E731
            fn()
            verify[n] = measure(fn, args.repeats)
        report[f"verify_ms_{step}"] = {n: round(1000 * t, 3) for n, t in verify.items()}
        report[f"verify_vs_1_{step}"] = {n: round(t / verify[1], 3) for n, t in verify.items()}
        return verify

    if device.type == "cuda":  # every linear layer of the model over one row, in one graph: the products alone
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        rows = {m.in_features: torch.randn(1, m.in_features, device=device, dtype=dtype) for m in linears}

        def products():
            for m in linears:
                torch.nn.functional.linear(rows[m.in_features], m.weight)

        with torch.inference_mode():
            products()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                products()
            report["linears_one_row_ms"] = round(1000 * measure(graph.replay, args.repeats), 3)

    verify = plain_and_verify("eager")
    if not args.eager_only:  # on a CPU the static step runs uncaptured (a dry run of the code path)

        attach(target, capacity_for(target.max_context))
        verify = plain_and_verify("graphs" if device.type == "cuda" else "static")
    for key in ("plain_ms_per_token", "roofline_share", "verify_ms", "verify_vs_1"):  # the best step's numbers
        report[key] = report.get(f"{key}_graphs", report[f"{key}_eager"])  # the eager one on a CPU

    # 3. drafting: 5 Clover-2 heads (random weights), dynamic tree, 64-node budget; a proposal's levels alone, and
    # a catch-up over 3 new positions; the heads eager, then (where the target's step is static) as static calls
    hcfg = HeadsConfig.for_target(model.config, "clover2", num_heads=5, num_layers=1)
    heads = build_heads(hcfg, model).to(device=device, dtype=dtype).eval()
    hidden, _ = target.forward(torch.tensor(prompt[-16:], device=device))
    context = prompt + [7]
    for label in ("eager",) + (() if args.eager_only else ("graphs" if device.type == "cuda" else "static",)):
        drafter = CloverDrafter(heads, target, topk=8, width=8, min_ratio=0.0, top_p=1.0)
        if label != "eager":
            drafter.attach_programs(heads_graphs(drafter, capacity_for(target.max_context)))
        drafter.observe(hidden, torch.tensor(prompt[-15:] + [7], device=device))

        def draft():
            drafter.propose(context, 64)
            sync()

        def catch_up():
            drafter.observe(hidden[:3], torch.tensor(context[-3:], device=device))
            drafter._catch_up()
            sync()

        draft()
        report[f"draft_ms_{label}"] = round(1000 * measure(draft, args.repeats), 3)
        report[f"catch_up_3_ms_{label}"] = round(1000 * measure(catch_up, args.repeats), 3)
    label = "graphs" if "draft_ms_graphs" in report else "eager"
    report["draft_ms"] = report[f"draft_ms_{label}"]
    report["draft_vs_step"] = round(report["draft_ms"] / (1000 * verify[1]), 3)

    # 4. transformers generate() on the same model
    model.set_attn_implementation("sdpa")
    x = torch.tensor([prompt], device=device)
    gen = lambda k: model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=k, min_new_tokens=k,  # noqa
                                   do_sample=False, pad_token_id=0)
    with torch.inference_mode():  # the two lengths in turn, the fastest of each: a difference of medians went
        gen(4)                    # negative on a busy 2-core machine
        shorts, longs = [], []
        for _ in range(5):
            shorts.append(measure(lambda: gen(1), 1))
            longs.append(measure(lambda: gen(args.new_tokens), 1))
    report["hf_ms_per_token"] = round(1000 * (min(longs) - min(shorts)) / (args.new_tokens - 1), 3)
    model.set_attn_implementation("clover_tree")

    # 5. the bundled model end to end, with and without speculation
    from clover_cli.decode.verify import Sampling
    from clover_cli.session import Options, Session
    from clover_cli.stats import Stats

    # float32: every drafter and either step must give one greedy output; auto: the device's default (bf16 on a GPU)
    for dtype_name in ("float32", "auto") if device.type == "cuda" else ("float32",):
        outputs = {}
        for compile_mode in ("auto", "off"):  # auto: the session's default step (CUDA graphs on a GPU); off: eager
            try:
                session = Session(Options(draft="clover", device=args.device, compile=compile_mode, dtype=dtype_name),
                                  quiet=True)
            except Exception as e:  # the bundled model may be missing in a dev checkout
                report["bundled"] = f"skipped: {e}"
                break
            ids = session.encode_chat([{"role": "user", "content": "Explain how a bicycle works."}])
            rates = {}
            tag = f"{dtype_name}_{compile_mode}"
            report[f"bundled_step_{tag}"] = f"{session.dtype}: {session.compiler.describe()}"
            for name in ("none", "clover", "auto", "none", "clover", "auto"):
                session.switch_draft(name)
                stats, out = Stats(), []
                for ev in session.generate(ids, args.new_tokens, Sampling()):
                    stats.add(ev)
                    out += ev.tokens
                rates[name] = max(rates.get(name, 0.0), round(stats.tokens_per_s or 0.0, 1))  # the better of two runs
                outputs.setdefault(name, set()).add(tuple(out))
            report[f"bundled_tokens_per_s_{tag}"] = rates
        report[f"bundled_outputs_identical_{dtype_name}"] = all(len(seen) == 1 for seen in outputs.values()) and \
            len({next(iter(seen)) for seen in outputs.values()}) == 1
    print(json.dumps(report, indent=2))
    if args.markdown:
        print(f"| {report['date']} | {report['device']} | {args.shape} {report['dtype']} | "
              f"{report['plain_ms_per_token']} ms (roofline {report['roofline_ms_per_token']} ms, "
              f"{100 * report['roofline_share']:.0f}%) | "
              + " / ".join(f"{report['verify_vs_1'][n]}x" for n in (16, 32, 64, 128))
              + f" | {report['draft_vs_step']}x | {report['hf_ms_per_token']} ms |")


if __name__ == "__main__":
    main()
