"""How a model's chat replies end, over `clover bench`'s prompts, for one or more sampling settings: how many end in a
loop (the last 48 tokens one block of at most 16 repeated: clover_cli.reply.ends_in_loop), how many end on EOS, how
long they are. What the default sampling settings of an alias are chosen from (docs/BENCHMARKS.md).

    python scripts/chat_quality.py smollm2 --settings 0:1.0,0:1.1,0:1.2 -n 256
    python scripts/chat_quality.py tiny --settings 0:1.0 --json

A setting is TEMPERATURE:PENALTY (top-p 1, seed 0 for sampled ones). Replies are decoded with --draft ngram (greedy
output is the target's own whatever the drafter; sampled output an exact sample of it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="alias, directory or GGUF (default: the default model)")
    p.add_argument("--settings", default="0:1.0", help="comma-separated TEMPERATURE:PENALTY pairs")
    p.add_argument("-n", "--max-new-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    p.add_argument("--json", action="store_true", help="one JSON object per setting instead of the table")
    p.add_argument("--show", action="store_true", help="print each reply's last 120 characters")
    a = p.parse_args(argv)

    from clover_cli.bench import load_prompts
    from clover_cli.reply import ends_in_loop
    from clover_cli.decode.verify import Sampling
    from clover_cli.options import Options
    from clover_cli.session import Session

    session = Session(Options(model=a.model, draft="ngram", compile="off"), quiet=True)
    prompts = load_prompts(None, a.limit)
    rows = []
    for setting in a.settings.split(","):
        temperature, penalty = (float(x) for x in setting.split(":"))
        loops = eos = 0
        lengths = []
        t0 = time.perf_counter()
        for i, row in enumerate(prompts):
            ids = session.encode_chat(row["messages"])
            out, finish = [], None
            for ev in session.generate(ids, a.max_new_tokens, Sampling(temperature, 1.0, i, penalty)):
                out += ev.tokens
                finish = ev.finish or finish
            looped = ends_in_loop(out)
            loops += looped
            eos += finish in ("eos", "stop")
            lengths.append(len(out))
            if a.show:
                tail = session.decode(out)[-120:].replace("\n", " ")
                print(f"  [{row['id']}] {finish}{' LOOP' if looped else ''} {len(out)}: …{tail}", file=sys.stderr)
        rows.append({"model": a.model or "default", "temperature": temperature, "repetition_penalty": penalty,
                     "prompts": len(prompts), "loops": loops, "eos": eos,
                     "median_tokens": statistics.median(lengths), "mean_tokens": round(statistics.mean(lengths), 1),
                     "max_new_tokens": a.max_new_tokens, "seconds": round(time.perf_counter() - t0, 1)})
        if a.json:
            print(json.dumps(rows[-1]), flush=True)
    if not a.json:
        print("| temperature | penalty | end in a loop | end on EOS | median tokens | mean tokens |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['temperature']:g} | {r['repetition_penalty']:g} | {r['loops']}/{r['prompts']} | "
                  f"{r['eos']}/{r['prompts']} | {r['median_tokens']:g} | {r['mean_tokens']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
