"""A learned early stop for the branches of a draft model's tree (issue #16 item 3, after MCSD's decision models).

The fixed rule ends a branch where the draft gives its next token less than a set probability. Whether the target
will accept that token depends on more than that number: how sure the draft is overall (the entropy of its
distribution), how deep the branch already is, and how well the draft has been doing in this conversation. A
logistic regression on those predicts, for a node the draft is about to add, the chance that the target accepts it
given that its parent was accepted:

    P(accept) = sigmoid(w . [1, p, log p, entropy, depth / 8, recent])

where p is the draft's probability of the node's token, entropy that of the draft's distribution it was drawn from,
depth the node's depth and recent the running rate at which drafted nodes whose parent was accepted were accepted.
A branch goes on while the prediction is at least `threshold` (and the node would pay for its verification); the
prediction is the node's score, so the engine's pruning reads calibrated chances instead of raw draft
probabilities.

It is fitted online, from what the target went on to produce: at each proposal the previous tree is compared with the
tokens committed since (the accepted path and the next token), and every drafted node whose parent was on the
accepted path gets a label: accepted or not. After every REFIT new labels the weights are refitted (Newton steps on a
window of the last WINDOW labels, a little L2). Until MIN_FIT labels have been seen the fixed rule is used. The
model belongs to the draft model (its runner): the drafters a session or a benchmark makes afresh keep learning it.
A session also keeps it on disk (`store.early_stop_path`: per target and draft model, by their files), so the next
process starts from what the last one learned instead of the fixed rule.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..store import read_cache_json

FEATURES = ("bias", "p", "log p", "entropy", "depth / 8", "recent")


class EarlyStop:
    WINDOW = 4096  # labels kept for a fit
    REFIT = 64  # new labels between two fits
    MIN_FIT = 128  # labels before the fitted model replaces the fixed rule
    L2 = 1e-2
    STORED = 1024  # labels kept on disk (a quarter of the window: a file of ~60 KB, written after each reply)

    def __init__(self, threshold: float = 0.3):
        self.threshold = threshold
        self.x: list[list[float]] = []
        self.y: list[float] = []
        self.w: torch.Tensor | None = None
        self.recent = 0.5  # running acceptance of labelled nodes
        self._new = 0  # labels since the last fit
        self._last = None  # what the last proposal drafted (see remember)
        self._unsaved = False  # labels added since the last load or save

    @property
    def ready(self) -> bool:
        return self.w is not None

    def features(self, p: float, entropy: float, depth: int) -> list[float]:
        return [1.0, p, math.log(max(p, 1e-9)), entropy, depth / 8.0, self.recent]

    def predict(self, rows: list[list[float]]) -> list[float]:
        """P(accept) of each feature row (the fitted model must be ready)."""
        x = torch.tensor(rows, dtype=torch.float64)
        return torch.sigmoid(x @ self.w).tolist()

    def remember(self, context: list[int], parents: list[int], tokens: list[int], rows: dict[int, list[float]]):
        """The tree just proposed after `context` (its nodes' parents and tokens) and the feature rows of the nodes
        the decision was made for: labelled at the next proposal."""
        self._last = (len(context), context[-16:], list(parents), list(tokens), rows)

    def learn(self, context: list[int]) -> None:
        """Label the last proposal's nodes from what the target committed since (`context` now), and refit now and
        then. A context that does not continue the last one (an edit, a new conversation) labels nothing."""
        if self._last is None:
            return
        n, tail, parents, tokens, rows = self._last
        self._last = None
        if len(context) <= n or context[n - len(tail):n] != tail:
            return
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(parents[1:], 1):
            children.setdefault(parent, []).append(node)
        node = 0
        for tok in context[n:]:
            nxt = None
            for c in children.get(node, ()):
                if c in rows:
                    hit = tokens[c] == tok
                    self._add(rows[c], hit)
                    nxt = c if hit else nxt
            if nxt is None:
                break
            node = nxt
        if self._new >= self.REFIT and len(self.y) >= self.MIN_FIT:
            self.fit()

    def _add(self, row: list[float], hit: bool) -> None:
        self.x.append(row)
        self.y.append(1.0 if hit else 0.0)
        del self.x[:-self.WINDOW], self.y[:-self.WINDOW]
        self.recent = 0.95 * self.recent + 0.05 * (1.0 if hit else 0.0)
        self._new += 1
        self._unsaved = True

    def state(self) -> dict:
        """What has been learned, as JSON-able data: the weights, the running acceptance and the label window."""
        return {"features": list(FEATURES), "threshold": self.threshold,
                "w": None if self.w is None else self.w.tolist(), "recent": self.recent,
                "x": [[round(v, 6) for v in row] for row in self.x[-self.STORED:]], "y": self.y[-self.STORED:]}

    def restore(self, state: dict) -> None:
        """Start from `state` (from state()); ValueError, with nothing changed, when it is not one."""
        try:
            if list(state["features"]) != list(FEATURES):
                raise ValueError("other features")
            w = None if state["w"] is None else torch.tensor([float(v) for v in state["w"]], dtype=torch.float64)
            x = [[float(v) for v in row] for row in state["x"]][-self.WINDOW:]
            y = [float(v) for v in state["y"]][-self.WINDOW:]
            recent = float(state["recent"])
            if (w is not None and (w.numel() != len(FEATURES) or not torch.isfinite(w).all())
                    or len(x) != len(y) or any(len(row) != len(FEATURES) for row in x)
                    or not all(math.isfinite(v) for row in x for v in row) or any(v not in (0.0, 1.0) for v in y)
                    or not 0.0 <= recent <= 1.0):
                raise ValueError("values out of range")
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not an EarlyStop state: {e}") from None
        self.w, self.x, self.y, self.recent = w, x, y, recent
        self._new, self._last, self._unsaved = 0, None, False

    def load(self, path: Path | None) -> bool:
        """Restore from `path` when it holds a state (a missing or damaged file leaves this as it is)."""
        if path is None:
            return False
        return read_cache_json(Path(path), lambda state: self.restore(state) or True) is not None

    def save(self, path: Path | None) -> None:
        """Write the state to `path` when labels were added since it was loaded or last saved (a reply that
        learned nothing, a sampled one, writes nothing)."""
        if path is None or not self._unsaved:
            return
        from .. import atomic

        try:
            atomic.write_text(Path(path), json.dumps(self.state()))
            self._unsaved = False
        except OSError:
            pass  # a cache that cannot be written only costs the next process its learning

    def fit(self, steps: int = 8) -> None:
        """Logistic regression by Newton's method (float64, L2 on all but the bias)."""
        x = torch.tensor(self.x, dtype=torch.float64)
        y = torch.tensor(self.y, dtype=torch.float64)
        w = self.w.clone() if self.w is not None else torch.zeros(x.shape[1], dtype=torch.float64)
        reg = torch.full((x.shape[1],), self.L2 * len(y), dtype=torch.float64)
        reg[0] = 0.0
        for _ in range(steps):
            p = torch.sigmoid(x @ w)
            grad = x.T @ (p - y) + reg * w
            hess = (x.T * (p * (1 - p))) @ x + torch.diag(reg) + 1e-9 * torch.eye(x.shape[1], dtype=torch.float64)
            w = w - torch.linalg.solve(hess, grad)
        if torch.isfinite(w).all():
            self.w = w
        self._new = 0
