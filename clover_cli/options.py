"""What a command line asks of a session: the options, checked without importing torch (a chat's prompt comes up
before the model and its libraries load)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .drafters.names import DRAFTS
from .errors import CloverError

MODES = ("auto", "on", "off")  # --compile, see clover_cli/compiled.py
EARLY_STOPS = ("fixed", "learned")  # --early-stop: how a draft model's branches end (drafters/early_stop.py)


@dataclass
class Options:
    model: str | None = None
    revision: str | None = None
    heads: str | None = None
    draft: str = "auto"
    draft_model: str | None = None  # --draft model's draft model: an alias, a Hub repo id or a directory
    tree: str = "dynamic"
    early_stop: str = "fixed"  # fixed or learned (--draft model and self)
    tree_budget: str = "auto"
    load_in_8bit: bool = False
    load_in_4bit: bool = False
    device: str = "auto"
    device_map: str | None = None  # auto, balanced or a JSON map (accelerate); max_memory caps its devices
    max_memory: str | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    allow_pickle: bool = False
    max_context: int | None = None
    compile: str | None = None  # auto, on or off (None: CLOVER_COMPILE, else auto); see clover_cli/compiled.py


def check_options(opts: Options) -> None:
    """The drafting options' values and combinations, in one line each: checked before anything loads (an
    interactive chat shows its prompt before the model is there)."""
    if opts.draft not in DRAFTS:
        raise CloverError(f"unknown drafter {opts.draft!r}; choose one of {', '.join(DRAFTS)}")
    if opts.tree not in ("dynamic", "static"):
        raise CloverError(f"--tree must be dynamic or static, not {opts.tree!r}")
    if opts.early_stop not in EARLY_STOPS:
        raise CloverError(f"--early-stop must be {' or '.join(EARLY_STOPS)}, not {opts.early_stop!r}")
    if opts.early_stop == "learned" and opts.tree == "static":
        raise CloverError("--tree static drafts a fixed chain with no early stop: --early-stop learned needs "
                          "--tree dynamic")
    if opts.tree == "static" and opts.draft == "ngram":
        raise CloverError("--tree static is the heads' fixed tree shape; the ngram drafter has none "
                          "(use --tree dynamic)")
    parse_budget(opts.tree_budget)


def parse_budget(text: str) -> tuple[int, bool]:
    """'auto' -> (64, True): up to 64 nodes, sized per step by measured cost; 'N' -> (N, False)."""
    if text == "auto":
        return 64, True
    try:
        n = int(text)
    except ValueError:
        raise CloverError(f"--tree-budget must be a whole number or 'auto', not {text!r}")
    if not 0 <= n <= 512:
        raise CloverError(f"--tree-budget must be between 0 and 512, not {n}")
    return n, False


def compile_mode(flag: str | None) -> str:
    """The --compile value, else CLOVER_COMPILE, else auto; a one-line error for anything else."""
    mode = flag or os.environ.get("CLOVER_COMPILE") or "auto"
    if mode not in MODES:
        where = "--compile" if flag else "CLOVER_COMPILE"
        raise CloverError(f"{where} must be auto, on or off, not {mode!r}")
    return mode
