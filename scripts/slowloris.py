"""Slow-loris against `clover serve`: many connections that send their request head a byte every few seconds.

Starts `clover serve MODEL` (its standard error kept in a file), opens --connections connections from --workers
processes (each its own open-files limit), each sending `GET /health HTTP/1.1` and then one header byte every
--interval seconds; with --reconnect a connection the server closed is opened again on the next round, as a
persistent attacker would. Meanwhile a fresh client asks GET /health every half second. Prints the /health
latencies, how many attack connections the server kept open, its open files and RSS, and the bytes it wrote to
standard error.

    ulimit -n 20000; python scripts/slowloris.py --connections 20000 --seconds 40

Issue #45 measured, before clover's header timeout and connection cap: 20,000 such connections exhausted the
server's descriptors, /health timed out, and asyncio logged 468,991 tracebacks (190 MB of stderr) in 40 s.
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing as mp
import os
import re
import resource
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def raise_open_files():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def attacker(port: int, n: int, interval: float, seconds: float, reconnect: bool, ramp: float, out):
    """n slow connections for `seconds` (opened over `ramp` seconds, at once if 0); reports (opened, closed by the
    server, open at the end)."""
    raise_open_files()
    socks: list[socket.socket | None] = [None] * n
    opened = closed = 0
    sel = selectors.DefaultSelector()

    def connect(i):
        nonlocal opened
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect_ex(("127.0.0.1", port))
        except OSError:
            s.close()
            return
        socks[i] = s
        opened += 1
        sel.register(s, selectors.EVENT_READ, i)

    begin = time.monotonic()
    for i in range(n):
        if ramp:
            time.sleep(max(0.0, begin + ramp * i / n - time.monotonic()))
        connect(i)
    end = begin + seconds
    sent_head = [False] * n
    while time.monotonic() < end:
        t0 = time.monotonic()
        for i, s in enumerate(socks):
            if s is None:
                if reconnect:
                    connect(i)
                continue
            try:
                s.send(b"X-a: b\r\n"[:1] if sent_head[i] else b"GET /health HTTP/1.1\r\nHost: x\r\n")
                sent_head[i] = True
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                sel.unregister(s)
                s.close()
                socks[i], sent_head[i] = None, False
                closed += 1
        # what the server closed: a read of 0 bytes (or an error)
        for key, _ in sel.select(timeout=0):
            i = key.data
            s = socks[i]
            try:
                data = s.recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                sel.unregister(s)
                s.close()
                socks[i], sent_head[i] = None, False
                closed += 1
        time.sleep(max(0.0, interval - (time.monotonic() - t0)))
    out.put((opened, closed, sum(s is not None for s in socks)))


def health(port: int, timeout: float = 10.0) -> float | str:
    """Seconds GET /health took, or why it failed."""
    t0 = time.monotonic()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        conn.close()
    except (OSError, http.client.HTTPException) as e:
        return f"{type(e).__name__} after {time.monotonic() - t0:.1f} s"
    return time.monotonic() - t0 if status == 200 else f"HTTP {status}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="tiny")
    ap.add_argument("--connections", type=int, default=20000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--reconnect", action="store_true")
    ap.add_argument("--ramp", type=float, default=0.0, help="open the connections over this many seconds")
    ap.add_argument("--serve-args", default="", help="more options for clover serve, e.g. '--header-timeout 5'")
    args = ap.parse_args()
    import psutil

    raise_open_files()
    err_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"slowloris-serve-{os.getpid()}.err"
    err = open(err_path, "wb")  # not atomic: the server's stderr, streamed into it as it runs
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    launcher = os.environ.get("SLOWLORIS_SERVER", "-m clover_cli").split()
    server = subprocess.Popen([sys.executable, *launcher, "serve", args.model, "--port", "0",
                               "--stats-file", "off", *args.serve_args.split()], env=env, stdout=subprocess.DEVNULL,
                              stderr=err, cwd=ROOT)
    while not (m := re.search(rb"http://[^:]+:(\d+)/v1", err_path.read_bytes())):
        assert server.poll() is None, err_path.read_text()
        time.sleep(0.2)
    port = int(m.group(1))
    banner = err_path.stat().st_size
    proc = psutil.Process(server.pid)
    rss0 = proc.memory_info().rss
    print(f"server up on port {port}: RSS {rss0 >> 20} MiB, {proc.num_fds()} open files")

    out = mp.Queue()
    per = args.connections // args.workers
    workers = [mp.Process(target=attacker, args=(port, per, args.interval, args.seconds, args.reconnect, args.ramp,
                                                  out))
               for _ in range(args.workers)]
    for w in workers:
        w.start()
    lat, failed, slow, fds, rss = [], [], [], [], []
    start = time.monotonic()
    end = start + args.seconds
    while time.monotonic() < end:
        t = time.monotonic() - start
        got = health(port)
        if isinstance(got, str):
            failed.append(f"at {t:.1f} s: {got}")
        else:
            lat.append(got)
            if got > 1:
                slow.append(f"at {t:.1f} s: {got:.1f} s")
        fds.append(proc.num_fds())
        rss.append(proc.memory_info().rss)
        time.sleep(0.5)
    results = [out.get(timeout=60) for _ in workers]
    for w in workers:
        w.join(30)
    after = health(port)
    server.send_signal(2)
    server.wait(30)
    err.close()
    logged = err_path.stat().st_size - banner
    lat.sort()
    print(f"attack: {args.connections} connections (opened {f'over {args.ramp:g} s' if args.ramp else 'at once'}), "
          f"a byte every {args.interval:g} s for {args.seconds:g} s{', reconnecting' if args.reconnect else ''}")
    print(f"opened {sum(r[0] for r in results)}, closed by the server {sum(r[1] for r in results)}, "
          f"still open at the end {sum(r[2] for r in results)}")
    after = after if isinstance(after, str) else f"{1000 * after:.0f} ms"
    if lat:
        print(f"/health: {len(lat)} answered, {len(failed)} failed; latency median {1000 * lat[len(lat) // 2]:.0f} "
              f"ms, max {1000 * lat[-1]:.0f} ms; after the attack {after}")
    else:
        print(f"/health: none answered ({len(failed)} failed)")
    for line in failed:
        print(f"  failed {line}")
    for line in slow:
        print(f"  over 1 s {line}")
    print(f"server: open files max {max(fds)}, RSS {rss0 >> 20} -> max {max(rss) >> 20} MiB; "
          f"stderr during the attack {logged} bytes ({err_path})")


if __name__ == "__main__":
    main()
