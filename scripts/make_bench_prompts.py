"""Build clover's built-in benchmark prompts from the held-out ShareGPT split (never trained on).

    python scripts/make_bench_prompts.py        # writes clover_cli/bench_prompts.jsonl

Spec-Bench-style categories, chosen by simple rules on the first user turn, in file order, up to PER_CATEGORY
each: multi-turn conversation, translation, summarisation, question answering, math, retrieval-grounded.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from clover_cli import atomic
from clover_cli.data import ascii_share, is_heldout, iter_conversations

PER_CATEGORY = 5
MAX_CHARS = 1200
OUT = Path(__file__).resolve().parent.parent / "clover_cli" / "bench_prompts.jsonl"


def category(messages) -> str | None:
    users = [m for m in messages if m["role"] == "user"]
    first = users[0]["content"]
    low = first.lower()
    langs = "english|french|spanish|german|chinese|japanese|korean|italian|portuguese|russian|hindi|arabic"
    boiler = re.sub(r"(write|answer|respond|reply)( \w+)? in english( language)?", "", low)  # ShareGPT boilerplate
    if re.search(r"\btranslat", boiler) or re.search(rf"\b(in|into|to) ({langs})\b", boiler):
        return "translation"
    if re.search(r"\bsummar", low):
        return "summarisation"
    if re.search(r"\b(solve|calculate|equation|how many|what is \d)", low) or re.search(r"\d+\s*[-+*/^]\s*\d+",
                                                                                        low):
        return "math"
    if len(first) > 600 and re.search(r"(based on|according to|given the|from the (text|passage|article))", low):
        return "retrieval"
    if len(users) >= 2 and len(first) < 400 and len(users[1]["content"]) < 400:
        return "multi-turn"
    if len(first) < 200 and re.match(r"(what|who|why|how|when|where|which|is|are|can|does|do)\b", low):
        return "qa"
    return None


def main():
    picked: dict[str, list] = {}
    for conv_id, messages in iter_conversations("sharegpt"):
        if not is_heldout(conv_id):
            continue
        cat = category(messages)
        # English chat, except that translation prompts may carry some other script
        if ascii_share(messages) < (0.8 if cat == "translation" else 0.97):
            continue
        if cat is None or len(picked.get(cat, [])) >= PER_CATEGORY:
            continue
        if cat == "multi-turn":
            turns = messages[:3]  # user, assistant, user
        else:
            turns = [m for m in messages if m["role"] == "user"][:1]
        turns = [{"role": m["role"], "content": m["content"][:MAX_CHARS]} for m in turns]
        picked.setdefault(cat, []).append({"id": conv_id, "category": cat, "messages": turns})
    atomic.write_text(OUT, "".join(json.dumps(row, ensure_ascii=False) + "\n"
                                   for cat in ("multi-turn", "translation", "summarisation", "qa", "math", "retrieval")
                                   for row in picked.get(cat, [])))
    print({k: len(v) for k, v in picked.items()}, "->", OUT)


if __name__ == "__main__":
    main()
