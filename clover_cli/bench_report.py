"""What `clover bench` shows of its report: the table (with the per-category one and the mismatches) and --plot's
image (speed-up per method, acceptance per draft depth)."""

from __future__ import annotations

import sys
from pathlib import Path

from . import atomic
from .errors import CloverError


def print_table(report: dict):
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"clover bench · {report['model']} · {report['device']} {report['dtype']} · "
                    f"{report['prompts']} prompts x {report['max_new_tokens']} tokens · "
                    f"{'compiled' if report['compiled'] else 'eager'} step")
    for col in ("method", "tok/s", "tok/s e2e", "τ", "accept by depth", "vs hf", "vs plain", "= hf", "= plain"):
        t.add_column(col, justify="right" if col not in ("method", "accept by depth") else "left")
    for r in report["methods"]:
        ident = {True: "yes", False: f"NO ({len(r['mismatches'])})", None: "-"}[r["identical"]]
        plain = {True: "yes", False: f"NO ({len(r.get('unlike_plain', []))})", None: "-"}[r.get("same_as_plain")]
        t.add_row(r["method"], f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s_e2e']:.1f}",
                  "-" if r["tau"] is None else f"{r['tau']:.2f}",
                  " ".join(f"{a:.2f}" for a in r["accept_by_depth"][:6]) or "-",
                  "-" if r["speedup_vs_hf"] is None else f"{r['speedup_vs_hf']:.2f}x",
                  "-" if r["speedup_vs_plain"] is None else f"{r['speedup_vs_plain']:.2f}x", ident, plain)
    console = Console() if sys.stdout.isatty() else Console(width=150)
    console.print(t)
    if "llama_cpp" in report:
        peer = report["llama_cpp"]
        console.print(f"llama.cpp: llama-cpp-python {peer['version']}, {peer['threads']} threads, float32 weights "
                      f"and KV cache, lookup {peer['lookup_tokens']} tokens; GGUF {peer['gguf']}"
                      + (f"; draft: its greedy chain of up to {peer['draft_tokens']} tokens, GGUF {peer['draft_gguf']}"
                         if "draft_gguf" in peer else ""), soft_wrap=True)
    cats = report.get("by_category", {})
    if len(cats) > 1:
        names = [r["method"] for r in report["methods"]]
        ct = Table(title="by category: τ (tokens per step) · tok/s")
        ct.add_column("category")
        ct.add_column("prompts", justify="right")
        for m in names:
            ct.add_column(m, justify="right")
        for cat, per in cats.items():
            cells = [("-" if per[m]["tau"] is None else f"{per[m]['tau']:.2f}") + f" · {per[m]['tokens_per_s']:.1f}"
                     for m in names]
            ct.add_row(cat, str(per[names[0]]["prompts"]), *cells)
        console.print(ct)
    for r in report["methods"]:
        if r["mismatches"]:
            console.print(f"[red]{r['method']}: output differs from hf greedy on {', '.join(r['mismatches'])}[/]")


def plot(report: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["methods"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["method"] for r in rows]
    a.bar(names, [r["speedup_vs_hf"] or 0 for r in rows], color="#3b7dd8")
    a.axhline(1.0, color="gray", lw=0.8)
    a.tick_params(axis="x", labelrotation=35)
    a.set_ylabel("speedup vs hf (decode tok/s)")
    a.set_title(f"{report['model']} · {report['device']}")
    for r in rows:
        if r["accept_by_depth"]:
            b.plot(range(1, len(r["accept_by_depth"]) + 1), r["accept_by_depth"], marker="o", label=r["method"])
    b.set_xlabel("draft depth")
    b.set_ylabel("acceptance (accepted path reached depth)")
    b.set_ylim(0, 1)
    if b.lines:
        b.legend()
    fig.tight_layout()
    fmt = plot_format(path)  # the temporary file's name says nothing: the target's does
    try:
        atomic.write_with(Path(path), lambda tmp: fig.savefig(tmp, dpi=110, format=fmt))
    except OSError as e:
        raise CloverError(f"cannot write the plot {path}: {e.strerror or e}")
    finally:
        plt.close(fig)


def plot_format(path: Path) -> str:
    """The image format --plot writes, from its suffix (PNG without one)."""
    from matplotlib.backend_bases import FigureCanvasBase

    fmt = Path(path).suffix[1:].lower() or "png"
    if fmt not in FigureCanvasBase.get_supported_filetypes():
        raise CloverError(f"--plot {path}: matplotlib cannot write .{fmt} files (use .png)")
    return fmt
