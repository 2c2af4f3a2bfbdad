"""The draft-model drafter's ablation (issue #16 item 7), in the steps of improved MCSD's (arXiv 2409.10644):

    chain, 8 deep                          the draft's top-1 token at each depth (classic speculative decoding)
    mcsd k=3, equal lengths (8 deep)       the draft's 3 best tokens at the root, each branch drafted 8 deep: the
                                           MCSD baseline, whose candidates are equal-length sequences
    + branches end on their own            per-branch lengths, each ending where the draft gives its next token
      (dynamic mask, --draft model)        under 0.3: what the paper's dynamic, topology-aware mask allows (here
                                           every tree is verified through a tree mask, so the mask is the same
                                           code for both; what changes is that branches may differ in length)
    + learned early stop                   each branch ends where a logistic model of acceptance, fitted online
                                           (drafters/early_stop.py), says under 0.3: the paper's decision models.
                                           The model belongs to the draft model, so the two learned rows share it:
                                           fitted on prompts outside the timed ones first, it goes on learning from
                                           both rows during the timed runs
    chain + early stop, chain + learned early stop: the same stops on the chain

The paper's "target-initialised" candidates are, in this engine, every step's root (the target's own token): see
drafters/draft_model.py. With `--tree-budget N` (no cost model) a tree is verified as drafted, up to N nodes, as in
the paper's setting; with `auto` (clover's default) the engine also cuts every tree to the nodes that pay for their
verification on this device, which blurs the first steps (equal lengths no longer reach the verify). Under
sampling: fixed top-token candidates against sampled ones verified q-aware. Same target, draft, prompts and cost
model as `clover bench`, interleaved prompt by prompt after a warm-up; greedy outputs checked against plain
decoding.

    python scripts/draft_ablation.py --draft-model DIR [--temperature 0.8] [--limit N] [-n 128] [--tree-budget N]
        [--compile auto|on|off] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from clover_cli import atomic
from clover_cli.bench import BenchConfig, BenchSession, load_prompts
from clover_cli.drafters.base import NoDrafter
from clover_cli.drafters.draft_model import ModelDrafter
from clover_cli.decode.engine import Engine
from clover_cli.decode.verify import Sampling, StopCheck
from clover_cli.stats import Stats

VARIANTS = {
    "plain": None,
    "chain, 8 deep (--tree static)": dict(tree="chain", stop_below=0.0),
    "chain + early stop": dict(tree="chain"),
    "mcsd k=3, equal lengths (8 deep)": dict(tree="mcsd", stop_below=0.0),
    "mcsd k=3 + branches end on their own (dynamic mask; --draft model)": dict(tree="mcsd"),
    "chain + learned early stop": dict(tree="chain", learned_stop=True),
    "mcsd k=3 + dynamic mask + learned early stop (--early-stop learned)": dict(tree="mcsd", learned_stop=True),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--draft-model", required=True)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--tree-budget", default="auto", help="auto (sized per step by measured cost) or N nodes")
    ap.add_argument("--compile", default=None, help="auto, on or off (default: $CLOVER_COMPILE, else auto)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = BenchConfig(model=args.model, draft_model=args.draft_model, methods="plain", json_out=True,
                      tree_budget=args.tree_budget, compile=args.compile)
    bs = BenchSession(cfg)
    s = bs.session
    variants = dict(VARIANTS)
    if args.temperature > 0:
        variants = {"plain": None,
                    "mcsd + early stop, fixed top candidates": dict(tree="mcsd", sample=False),
                    "mcsd + early stop, sampled candidates (q-aware)": dict(tree="mcsd", sample=True),
                    "chain, fixed top candidates": dict(tree="chain", sample=False),
                    "chain, sampled candidates (q-aware)": dict(tree="chain", sample=True)}
    # skip_unpaid=False: every variant drafts at each step the cost model allows, as the trees themselves are compared
    # here (`clover bench`'s rows stop asking a draft whose calls do not pay: decode.budget.DraftValue)
    engines = {name: Engine(s.target, NoDrafter(), budget=bs.budget, auto_budget=bs.auto, cost_store=s.engine.policy.cost_store,
                            skip_unpaid=False) for name in variants}
    every = [s.encode_chat(p["messages"]) for p in load_prompts(None, None)]
    prompts = every[:args.limit] if args.limit else every
    # what the learned early stop is fitted on before timing: prompts outside the timed ones where there are some
    fit_on = every[len(prompts):][:3] or prompts[-3:]
    totals = {name: Stats() for name in variants}
    outputs = {name: [] for name in variants}

    def run(name, ids, n, seed):
        eng = engines[name]
        spec = variants[name]
        eng.drafter = NoDrafter() if spec is None else ModelDrafter(bs.draft_model, s.target, **spec)
        if spec is not None:
            s.compiler.ready_draft(eng.drafter, bs.draft_model_path)  # the draft's compiled step, as --draft model
        eng.reset()
        stats, out = Stats(), []
        for ev in eng.generate(ids, StopCheck(n, s.eos_ids), Sampling(args.temperature, 1.0, seed)):
            stats.add(ev)
            out += ev.tokens
        return stats, out

    with torch.inference_mode():
        for name in variants:
            run(name, prompts[0][:64], 8, 0)  # warm-up
            if (variants[name] or {}).get("learned_stop"):  # and the learned early stop fitted before timing
                for ids in fit_on:
                    run(name, ids, args.max_new_tokens, 0)
        t0 = time.time()
        for i, ids in enumerate(prompts):
            for name in variants:
                stats, out = run(name, ids, args.max_new_tokens, 1000 + i)
                t = totals[name]
                t.new_tokens += stats.new_tokens - 1  # decode tokens only, as bench's tok/s
                t.steps += stats.steps
                t.decode_s += stats.decode_s
                t.proposed += stats.proposed
                outputs[name].append(out)
    rows = []
    plain = totals["plain"].new_tokens / totals["plain"].decode_s
    for name, t in totals.items():
        rate = t.new_tokens / t.decode_s
        identical = None if args.temperature > 0 else outputs[name] == outputs["plain"]
        rows.append({"variant": name, "tokens_per_s": round(rate, 1), "tau": round(t.new_tokens / t.steps, 3),
                     "nodes_per_step": round(t.proposed / t.steps, 2), "vs_plain": round(rate / plain, 3),
                     "identical_to_plain": identical})
    report = {"model": args.model, "draft_model": args.draft_model, "temperature": args.temperature,
              "tree_budget": args.tree_budget,
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "step": s.compiler.describe(),
              "threads": torch.get_num_threads(), "seconds": round(time.time() - t0, 1), "rows": rows}
    print("| variant | tok/s | τ | nodes verified / step | vs plain | identical |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ident = "-" if r["identical_to_plain"] is None else ("yes" if r["identical_to_plain"] else "NO")
        print(f"| {r['variant']} | {r['tokens_per_s']} | {r['tau']} | {r['nodes_per_step']} | {r['vs_plain']}x | "
              f"{ident} |")
    if args.json:
        atomic.write_text(Path(args.json), json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
