"""`clover stats`: a snapshot of the stats stream (stats.py reads and totals it), or a live dashboard that follows
it until Ctrl-C; the figures are defined in stats.py's docstring."""

from __future__ import annotations

import json
import math
import sys
import time

from .errors import CloverError
from .stats import Aggregate, Follower, read_all, stats_path

SHOWN_ROWS = 16  # depths and accepted lengths the dashboard shows a row each (--json: all)
BAR_WIDTH = 24
SPARK = "▁▂▃▄▅▆▇█"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x, fmt="{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _bar(frac: float, width: int = BAR_WIDTH) -> str:
    frac = min(max(frac, 0.0), 1.0)
    eighths = round(frac * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + ("▏▎▍▌▋▊▉"[part - 1] if part else "")).ljust(width, "·")


def _spark(values: list[float]) -> str:
    if not values:
        return "-"
    top = max(values) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] if v else " " for v in values)


def _ago(t, now) -> str:
    if t is None:
        return "?"
    d = max(0.0, now - t)
    if d < 60:
        return f"{d:.0f}s ago"
    if d < 3600:
        return f"{d / 60:.0f}m ago"
    if d < 86400:
        return f"{d / 3600:.1f}h ago"
    return f"{d / 86400:.1f}d ago"


def render(snap: dict, waiting: str | None = None, max_sessions: int = 12, width: int = 160):
    """A rich renderable of a snapshot: overall figures with bars, then one row per session."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from .render import visible

    now = time.time()
    head = Text()
    head.append("clover stats", style="bold")
    head.append(f" · {visible(str(snap['stats_file']))} · {snap['sessions']} session(s) · {snap['lines']} lines")
    if snap["skipped_lines"]:
        head.append(f" · {snap['skipped_lines']} skipped (truncated or foreign)", style="yellow")
    parts = [head]
    if waiting:
        parts.append(Text(waiting, style="dim"))

    figures = Table.grid(padding=(0, 3))
    for _ in range(6):
        figures.add_column(justify="right")
    figures.add_row(*(Text(x, style="dim") for x in ("acceptance rate", "τ (tokens/step)", "tokens/s",
                                                      "est. speedup", "tokens", "steps")))
    figures.add_row(_pct(snap["acceptance_rate"]), _num(snap["tau"]), _num(snap["tokens_per_s"], "{:.1f}"),
                    _num(snap["speedup"], "{:.2f}×"), str(snap["tokens"]), str(snap["steps"]))

    depth = Table.grid(padding=(0, 1))
    depth.add_column(justify="right", style="dim")
    depth.add_column()
    depth.add_column(justify="right")
    rates = snap["hit_rate_by_depth"]
    for d, rate in enumerate(rates[:SHOWN_ROWS], 1):
        depth.add_row(f"depth {d}", Text(_bar(rate), style="cyan"), f"{100 * rate:5.1f}%")
    if len(rates) > SHOWN_ROWS:  # a deep tree must not print a row per depth: --json has them all
        depth.add_row(f"depths {SHOWN_ROWS + 1}–{len(rates)}", Text("--json lists them", style="dim"), "")
    if not rates:
        depth.add_row("", "no drafted steps yet", "")

    hist = Table.grid(padding=(0, 1))
    hist.add_column(justify="right", style="dim")
    hist.add_column()
    hist.add_column(justify="right")
    counts = snap["accepted_hist"]
    rows = [(f"{a} accepted", c) for a, c in enumerate(counts[:SHOWN_ROWS])]
    if len(counts) > SHOWN_ROWS:  # the longer accepted lengths in one row, not a row each
        rows.append((f"{SHOWN_ROWS}+ accepted", sum(counts[SHOWN_ROWS:])))
    top = max((c for _, c in rows), default=0) or 1
    for label, c in rows:
        hist.add_row(label, Text(_bar(c / top), style="green"), str(c))
    if not counts:
        hist.add_row("", "no steps yet", "")

    bars = Table.grid(padding=(0, 4))
    bars.add_column()
    bars.add_column()
    bars.add_row(Text("hit rate by draft depth", style="bold"), Text("accepted tokens per step", style="bold"))
    bars.add_row(depth, hist)
    parts.append(Panel(Group(figures, Text(""), bars), expand=False, title="overall" if snap["sessions"] != 1 else
                       f"session {visible(str(snap['by_session'][0]['session']))}", title_align="left"))

    sessions = snap["by_session"][-max_sessions:]
    if sessions:
        table = Table(title=None, show_edge=False, pad_edge=False)
        columns = [  # (title, justify, cell); the later ones give way first on a narrow terminal
            ("session", "left", lambda s: s["session"] or "?"),
            ("draft", "left", lambda s: "/".join(s["drafts"]) or "?"),
            ("accept", "right", lambda s: _pct(s["acceptance_rate"])),
            ("τ", "right", lambda s: _num(s["tau"])),
            ("tok/s", "right", lambda s: _num(s["tokens_per_s"], "{:.1f}")),
            ("speedup", "right", lambda s: _num(s["speedup"], "{:.2f}×")),
            ("tokens", "right", lambda s: str(s["tokens"])),
            ("replies", "right", lambda s: str(s["replies"])),
            ("last", "right", lambda s: _ago(s["last"], now)),
            ("command", "left", lambda s: s["command"] or "?"),
            ("hit by depth", "left", lambda s: _spark(s["hit_rate_by_depth"])),
            ("accepted lengths", "left", lambda s: _spark([float(c) for c in s["accepted_hist"]])),
            ("model", "left", lambda s: s["model"] or "?"),
        ]
        rows = [[visible(cell(s)) for _, _, cell in columns] for s in sessions]  # a file's strings, shown inert
        keep, used = 0, 0
        for i, (title, _, _) in enumerate(columns):  # as many whole columns as fit, in order of importance
            need = max([len(title)] + [len(r[i]) for r in rows]) + 3
            if keep >= 2 and used + need > width:
                break
            keep, used = keep + 1, used + need
        for title, just, _ in columns[:keep]:
            table.add_column(title, justify=just, no_wrap=True, overflow="ellipsis")
        for r in rows:
            table.add_row(*r[:keep])
        parts.append(table)
        hidden = len(snap["by_session"]) - len(sessions)
        if hidden > 0:
            parts.append(Text(f"({hidden} older session(s) not shown; --json lists all)", style="dim"))
    return Group(*parts)


def run_stats(stats_file, once, json_out, session, interval):
    """`clover stats`: a snapshot (--once / --json, or when standard output is not a terminal), else a live
    dashboard that follows the stream until Ctrl-C."""
    from rich.console import Console

    path = stats_path(stats_file)
    if path is None:
        raise CloverError("--stats-file off: there is no stream to read")
    if not (math.isfinite(interval) and 0.05 <= interval <= 3600):
        raise CloverError(f"--interval must be between 0.05 and 3600 seconds, not {interval}")
    if path.is_dir():
        raise CloverError(f"{path} is a directory, not a stats file")
    live = not once and not json_out and sys.stdout.isatty()
    if not live and not path.exists():
        raise CloverError(f"no stats file at {path} (chat and generate write it; --stats-file chooses another)")
    for part in (path.with_name(path.name + ".1"), path):  # one that exists but cannot be read is no empty stream
        try:
            open(part, "rb").close()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise CloverError(f"cannot read the stats file {part}: {e.strerror or e}")

    agg = Aggregate()
    read_all(path.with_name(path.name + ".1"), agg)  # the rotated part first: its sessions go on in the file
    if not live:
        read_all(path, agg)
        if session and not agg.select(session):
            raise CloverError(f"no session {session!r} in {path}")
        snap = agg.snapshot(path, session)
        if json_out:
            sys.stdout.write(json.dumps(snap, ensure_ascii=False) + "\n")
        else:
            console = Console(highlight=False)
            console.print(render(snap, width=console.width))
        return

    from rich.live import Live

    console = Console(highlight=False)
    follower = Follower(path)
    for line in follower.poll():
        agg.feed(line)

    def view():
        snap = agg.snapshot(path, session)
        snap["skipped_lines"] += follower.broken
        waiting = None
        if not path.exists():
            waiting = f"waiting for {path} (Ctrl-C to leave)"
        elif session and not snap["by_session"]:
            waiting = f"waiting for session {session} (Ctrl-C to leave)"
        else:
            waiting = "following the stream · Ctrl-C to leave"
        return render(snap, waiting, width=console.width)

    try:
        with Live(view(), console=console, auto_refresh=False, transient=False) as screen:
            while True:
                time.sleep(interval)
                for line in follower.poll():
                    agg.feed(line)
                screen.update(view(), refresh=True)
    except KeyboardInterrupt:
        pass
