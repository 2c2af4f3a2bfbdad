"""Soak test of `clover chat` with piped standard input (issue #14; not part of CI: it takes minutes).

    python scripts/soak.py                      # 200 turns of -n 16 on the bundled model, then the /load timing
    python scripts/soak.py --turns 50 --json

1. Drives `--turns` chat turns through one `clover chat` process's standard input, one message per line, waiting for
   each reply (its stats line on standard error) before sending the next, and samples the process's resident memory
   (RSS) after every turn. Reports the RSS at the end of turn `--after` (20) and at the last turn, and the growth
   between them (goal: < 5%), also split into anonymous memory (the process's own: what a leak grows) and
   file-backed pages (mapped libraries, paged in as code paths are first used). The conversation outgrows the
   model's context along the way, so context sliding is part of what is soaked.
2. Writes a conversation of `--messages` (2,000) messages, then in a fresh `clover chat` process times `/load` of
   it followed by one message, from the moment the two lines are written to the first byte of the reply on standard
   output (goal: < 2 s): once as the first thing the process does after its banner (cold: the first reply also
   measures the step costs), once after a warm-up reply. The process's CPU time (user + system, all threads) is
   reported beside each wall time: on a machine other work shares, wall time stretches and CPU time does not.

The chat runs from this checkout (`python -m clover_cli`), eager (`--compile off`, so that a background build
loading into the process does not show up as growth; `--compile auto` measures that too), with its stats stream in a
temporary file. Memory is read from /proc/PID/status (Linux) or psutil.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTLE_S = 0.3
TOPICS = ["the sea", "bread", "a small town", "the moon", "trains", "winter", "a good book", "coffee", "music",
          "the mountains", "old computers", "a garden", "the river", "chess", "rain", "a quiet morning"]


def memory(pid: int) -> dict:
    """Resident memory in bytes: "rss" in all, and on Linux its parts "anon" (the process's own: what a leak grows)
    and "file" (pages of mapped libraries and files, paged in as code paths are first run)."""
    fields = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file"}
    got = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = fields.get(line.split(" ", 1)[0].split("\t", 1)[0])
                if key:
                    got[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    if "rss" not in got:
        import psutil

        got["rss"] = psutil.Process(pid).memory_info().rss
    return got


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) the process has used: unlike wall time, not stretched by other
    processes on a busy machine."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        import psutil

        t = psutil.Process(pid).cpu_times()
        return t.user + t.system


class Chat:
    """A `clover chat` child with piped standard input; its standard output and error read by threads."""

    def __init__(self, args, stats_file: Path):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
        cmd = [sys.executable, "-m", "clover_cli", "chat", *([args.model] if args.model else []),
               "-n", str(args.max_new_tokens), "--compile", args.compile, "--stats-file", str(stats_file)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     cwd=ROOT, env=env)
        self.err: queue.Queue = queue.Queue()
        self.out_times: list[float] = []  # when each chunk of standard output arrived
        self.err_lines: list[str] = []
        threading.Thread(target=self._read_out, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read_out(self):
        while chunk := self.proc.stdout.read1(65536):
            self.out_times.append(time.perf_counter())

    def _read_err(self):
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.err_lines.append(line)
            self.err.put(line)

    def send(self, *lines: str) -> float:
        t = time.perf_counter()
        self.proc.stdin.write("".join(line + "\n" for line in lines).encode())
        self.proc.stdin.flush()
        return t

    def wait_for(self, test, timeout: float = 600.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.err.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = "\n".join(self.err_lines[-5:])
                    raise SystemExit(f"soak: clover chat stopped answering (exit {self.proc.poll()}):\n{tail}")
                continue
            if line.startswith("error:") or line.startswith("clover: error"):
                raise SystemExit(f"soak: clover chat said: {line}")
            if test(line):
                return line

    def reply(self, timeout: float = 600.0) -> str:
        """Wait for the stats line that follows a reply."""
        return self.wait_for(lambda line: " tokens · τ" in line, timeout)

    def first_output_after(self, t: float, timeout: float = 600.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            later = [x for x in self.out_times if x > t]
            if later:
                return later[0]
            time.sleep(0.002)
        raise SystemExit("soak: no reply on standard output")

    def close(self):
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def soak(args, stats_file: Path) -> dict:
    chat = Chat(args, stats_file)
    samples, turn_s = [], []
    try:
        turn_cpu = []
        for turn in range(1, args.turns + 1):
            cpu = cpu_seconds(chat.proc.pid)
            t = chat.send(f"Tell me something about {TOPICS[turn % len(TOPICS)]}, in a sentence or two. ({turn})")
            chat.reply()
            turn_s.append(time.perf_counter() - t)
            time.sleep(SETTLE_S)  # the stats line comes before the reply's memory is freed and handed back
            turn_cpu.append(cpu_seconds(chat.proc.pid) - cpu)
            samples.append(memory(chat.proc.pid))
    finally:
        chat.close()
    slid = any("outgrew the model's context" in line for line in chat.err_lines)
    report = {"turns": args.turns, "max_new_tokens": args.max_new_tokens, "after_turn": args.after,
              "median_turn_s": round(sorted(turn_s)[len(turn_s) // 2], 3),
              "median_turn_cpu_s": round(sorted(turn_cpu)[len(turn_cpu) // 2], 3), "context_slid": slid}
    for key in ("rss", "anon", "file"):
        series = [m[key] for m in samples if key in m]
        if len(series) != len(samples):
            continue
        base = series[args.after - 1]
        report[key] = {"first_mib": round(series[0] / 2**20, 1), "after_mib": round(base / 2**20, 1),
                       "last_mib": round(series[-1] / 2**20, 1), "max_mib": round(max(series) / 2**20, 1),
                       "growth_after_pct": round(100 * (series[-1] - base) / base, 2),
                       "growth_max_after_pct": round(100 * (max(series[args.after - 1:]) - base) / base, 2),
                       "every_20_mib": [round(r / 2**20, 1) for r in series[19::20]]}
    return report


def load_timing(args, stats_file: Path, conv: Path, warm: bool) -> dict:
    chat = Chat(args, stats_file)
    try:
        chat.wait_for(lambda line: line.startswith("context "))  # the banner's last line: ready for input
        if warm:
            chat.send("Hello there.")
            chat.reply()
        cpu = cpu_seconds(chat.proc.pid)
        t = chat.send(f"/load {conv}", "And what do you think about that?")
        first = chat.first_output_after(t)
        cpu_first = cpu_seconds(chat.proc.pid)
        chat.reply()
        done = time.perf_counter()
        cpu_done = cpu_seconds(chat.proc.pid)
    finally:
        chat.close()
    return {"first_reply_s": round(first - t, 3), "reply_done_s": round(done - t, 3),
            "first_reply_cpu_s": round(cpu_first - cpu, 2), "reply_done_cpu_s": round(cpu_done - cpu, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--after", type=int, default=20, help="growth is measured from the end of this turn")
    ap.add_argument("--max-new-tokens", "-n", type=int, default=16)
    ap.add_argument("--messages", type=int, default=2000, help="messages in the /load conversation")
    ap.add_argument("--compile", default="off", choices=["off", "auto", "on"])
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the chat (OMP_NUM_THREADS; default: torch's, one per core)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.turns and not 1 <= args.after <= args.turns:
        ap.error("--after must be between 1 and --turns (--turns 0 times the /load only)")
    with tempfile.TemporaryDirectory(prefix="clover-soak-") as tmp:
        tmp = Path(tmp)
        stats_file = tmp / "stats.jsonl"
        report = {"date": date.today().isoformat(), "machine": platform.node(), "cpus": os.cpu_count(),
                  "model": args.model or "tiny", "compile": args.compile, "threads": args.threads or "default",
                  "load_average_before": [round(x, 2) for x in os.getloadavg()]}
        if args.turns:
            t0 = time.perf_counter()
            report["soak"] = soak(args, stats_file)
            report["soak"]["wall_s"] = round(time.perf_counter() - t0, 1)
        conv = tmp / "long.json"
        messages = []
        for i in range(args.messages // 2):
            topic = TOPICS[i % len(TOPICS)]
            messages += [{"role": "user", "content": f"What do you know about {topic}? ({i})"},
                         {"role": "assistant", "content": f"A few words about {topic}: it is worth a look. ({i})"}]
        conv.write_text(json.dumps({"messages": messages}))  # not atomic: a scratch file in its own temp directory
        report["load"] = {"messages": len(messages),
                          "cold": load_timing(args, stats_file, conv, warm=False),
                          "warm": load_timing(args, stats_file, conv, warm=True)}
    if args.json:
        print(json.dumps(report))
        return
    s, ld = report.get("soak"), report["load"]
    print(f"{report['date']} · {report['machine']} · {report['cpus']} CPUs · threads {report['threads']} · "
          f"load average before {report['load_average_before']}, after {[round(x, 2) for x in os.getloadavg()]}")
    if s:
        _print_soak(s)
    for k in ("cold", "warm"):
        print(f"/load of {ld['messages']} messages, {k}: first reply byte {ld[k]['first_reply_s']} s "
              f"({ld[k]['first_reply_cpu_s']} s of CPU), reply done {ld[k]['reply_done_s']} s "
              f"({ld[k]['reply_done_cpu_s']} s of CPU)")


def _print_soak(s: dict):
    print(f"{s['turns']} turns of -n {s['max_new_tokens']} ({s['wall_s']} s, median turn {s['median_turn_s']} s, "
          f"{s['median_turn_cpu_s']} s of CPU; context slid: {s['context_slid']})")
    for key, name in (("rss", "RSS"), ("anon", "  of it anonymous"), ("file", "  of it file-backed")):
        if key in s:
            m = s[key]
            print(f"{name}: turn 1 {m['first_mib']} MiB, turn {s['after_turn']} {m['after_mib']} MiB, last "
                  f"{m['last_mib']} MiB, max {m['max_mib']} MiB; growth after turn {s['after_turn']}: "
                  f"{m['growth_after_pct']}% (at most {m['growth_max_after_pct']}%); every 20 turns: "
                  f"{m['every_20_mib']}")


if __name__ == "__main__":
    main()
