"""Two drafters proposing into one tree (MergedDrafter: the default drafter, heads with n-gram lookup), and what it
learns of when its first drafter pays (ChoiceStats)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..tree import DraftTree, merge_trees
from .base import Drafter


class ChoiceStats:
    """Whether a MergedDrafter's step pays for running its first drafter, by how many tokens the second one alone
    expected (bins of that sum of scores).

    Comparing the tokens per second of the steps made each way is noisy: how many tokens a step gives depends far
    more on the text than on the choice (a lookup chain of 8 accepted against none), so a few lucky steps can hold a
    bin on the costlier way for good. The estimate is paired instead. A step that ran both drafters also says what
    the second alone would have given (the accepted path's prefix inside the second's own tree, plus the target's
    next token), so the first drafter's gain is measured on the very same steps, and the tokens the second alone
    gives are averaged over every step of the bin whichever way it went. Per bin, decayed means of those tokens and
    of the gain, and the median seconds of the last SECONDS_WINDOW steps each way (a median, because a rare pause of
    the process, hundreds of times a step, would otherwise hold a bin on the other way for hundreds of decisions).
    A step is timed from its proposal to the end of its verification (the drafters' observe), and only that step
    counts: the engine may make plain steps before it asks again (its idle rule, DraftValue), and those, counted in,
    made a proposal with nothing to verify look many times slower than one with a tree (the bundled model, CPU: 96
    ms against 3.9 ms, so the heads ran at every step where lookup had nothing, for 0.38 tokens; the default drafter
    fell to 0.89x lookup alone; docs/BENCHMARKS.md). Kept apart from the drafter so that it outlives one (clover
    bench makes a fresh drafter every run)."""

    VERSION = 2  # of state(): a state measured another way is not restored

    BINS = (0.5, 1.0, 2.0, 4.0)
    DECAY = 0.9
    SECONDS_WINDOW = 9
    # Every EXPLORE-th decision in a bin goes the other way, so that a change (the text starting to repeat, the
    # compiled step coming in) is noticed; every EXPLORE_FAR-th when that way was more than FAR times slower, every
    # EXPLORE_FARTHER-th when more than FARTHER times (on a CPU where the heads pay in no bin, each such try costs
    # a whole step and more: a one-shot reply of ~30 steps paid ~6% for them at every 32nd; docs/BENCHMARKS.md).
    EXPLORE, EXPLORE_FAR, FAR, EXPLORE_FARTHER, FARTHER = 8, 32, 1.3, 128, 1.6

    def __init__(self):
        self.sums: dict = {}  # key -> decayed [sum, count]: ("alone", bin), ("gain", bin)
        self.seconds: dict[tuple[int, bool], list[float]] = {}  # (bin, way) -> the last SECONDS_WINDOW steps
        self.decisions: dict[int, int] = {}

    def bin(self, expected: float) -> int:
        return sum(expected >= edge for edge in self.BINS)

    def _add(self, key, value: float) -> None:
        s = self.sums.setdefault(key, [0.0, 0.0])
        s[0] = s[0] * self.DECAY + value
        s[1] = s[1] * self.DECAY + 1.0

    def _mean(self, key) -> float | None:
        s = self.sums.get(key)
        return s[0] / s[1] if s else None

    def add(self, where: tuple[int, bool], tokens: int, seconds: float, alone: float | None = None) -> None:
        """A step made `tokens` in `seconds`, running the first drafter or not (`where`: bin, way); `alone`: what
        the second drafter alone would have given (a step without the first: `tokens`)."""
        b, ran = where
        alone = tokens if alone is None or not ran else alone
        self._add(("alone", b), alone)
        if ran:
            self._add(("gain", b), tokens - alone)
        recent = self.seconds.setdefault((b, ran), [])
        recent.append(seconds)
        del recent[:-self.SECONDS_WINDOW]

    def rate(self, b: int, way: bool) -> float | None:
        """Estimated tokens per second of a step in bin b that runs the first drafter (way) or not."""
        alone, recent = self._mean(("alone", b)), self.seconds.get((b, way))
        gain = self._mean(("gain", b)) if way else 0.0
        if alone is None or not recent or gain is None:
            return None
        return (alone + gain) / max(sorted(recent)[len(recent) // 2], 1e-9)

    def state(self) -> dict:
        """What has been learned, as JSON-able data (kept on disk between processes: step.costs.StepCosts.choices_path)."""
        return {"version": self.VERSION, "sums": {f"{kind}/{b}": v for (kind, b), v in self.sums.items()},
                "seconds": {f"{b}/{int(way)}": v for (b, way), v in self.seconds.items()},
                "decisions": {str(b): n for b, n in self.decisions.items()}}

    def restore(self, state: dict) -> None:
        """Start from `state` (from state()); raises ValueError (nothing changed) when it is not one."""
        try:
            if state.get("version") != self.VERSION:
                raise ValueError(f"version {state.get('version')}, not {self.VERSION}")
            sums = {}
            for key, (total, count) in state["sums"].items():
                kind, b = key.split("/")
                total, count = float(total), float(count)
                if kind not in ("alone", "gain") or not (count > 0 and math.isfinite(total) and math.isfinite(count)):
                    raise ValueError(key)
                sums[(kind, int(b))] = [total, count]
            seconds = {}
            for key, values in state["seconds"].items():
                b, way = key.split("/")
                values = [float(v) for v in values][-self.SECONDS_WINDOW:]
                if not values or not all(0 <= v < math.inf for v in values):
                    raise ValueError(key)
                seconds[(int(b), way == "1")] = values
            decisions = {int(b): int(n) for b, n in state["decisions"].items()}
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a ChoiceStats state: {e}") from None
        self.sums, self.seconds, self.decisions = sums, seconds, decisions

    def choose(self, b: int, prior: bool) -> bool:
        """Run the first drafter? The way with the better estimated rate; each way is tried first (the prior
        first), and now and then the way the rates do not favour."""
        n = self.decisions[b] = self.decisions.get(b, 0) + 1
        rate = {way: self.rate(b, way) for way in (prior, not prior)}
        for way, r in rate.items():
            if r is None:
                return way
        best = max(rate, key=lambda way: (rate[way], way == prior))
        ratio = rate[best] / max(rate[not best], 1e-9)
        every = (self.EXPLORE_FARTHER if ratio > self.FARTHER else self.EXPLORE_FAR if ratio > self.FAR else
                 self.EXPLORE)
        return (not best) if n % every == 0 else best


@dataclass
class _Proposal:
    """A MergedDrafter's last proposal, until its step is verified (the next observe): what ChoiceStats learns
    from."""

    bin: int
    ran_first: bool
    since: float  # when it was made (perf_counter)
    second_tree: DraftTree | None  # the second drafter's own tree, kept when the first ran


class MergedDrafter(Drafter):
    """Two drafters proposing into one tree: Clover-2 heads with n-gram lookup (the default when heads exist).

    The heads predict what comes next from the target's hidden state; lookup copies long stretches that already
    occurred in the conversation. Each node keeps the better of the two scores. Whether a step runs the first
    drafter at all (it costs a draft step; lookup is nearly free) is learned when `choices` is given: by what the
    second tree alone expects, the way that gave more tokens per second so far, each step timed from its proposal
    to the end of its verification (ChoiceStats). Otherwise, and before anything is learned, the first is skipped
    when the second alone expects `enough` accepted tokens.
    """

    learns_acceptance = True  # its curve is its drafters'

    def __init__(self, first, second, enough: float | None = None, choices: ChoiceStats | None = None):
        self.first, self.second = first, second
        self.enough = enough  # when the second tree alone expects this many accepted tokens, the first is skipped
        self.choices = choices
        # one learned choice per sampling mode (decode.budget.mode_key): the heads pay far less often against a
        # penalised or sampled target, and a sampled chat must not teach a greedy `clover generate` otherwise
        self.choices_by_mode = {0.0: choices} if choices is not None else {}
        self.name = f"{first.name}+{second.name}"
        self._open: _Proposal | None = None

    def choices_for(self, mode) -> ChoiceStats:
        """Learn under sampling mode `mode` from now on: its own ChoiceStats (made when new), which it returns."""
        self.choices = self.choices_by_mode.setdefault(mode, ChoiceStats())
        return self.choices

    @property
    def primary(self):
        return self.first

    @property
    def max_depth(self) -> int:
        return max(self.first.max_depth, self.second.max_depth)

    @property
    def feature_layers(self):
        return self.first.feature_layers

    @property
    def min_score(self) -> float:
        return self.first.min_score

    @min_score.setter
    def min_score(self, value: float) -> None:
        self.first.min_score = self.second.min_score = value

    @property
    def curve(self):
        return self.first.curve

    @curve.setter
    def curve(self, value) -> None:
        self.first.curve = self.second.curve = value

    def save_learning(self) -> None:
        self.first.save_learning()
        self.second.save_learning()

    def reset(self, length: int) -> None:
        self.first.reset(length)
        self.second.reset(length)
        self._open = None  # a proposal cut off by a reset (an interrupted reply) teaches nothing

    def observe(self, hidden, next_tokens) -> None:
        self.first.observe(hidden, next_tokens)
        self.second.observe(hidden, next_tokens)
        p, self._open = self._open, None
        if p is not None and self.choices is not None:
            tokens = next_tokens.numel()
            # a step that ran both: the second alone would have had the accepted path's prefix inside its own tree,
            # then the target's next token (exact when greedy, an estimate when sampling)
            alone = None if p.second_tree is None else 1 + _accepted_in(p.second_tree, next_tokens[:-1].tolist())
            self.choices.add((p.bin, p.ran_first), tokens, time.perf_counter() - p.since, alone)

    def propose(self, context, budget) -> DraftTree:
        now = time.perf_counter()
        second = self.second.propose(context, budget)
        expected = sum(second.scores[1:])
        prior = self.enough is None or expected < self.enough
        b = self.choices.bin(expected) if self.choices is not None else 0
        run_first = self.choices.choose(b, prior) if self.choices is not None else prior
        self._open = _Proposal(b, run_first, now, second if run_first and self.choices is not None else None)
        if not run_first:
            return second
        # the second tree goes first: its best chain then takes nodes 1, 2, ... and an accepted run of it needs no
        # move in the target's cache
        return merge_trees(second, self.first.propose(context, budget)).prune(budget)


def _accepted_in(tree: DraftTree, accepted: list[int]) -> int:
    """How many of the accepted drafted tokens, in order from the root, are a path of `tree`."""
    kids = tree.children()
    node, n = 0, 0
    for tok in accepted:
        node = next((k for k in kids[node] if tree.tokens[k] == tok), None)
        if node is None:
            break
        n += 1
    return n
