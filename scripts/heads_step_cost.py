"""What a Clover-2 heads proposal costs inside real decoding, call by call, on the bundled model with the compiled
step and the heads' compiled programs:

    python scripts/heads_step_cost.py [--limit 8] [--threads 2]

The heads alone draft (`--draft clover`; with --default, the default drafter: the heads merged with n-gram lookup,
run when the learned choice says so) over the first --limit built-in prompts, 128 new tokens each, greedy, after
one warm-up run. Prints, per kind of program call (the augmenting block's catch-up by the positions it runs, a level
by the nodes it expands) and for whole proposals, the number of calls and their median and total time. Timed in
the engine, so between the target's forwards: the heads' weights come back from memory each time, as in use.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch


def main():
    from clover_cli.bench import load_prompts
    from clover_cli.drafters.registry import drafter_for, load
    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import StopCheck
    from clover_cli.aliases import BUNDLED
    from clover_cli.drafters.factory import auto_drafter
    from clover_cli.session import Options, Session
    from clover_cli.stats import Stats

    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--default", action="store_true", help="the default drafter (heads + lookup) instead of the heads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    s = Session(Options(model="tiny", draft="none", compile="on"), quiet=True)  # the bundled heads are tiny's
    s.compiler.start(background=False)
    drafter = drafter_for(load(BUNDLED / "heads", s.model), s.target)  # with their config's tree rule
    if not s.compiler.ready_heads(drafter, str(BUNDLED / "heads")):
        raise SystemExit("the heads' compiled programs are not available here")
    times = defaultdict(list)

    def timed(fn, key):
        def run(*a):
            t = time.perf_counter()
            out = fn(*a)
            times[key(*a)].append(time.perf_counter() - t)
            return out
        return run

    programs = drafter.programs
    programs.augment = timed(programs.augment, lambda hidden, *_: f"augment, {hidden.shape[0]} positions")
    first, later = programs.levels
    programs.levels = (timed(first, lambda *_: "level 0, 1 node"),
                       timed(later, lambda states, _: f"level, {states.shape[0]} nodes"))
    drafter.propose = timed(drafter.propose, lambda *_: "whole proposal")
    engine = Engine(s.target, auto_drafter(drafter, prior=s.ngram_prior) if args.default else drafter,
                    budget=s.engine.policy.budget, auto_budget=s.engine.policy.auto_budget, cost_store=s.engine.policy.cost_store)
    encoded = [s.encode_chat(p["messages"]) for p in load_prompts(None, args.limit)]
    with torch.inference_mode():
        for _ in engine.generate(encoded[0][:64], StopCheck(8, s.eos_ids)):  # warm-up
            pass
        times.clear()
        stats = Stats()
        for ids in encoded:
            engine.reset()
            for event in engine.generate(ids, StopCheck(128, s.eos_ids)):
                stats.add(event)
    print(f"decoding {stats.decode_s:.2f} s in {stats.steps} target steps")
    print(f"{'call':28s} {'calls':>6s} {'median ms':>10s} {'total ms':>9s}")
    for key in sorted(times, key=lambda k: (k.split(",")[0], int(k.split(", ")[1].split()[0]) if "," in k else 0)):
        v = times[key]
        print(f"{key:28s} {len(v):6d} {1000 * statistics.median(v):10.3f} {1000 * sum(v):9.1f}")


if __name__ == "__main__":
    main()
