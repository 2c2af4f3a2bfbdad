"""Recipe part 2a: the English ShareGPT conversations as a JSONL file for `clover train --data`.

The target was trained on conversations that are at least 97% ASCII; its heads are distilled on the same ones.
Conversation ids are kept, so `clover train` holds out exactly the same conversations.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from clover_cli import atomic
from clover_cli.data import ascii_share, iter_conversations


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="runs/tiny")
    ap.add_argument("--recipe", default=str(Path(__file__).parent / "recipe.json"))
    args = ap.parse_args()
    recipe = json.loads(Path(args.recipe).read_text())
    out = Path(args.work) / "sharegpt_en.jsonl"
    n = 0

    def fill(tmp: Path):
        nonlocal n
        with tmp.open("w") as f:
            for conv_id, messages in iter_conversations("sharegpt"):
                if ascii_share(messages) >= recipe["ascii_share_min"]:
                    f.write(json.dumps({"id": conv_id, "messages": messages}, ensure_ascii=False) + "\n")
                    n += 1

    atomic.write_with(out, fill)
    print(f"{n} conversations -> {out}")


if __name__ == "__main__":
    main()
