"""What the default drafter (Clover-2 heads + n-gram lookup, `--draft auto`) learns about when the heads pay, against
fixed policies, on the bundled model with the compiled step:

    python scripts/default_drafter_probe.py [--limit 27]

Rows: ngram alone; the default as shipped (ChoiceStats learning per bin whether a step runs the heads), once from
nothing and once from the choice stored by earlier processes (as `clover generate`, `clover chat` and `clover bench`
start; read, not written back); the same merged drafter always running the heads; never running them. Interleaved
prompt by prompt in `clover bench`'s balanced order (a rotation would keep each row's predecessor, and a run right
after one with the heads on every step measured ~5% slower), `--rounds` times over the prompts, 128 new tokens,
greedy, after one warm-up run each. Prints decode tokens/s, target steps and steps that ran the heads per row, then
the learned decisions per bin and the estimated tokens/s of each way in each bin (bins: what lookup alone expects,
drafters.merged.ChoiceStats.BINS).
"""

from __future__ import annotations

import argparse

import torch


def main():
    from clover_cli.bench import balanced_order, load_prompts
    from clover_cli.drafters.merged import ChoiceStats, MergedDrafter
    from clover_cli.drafters.ngram import NgramDrafter
    from clover_cli.drafters.registry import drafter_for, load
    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import StopCheck
    from clover_cli.aliases import BUNDLED
    from clover_cli.drafters.factory import auto_drafter
    from clover_cli.session import Options, Session
    from clover_cli.stats import Stats

    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=27)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    s = Session(Options(model="tiny", draft="none", compile="on"), quiet=True)  # the bundled heads are tiny's
    s.compiler.start(background=False)
    heads = load(BUNDLED / "heads", s.model)
    encoded = [s.encode_chat(p["messages"]) for p in load_prompts(None, args.limit)]

    class Fixed(ChoiceStats):
        def __init__(self, way: bool):
            super().__init__()
            self.way = way

        def choose(self, b, prior):
            return self.way

    stored = ChoiceStats()
    s.engine.policy.cost_store.load_choices(stored, s.engine.policy.cost_store.choices_path(str(BUNDLED / "heads")))
    print("stored choice:", sum(stored.decisions.values()), "decisions")
    policies = {"ngram": None, "learned (default)": ChoiceStats(), "learned, stored": stored,
                "always heads": Fixed(True), "never heads": Fixed(False)}

    def make(name):
        if policies[name] is None:
            return NgramDrafter(prior=s.ngram_prior)
        d = drafter_for(heads, s.target)  # with their config's tree rule, as clover runs them
        s.compiler.ready_heads(d, str(BUNDLED / "heads"))
        return auto_drafter(d, policies[name], s.ngram_prior)

    # skip_unpaid=False: each row drafts at every step the cost model allows, so that the rows differ only in when
    # the heads run (decode.budget.DraftValue would also skip whole proposals where the heads do not pay)
    policy = s.engine.policy
    engines = {name: Engine(s.target, make(name), budget=policy.budget, auto_budget=policy.auto_budget,
                            cost_store=policy.cost_store, skip_unpaid=False) for name in policies}
    totals = {name: [0.0, 0, 0, 0] for name in policies}  # decode seconds, tokens, steps, steps with the heads
    heads_steps = {"n": 0}
    propose = MergedDrafter.propose

    def counted(self, context, budget):  # counts the steps that ran the heads
        tree = propose(self, context, budget)
        heads_steps["n"] += self._open.ran_first
        return tree

    MergedDrafter.propose = counted
    names = list(policies)
    with torch.inference_mode():
        for name, eng in engines.items():  # warm-up
            eng.drafter = make(name)
            eng.reset()
            for _ in eng.generate(encoded[0][:64], StopCheck(8, s.eos_ids)):
                pass
        for i, ids in enumerate(encoded * args.rounds):
            for name in (names[j] for j in balanced_order(len(names), i)):
                eng = engines[name]
                eng.drafter = make(name)
                eng.reset()
                stats = Stats()
                heads_steps["n"] = 0
                for ev in eng.generate(ids, StopCheck(128, s.eos_ids)):
                    stats.add(ev)
                for col, v in enumerate((stats.decode_s, stats.new_tokens - 1, stats.steps, heads_steps["n"])):
                    totals[name][col] += v
    base = totals["ngram"][1] / totals["ngram"][0]
    for name, (secs, tokens, steps, with_heads) in totals.items():
        print(f"{name:18s} {tokens / secs:7.1f} tok/s ({tokens / secs / base:.3f}x ngram)  decode {secs:.2f} s  "
              f"steps {steps}  tau {tokens / steps:.3f}  steps with the heads {with_heads}")
    learned = policies["learned (default)"]
    print("decisions per bin:", dict(sorted(learned.decisions.items())))
    for b in sorted(learned.decisions):
        for way in (False, True):
            rate = learned.rate(b, way)
            print(f"bin {b} heads={way!s:5s} " + (f"{rate:7.0f} tok/s (estimated)" if rate else "not measured"))


if __name__ == "__main__":
    main()
