"""`clover serve` measured against `clover generate`, and under many concurrent clients.

    nice python scripts/serve_bench.py           # the bundled model: 10 prompts x 3, then 20 clients x 5 requests x 3
    nice python scripts/serve_bench.py --compile off --json

1. Speed and identity: for each prompt (single-turn prompts of the built-in bench set), interleaved `--repeats`
   times (which of the two goes first alternates): a one-shot `clover generate --json` (a new process, as a script
   runs it) and a streamed chat completion through the `openai` client from a running `clover serve`. Each streamed
   reply must be token-identical to generate's (temperature 0, sent with every request: the API's default is 1).
   Reported, as medians over the runs:
   - decode tokens/s on equal footing: generate's `tokens_per_s` and the server's own (its "clover" figures), both
     the tokens after the first over the time of the decoding steps;
   - what the client saw while decoding: the tokens after the first over the time from the first piece of text
     to the last chunk (HTTP, server-sent events and the client's parsing included);
   - end to end: completion tokens over the time from sending the request to the last chunk, beside generate's
     tokens over the time from the prompt's tokens to the end (prefill included, loading not).
2. Concurrency: one serial pass over `--requests` prompts gives the reference replies; then `--clients` clients
   each send `--requests` requests at once (alternating streamed and not), `--rounds` times: every reply must be
   complete and equal to the serial one, with no error. The server's resident memory (VmRSS) is read after each
   round; its growth is counted from the end of the first round (a warm-up: the first concurrent requests allocate
   the connection and thread pools for good) to the end of the last.

Both sides run in the environment this script is given (OMP_NUM_THREADS, OMP_WAIT_POLICY: on a machine whose
cores other processes keep busy, torch's OpenMP threads spin-waiting on each other can make any run 10-50x slower,
which OMP_WAIT_POLICY=PASSIVE avoids) and use the same target step: with --compile auto (default) the compiled
step is built first if it is not in the cache (`clover compile`), so generate and serve run it alike.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def clover() -> list[str]:
    return [sys.executable, "-m", "clover_cli"]  # the checkout this script sits in (run from its root)


def prompts(n: int) -> list[str]:
    """n single-turn prompts of the built-in bench set, spread over its categories."""
    sys.path.insert(0, str(ROOT))
    from clover_cli.bench import load_prompts

    singles = [r["messages"][0]["content"] for r in load_prompts(None, None) if len(r["messages"]) == 1]
    step = max(1, len(singles) // n)
    return singles[::step][:n]


def start_server(model: list[str], compile_mode: str):
    proc = subprocess.Popen(clover() + ["serve", *model, "--port", "0", "--stats-file", "off", "--compile",
                                       compile_mode], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines = []
    while True:
        line = proc.stderr.readline()
        if not line:
            sys.exit("clover serve did not start:\n" + "".join(lines))
        lines.append(line)
        found = re.search(r"http://[^ ]+:(\d+)/v1", line)
        if found:
            break
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep its log draining
    return proc, f"http://127.0.0.1:{found.group(1)}/v1", "".join(lines)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def generate(model: list[str], text: str, max_tokens: int, compile_mode: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(text)
    try:
        p = subprocess.run(clover() + ["generate", *model, "-f", f.name, "-n", str(max_tokens), "--json",
                                       "--stats-file", "off", "--compile", compile_mode],
                           cwd=ROOT, capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if p.returncode:
        sys.exit(p.stderr.strip())
    return json.loads(p.stdout)


def streamed(client, model_id: str, text: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    pieces, figures, usage, first, last = [], None, None, None, None
    for chunk in client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": text}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            piece = chunk.choices[0].delta.content or ""
            if piece and first is None:
                first = time.perf_counter() - t0
            pieces.append(piece)
            if chunk.choices[0].finish_reason:
                last = time.perf_counter() - t0
            figures = (chunk.model_extra or {}).get("clover") or figures
        usage = chunk.usage or usage
    wall = time.perf_counter() - t0
    n = usage.completion_tokens
    return {"text": "".join(pieces), "tokens": n, "wall_s": wall, "first_s": first,
            "server_decode_tok_s": figures["tokens_per_s"], "tok_s": n / wall,
            "client_decode_tok_s": (n - 1) / (last - first) if first is not None and last > first else None}


def plain(client, model_id: str, text: str, max_tokens: int, stream: bool) -> tuple[str, str]:
    messages = [{"role": "user", "content": text}]
    if stream:
        reply, finish = [], None
        for chunk in client.chat.completions.create(model=model_id, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, stream=True):
            if chunk.choices:
                reply.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(reply), finish
    resp = client.chat.completions.create(model=model_id, messages=messages, max_tokens=max_tokens, temperature=0)
    return resp.choices[0].message.content, resp.choices[0].finish_reason


def speed(client, model_id: str, model: list[str], texts: list[str], args) -> dict:
    """Part 1: generate and a streamed completion, interleaved per prompt."""
    # warm-up: first-use costs (a first process measures and stores the verify costs) stay out of the timings
    generate(model, texts[0], 16, args.compile)
    streamed(client, model_id, texts[0], 16)
    rows = []
    for i, text in enumerate(texts):
        for rep in range(args.repeats):
            if (i + rep) % 2 == 0:
                g = generate(model, text, args.max_tokens, args.compile)
                s = streamed(client, model_id, text, args.max_tokens)
            else:
                s = streamed(client, model_id, text, args.max_tokens)
                g = generate(model, text, args.max_tokens, args.compile)
            rows.append({"prompt": i, "identical": s["text"] == g["text"].strip() and s["tokens"] == g["new_tokens"],
                         "tokens": g["new_tokens"], "generate_decode_tok_s": g["tokens_per_s"],
                         "generate_e2e_tok_s": g["tokens_per_s_e2e"], "server_decode_tok_s": s["server_decode_tok_s"],
                         "client_decode_tok_s": s["client_decode_tok_s"], "client_tok_s": s["tok_s"],
                         "client_first_token_s": s["first_s"], "generate_step": g["step"]})
    keys = ("generate_decode_tok_s", "server_decode_tok_s", "client_decode_tok_s", "generate_e2e_tok_s",
            "client_tok_s")
    med = {k: statistics.median(r[k] for r in rows if r[k] is not None) for k in keys}
    # per pair, the server's figure over generate's (the two runs of a pair under about the same load)
    ratios = {"server_decode_over_generate_decode": statistics.median(
                  r["server_decode_tok_s"] / r["generate_decode_tok_s"] for r in rows),
              "client_decode_over_generate_decode": statistics.median(
                  r["client_decode_tok_s"] / r["generate_decode_tok_s"] for r in rows
                  if r["client_decode_tok_s"] is not None),
              "client_e2e_over_generate_e2e": statistics.median(
                  r["client_tok_s"] / r["generate_e2e_tok_s"] for r in rows)}
    totals = {"generate_e2e_tok_s": sum(r["tokens"] for r in rows) / sum(r["tokens"] / r["generate_e2e_tok_s"]
                                                                        for r in rows),
              "client_tok_s": sum(r["tokens"] for r in rows) / sum(r["tokens"] / r["client_tok_s"] for r in rows)}
    return {"runs": len(rows), "all_identical": all(r["identical"] for r in rows),
            "median": {k: round(v, 1) for k, v in med.items()},
            "median_ratio_per_pair": {k: round(v, 3) for k, v in ratios.items()},
            "over_all_tokens": {k: round(v, 1) for k, v in totals.items()},
            "client_vs_generate_e2e": round(totals["client_tok_s"] / totals["generate_e2e_tok_s"], 3),
            "step": rows[0]["generate_step"], "rows": rows}


def concurrency(client, url: str, model_id: str, pid: int, args) -> dict:
    """Part 2: the serial replies, then rounds of concurrent clients; the server's RSS after each."""
    from openai import OpenAI

    texts = prompts(args.requests)
    serial = [plain(client, model_id, t, args.concurrent_max_tokens, False) for t in texts]
    rss = [rss_mib(pid)]  # after the serial pass
    rounds = []

    def one_client(c):
        """One client (its own connection) sending its requests one after another: (prompt, reply or the error it
        got) for each."""
        out = []
        with OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) as own:
            for r in range(args.requests):
                k = (c + r) % len(texts)
                try:
                    out.append((k, plain(own, model_id, texts[k], args.concurrent_max_tokens, stream=(c + r) % 2 == 0)))
                except Exception as e:  # counted, not fatal: the goal is that none happens
                    out.append((k, e))
        return out

    for _ in range(args.rounds):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            got = [reply for replies in pool.map(one_client, range(args.clients)) for reply in replies]
        wall = time.perf_counter() - t0
        rss.append(rss_mib(pid))
        errors = [f"{type(e).__name__}: {e}"[:200] for _, e in got if isinstance(e, Exception)]
        got = [(k, reply) for k, reply in got if not isinstance(reply, Exception)]
        rounds.append({"requests": len(got) + len(errors), "errors": len(errors), "first_errors": errors[:3],
                       "complete": sum(1 for _, (t, f) in got if t and f in ("stop", "length")),
                       "identical_to_serial": sum(1 for k, reply in got if reply == serial[k]),
                       "wall_s": round(wall, 2)})
    return {"clients": args.clients, "requests_per_client": args.requests, "max_tokens": args.concurrent_max_tokens,
            "rounds": rounds, "rss_mib_after_serial_then_each_round": [round(x, 1) for x in rss],
            "rss_growth_after_warmup_round": round(rss[-1] / rss[1] - 1, 4),
            "rss_growth_from_serial": round(rss[-1] / rss[0] - 1, 4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the bundled one)")
    ap.add_argument("--prompts", type=int, default=10, help="prompts of part 1 (0: leave part 1 out)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--requests", type=int, default=5, help="requests per client (and distinct prompts)")
    ap.add_argument("--concurrent-max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="concurrent rounds (the first a warm-up for RSS)")
    ap.add_argument("--compile", default="auto", choices=["auto", "off"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the first is a warm-up for the memory figure)")
    from openai import OpenAI

    model = [args.model] if args.model else []
    if args.compile == "auto":
        subprocess.run(clover() + ["compile", *model], cwd=ROOT, check=True, capture_output=True)
    proc, url, banner = start_server(model, args.compile)
    report = {"banner": banner.strip().splitlines(), "load_average_start": os.getloadavg(),
              "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY") if k in os.environ}}
    try:
        client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        model_id = client.models.list().data[0].id
        if args.prompts:
            report["speed"] = speed(client, model_id, model, prompts(args.prompts), args)
        report["concurrency"] = concurrency(client, url, model_id, proc.pid, args)
    finally:
        proc.terminate()
        proc.wait(30)
    report["load_average_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print("\n".join(report["banner"]))
    sp, cc = report.get("speed"), report["concurrency"]
    if sp:
        print(f"speed: {sp['runs']} runs, identical {sp['all_identical']}, step: {sp['step']}")
        for k, v in sp["median"].items():
            print(f"  median {k}: {v}")
        for k, v in sp["median_ratio_per_pair"].items():
            print(f"  median per pair {k}: {v}")
        print(f"  over all tokens: generate e2e {sp['over_all_tokens']['generate_e2e_tok_s']} tok/s, client "
              f"{sp['over_all_tokens']['client_tok_s']} tok/s ({sp['client_vs_generate_e2e']}x)")
    for i, r in enumerate(cc["rounds"]):
        print(f"concurrency round {i + 1}: {r['requests']} requests, {r['errors']} errors, {r['complete']} complete, "
              f"{r['identical_to_serial']} identical to serial, {r['wall_s']} s")
        for e in r["first_errors"]:
            print(f"  error: {e}")
    print(f"  RSS MiB after the serial pass, then each round: {cc['rss_mib_after_serial_then_each_round']} "
          f"(growth after the warm-up round {100 * cc['rss_growth_after_warmup_round']:.2f}%, from the serial pass "
          f"{100 * cc['rss_growth_from_serial']:.2f}%)")
    print(f"load average at start {report['load_average_start']}, at end {report['load_average_end']}; "
          f"environment {report['env']}")


if __name__ == "__main__":
    main()
