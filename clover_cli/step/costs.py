"""What verifying n tokens costs (StepCosts): measured once and kept on disk (clover_cli/store.py says where), per
model, device, dtype, thread count and step (eager or compiled), and the default drafter's learned choices kept
beside them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import atomic
from ..store import choices_path, costs_path, read_cache_json
from .aot import _seconds

if TYPE_CHECKING:
    from .manager import StepCompiler


def cost_table(data) -> dict[int, float]:
    """A stored table of step costs ({"n": seconds}) as {n: seconds}; ValueError when it is not one."""
    if not isinstance(data, dict):
        raise ValueError("not a table")
    table = {}
    for k, v in data.items():
        if not (k.isdigit() and 0 < int(k) <= 1 << 16 and _seconds(v)):
            raise ValueError(f"entry {k[:20]!r}")
        table[int(k)] = float(v)
    return table


class StepCosts:
    """What verifying n tokens costs, measured once and kept on disk per model, device, dtype, thread count and
    step (eager or compiled), so a new process sizes its trees without timing its own forwards again. The engine
    refreshes the table from the forwards it runs and saves it back after each reply."""

    def __init__(self, model_path: Path, device: torch.device, dtype: torch.dtype, compiler: StepCompiler | None):
        self.model_path, self.device, self.dtype, self.compiler = Path(model_path), device, dtype, compiler

    @property
    def padded(self) -> bool:
        """The compiled step runs a tree as the next of its SIZES: costs are steps between the table's sizes."""
        return self.compiler is not None and self.compiler.active

    def _path(self) -> Path:
        from ..packed import supported

        return costs_path(self.model_path, self.device, self.dtype, "compiled" if self.padded else "eager",
                          supported(), self.compiler.weights if self.compiler is not None else "float")

    def load(self) -> dict[int, float] | None:
        table = read_cache_json(self._path(), cost_table)
        if not table and self.compiler is not None and self.compiler.active:
            table = dict(self.compiler.verify_s or {})  # measured by the builder
        return table or None

    def reference(self) -> dict[int, float] | None:
        """Costs of every size measured back to back: the compiled package's, taken when it was built (the stored
        table's sizes may have been timed at different moments, some long ago); None when eager."""
        if self.padded and self.compiler.verify_s:
            return dict(self.compiler.verify_s)
        return None

    def save(self, table: dict[int, float]) -> None:
        try:
            atomic.write_text(self._path(), json.dumps({str(k): v for k, v in sorted(table.items())}))
        except OSError:
            pass  # a cache that cannot be written only costs the next process a measurement

    def choices_path(self, heads_path: Path, repetition_penalty: float = 1.0, temperature: float = 0.0,
                     int8: bool = False) -> Path:
        """Where the default drafter's learned choice (drafters.ChoiceStats: when a step pays for running the heads)
        is kept: beside this table (store.choices_path: per heads, sampling mode, and heads of 8-bit integers)."""
        return choices_path(self._path(), heads_path, repetition_penalty, temperature, int8)

    @staticmethod
    def load_choices(choices, path: Path) -> None:
        """Restore `choices` from `path` (choices_path) when it holds a state (a missing or damaged file leaves them
        as they are: only the learning starts over)."""
        def restore(state):
            if isinstance(state, dict) and state.get("version") != getattr(choices, "VERSION", None):
                return  # learned by another version of clover: started over, nothing to say
            choices.restore(state)

        read_cache_json(path, restore)

    @staticmethod
    def save_choices(choices, path: Path) -> None:
        try:
            atomic.write_text(path, json.dumps(choices.state()))
        except OSError:
            pass


