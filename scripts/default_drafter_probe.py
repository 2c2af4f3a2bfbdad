"""What the default drafter (Clover-2 heads + n-gram lookup, `--draft auto`) learns about when the heads pay, against
fixed policies, on the bundled model with the compiled step:

    python scripts/default_drafter_probe.py [--limit 27]

Rows: ngram alone; the default as shipped (ChoiceStats learning per bin whether a step runs the heads); the same
merged drafter always running the heads; never running them. Interleaved prompt by prompt, 128 new tokens, greedy,
after one warm-up run each. Prints decode seconds and target steps per row, then the learned decisions per bin and
the estimated tokens/s of each way in each bin (bins: what lookup alone expects, drafters.ChoiceStats.BINS).
"""

from __future__ import annotations

import argparse

import torch


def main():
    from clover_cli.bench import load_prompts
    from clover_cli.drafters import ChoiceStats
    from clover_cli.drafters.clover2 import CloverDrafter
    from clover_cli.drafters.ngram import NgramDrafter
    from clover_cli.drafters.registry import load
    from clover_cli.engine import Engine, StopCheck
    from clover_cli.hub import BUNDLED
    from clover_cli.session import Options, RunStats, Session, auto_drafter

    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=27)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    s = Session(Options(model=None, draft="none", compile="on"), quiet=True)
    s.compiler.start(background=False)
    heads = load(BUNDLED / "heads", s.model)
    encoded = [s.encode_chat(p["messages"]) for p in load_prompts(None, args.limit)]

    class Fixed(ChoiceStats):
        def __init__(self, way: bool):
            super().__init__()
            self.way = way

        def choose(self, b, prior):
            return self.way

    policies = {"ngram": None, "learned (default)": ChoiceStats(), "always heads": Fixed(True),
                "never heads": Fixed(False)}

    def make(name):
        if policies[name] is None:
            return NgramDrafter(prior=s.ngram_prior)
        d = CloverDrafter(heads, s.target)
        s.compiler.ready_heads(d, str(BUNDLED / "heads"))
        return auto_drafter(d, policies[name], s.ngram_prior)

    engines = {name: Engine(s.target, make(name), budget=s.engine.budget, auto_budget=s.engine.auto_budget,
                            costs=s.engine.costs) for name in policies}
    totals = {name: [0.0, 0] for name in policies}
    with torch.inference_mode():
        for name, eng in engines.items():  # warm-up
            eng.drafter = make(name)
            eng.reset()
            for _ in eng.generate(encoded[0][:64], StopCheck(8, s.eos_ids)):
                pass
        for ids in encoded:
            for name, eng in engines.items():
                eng.drafter = make(name)
                eng.reset()
                stats = RunStats()
                for ev in eng.generate(ids, StopCheck(128, s.eos_ids)):
                    stats.add(ev)
                totals[name][0] += stats.decode_s
                totals[name][1] += stats.steps
    for name, (secs, steps) in totals.items():
        print(f"{name:18s} decode {secs:.2f} s  steps {steps}")
    learned = policies["learned (default)"]
    print("decisions per bin:", dict(sorted(learned.decisions.items())))
    for b in sorted(learned.decisions):
        for way in (False, True):
            rate = learned.rate(b, way)
            print(f"bin {b} heads={way!s:5s} " + (f"{rate:7.0f} tok/s (estimated)" if rate else "not measured"))


if __name__ == "__main__":
    main()
