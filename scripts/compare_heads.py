"""Draft heads side by side on one target: τ and decode tokens/s of each, overall and by prompt category.

    python scripts/compare_heads.py runs/cmp/clover runs/cmp/medusa [--model tiny] [--prompts question.jsonl]
                                    [-n 128] [--tree own|eagle2|clover] [--grow k=v,...]
                                    [--window default|none|N] [--limit N]
                                    [--acceptance learned|raw] [--dtype auto|float32] [--temperature T --top-p P]
                                    [--json out.json]

Each heads directory (any layout clover reads) drives its own drafter alone (no n-gram lookup merged in), greedy,
through clover's engine with a fixed tree budget, on the same prompts (clover bench's built-in 30 held-out
ShareGPT prompts in six categories by default, or --prompts in bench's formats), interleaved prompt by prompt after
a warm-up. Every greedy output is checked token for token against plain decoding (the drafters are lossless); with
--temperature each run samples (seeded per prompt; exact samples, not the plain run's tokens). τ = tokens per target
forward after prefill. `--tree eagle2` gives every drafter the same tree rule (EAGLE-2's), so that the
heads are compared rather than their families' tree policies. `--acceptance raw` scores tree nodes by the drafters'
own probabilities (as before 2026-11-26); `learned` (the engine's default) by the chance of acceptance each engine
learns from its verifications (decode.budget.AcceptanceCurve), kept from prompt to prompt as in a chat session.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from clover_cli.atomic import write_text


def parse_grow(text: str) -> dict:
    """'topk=8,min_ratio=0' -> {"topk": 8, "min_ratio": 0.0} (common.TREE_RULE's settings); exits with a one-line
    error on anything else."""
    from clover_cli.drafters.common import TREE_RULE, tree_rule_problem

    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        if key not in TREE_RULE:
            raise SystemExit(f"--grow: unknown setting {key!r} (one of {', '.join(TREE_RULE)})")
        try:
            out[key] = TREE_RULE[key][0](value)
        except ValueError:
            raise SystemExit(f"--grow: {key} needs a number, not {value!r}")
    if problem := tree_rule_problem(out):
        raise SystemExit(f"--grow: {problem}")
    return out


def main():
    from clover_cli.bench import load_prompts
    from clover_cli.drafters.base import NoDrafter
    from clover_cli.drafters.registry import drafter_for, load
    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import Sampling, StopCheck
    from clover_cli.session import Options, Session
    from clover_cli.stats import Stats

    ap = argparse.ArgumentParser()
    ap.add_argument("heads", nargs="+", help="heads directories")
    ap.add_argument("--model", default=None, help="target (default: the bundled model)")
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=32, help="tree budget (nodes per step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tree", choices=("own", "eagle2", "clover"), default="own",
                    help="own: each family's own tree rule; eagle2: every drafter grows EAGLE-2's tree (top-10 "
                         "children per expanded node, the best 10 of a depth expanded, no probability cut); clover: "
                         "every drafter grows clover's default tree (top-8, width 6, ratio and mass cuts)")
    ap.add_argument("--grow", default="",
                    help="the tree rule's settings over --tree's, e.g. 'topk=8,width=6,min_ratio=0,top_p=1' "
                         "(common.TreeGrower's: children per node, nodes expanded per depth, sibling-ratio and "
                         "probability-mass cuts)")
    ap.add_argument("--window", default="default",
                    help="positions a Clover-2 catch-up runs the augmenting block over: 'default' (the drafter's, "
                         "64: a speed trade-off), 'none' (every position, as EAGLE's drafter does) or a number")
    ap.add_argument("--acceptance", choices=("learned", "raw"), default="learned",
                    help="tree scores: the engine's learned chance of acceptance (default) or the drafters' own "
                         "probabilities")
    ap.add_argument("--dtype", default="auto", help="the target's --dtype (auto: a GGUF's own blocks on a CPU)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=0.9, help="with --temperature")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    overrides = parse_grow(args.grow)
    if args.window not in ("default", "none") and not args.window.isdigit():
        raise SystemExit(f"--window must be 'default', 'none' or a number, not {args.window!r}")
    window = {} if args.window == "default" else {"window": None if args.window == "none" else int(args.window)}
    torch.set_num_threads(args.threads)

    s = Session(Options(model=args.model, draft="none", compile="off", dtype=args.dtype), quiet=True)
    sampled = args.temperature > 0
    prompts = load_prompts(args.prompts, args.limit)
    encoded = [s.encode_chat(p["messages"]) for p in prompts]
    methods = {"plain": None}
    for path in args.heads:
        heads = load(Path(path), s.model)
        methods[f"{heads.cfg.architecture}:{Path(path).name}"] = heads

    grow = {"own": {}, "eagle2": {"topk": 10, "width": 10, "min_ratio": 0.0, "top_p": 1.0},
            "clover": {"topk": 8, "width": 6, "min_ratio": 0.25, "top_p": 0.95}}[args.tree]
    grow = {**grow, **overrides}

    def make(heads):
        if heads is None:
            return NoDrafter()
        extra = window if heads.cfg.architecture == "clover2" else {}
        return drafter_for(heads, s.target, **grow, **extra)  # the family's drafter

    engines = {name: Engine(s.target, make(h), budget=args.budget, auto_budget=False,
                            learn_acceptance=args.acceptance == "learned") for name, h in methods.items()}
    figures = {name: {} for name in methods}  # name -> category -> [new tokens, steps, decode s, runs]
    outputs = {name: [] for name in methods}
    with torch.inference_mode():
        for name, eng in engines.items():  # warm-up
            eng.reset()
            for _ in eng.generate(encoded[0][:32], StopCheck(8, s.eos_ids)):
                pass
        for i, ids in enumerate(encoded):
            for name, eng in engines.items():
                eng.drafter = make(methods[name])
                eng.reset()  # the engines share the target's cache: each run starts from a clean one
                stats, new = Stats(), []
                sampling = Sampling(args.temperature, args.top_p, seed=i) if sampled else Sampling()
                for ev in eng.generate(ids, StopCheck(args.max_new_tokens, s.eos_ids), sampling):
                    stats.add(ev)
                    new += ev.tokens
                f = figures[name].setdefault(prompts[i]["category"], [0, 0, 0.0, 0])
                f[0] += len(new)
                f[1] += stats.steps
                f[2] += stats.decode_s
                f[3] += 1
                outputs[name].append(new)
            print(f"prompt {i + 1}/{len(encoded)}", flush=True)

    def summary(rows):
        tokens, steps, secs, runs = (sum(r[k] for r in rows) for k in range(4))
        return {"tau": round((tokens - runs) / steps, 3) if steps else None,
                "tokens_per_s": round((tokens - runs) / secs, 1) if secs else None, "prompts": runs}

    report = {"model": s.resolved.name, "weights": s.weights_text, "budget": args.budget, "tree": args.tree,
              "grow": grow,
              "window": args.window, "acceptance": args.acceptance, "temperature": args.temperature,
              "top_p": args.top_p if sampled else None,
              "max_new_tokens": args.max_new_tokens,
              "threads": args.threads, "date": time.strftime("%Y-%m-%d"), "methods": {}}
    for name in methods:
        report["methods"][name] = {
            "all": summary(figures[name].values()),
            "by_category": {c: summary([r]) for c, r in figures[name].items()},
            "identical_to_plain": None if sampled else outputs[name] == outputs["plain"],
            "training": getattr(methods[name], "cfg", None) and methods[name].cfg.training,
        }
    cats = list(dict.fromkeys(p["category"] for p in prompts))
    print(f"{'method':28s} {'τ all':>7s} {'tok/s':>7s} " + " ".join(f"{c[:12]:>12s}" for c in cats) + "  identical")
    for name, r in report["methods"].items():
        print(f"{name:28s} {r['all']['tau']:7.3f} {r['all']['tokens_per_s']:7.1f} "
              + " ".join(f"{r['by_category'][c]['tau']:12.3f}" for c in cats) + f"  {r['identical_to_plain']}")
    if args.json:
        write_text(args.json, json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
