"""Drafters propose token trees for the target to verify. Every drafter implements the same small protocol.

The engine keeps the drafter in step with the target's committed tokens:

    reset(length)          forget everything from position `length` on (a new or edited conversation)
    observe(hidden, next)  the target committed positions p..p+m-1: hidden[i] is its pre-norm last hidden state
                           at position p+i, next[i] the token at position p+i+1 (the last one is the new root)
    propose(context, n)    a DraftTree rooted at context[-1] (the root) with at most n drafted nodes

`context` is every token so far, the root included.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..tree import DraftTree

NAMES = ("clover", "medusa", "eagle", "eagle3", "ngram", "none")


class Drafter(Protocol):
    name: str

    def reset(self, length: int) -> None: ...

    def observe(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None: ...

    def propose(self, context: list[int], budget: int) -> DraftTree: ...


class NoDrafter:
    """Plain decoding through the same engine: the tree is just the root."""

    name = "none"

    def reset(self, length: int) -> None:
        pass

    def observe(self, hidden, next_tokens) -> None:
        pass

    def propose(self, context, budget) -> DraftTree:
        return DraftTree.root_only(context[-1])


class ChoiceStats:
    """Tokens per second of the steps a MergedDrafter made with and without its first drafter, by how many tokens
    the second one alone expected (bins of that sum of scores): decayed sums of tokens and seconds per (bin, choice).
    Kept apart from the drafter so that it outlives one (clover bench makes a fresh drafter every run)."""

    BINS = (0.5, 1.0, 2.0, 4.0)
    DECAY = 0.9
    # Every EXPLORE-th decision in a bin goes the other way, so that a change (the text starting to repeat, the
    # compiled step coming in) is noticed; every EXPLORE_FAR-th when that way was more than FAR times slower.
    EXPLORE, EXPLORE_FAR, FAR = 8, 32, 1.3

    def __init__(self):
        self.sums: dict[tuple[int, bool], list[float]] = {}
        self.decisions: dict[int, int] = {}

    def bin(self, expected: float) -> int:
        return sum(expected >= edge for edge in self.BINS)

    def add(self, where: tuple[int, bool], tokens: int, seconds: float) -> None:
        s = self.sums.setdefault(where, [0.0, 0.0])
        s[0] = s[0] * self.DECAY + tokens
        s[1] = s[1] * self.DECAY + seconds

    def choose(self, b: int, prior: bool) -> bool:
        """Run the first drafter? The way with the better measured rate; each way is tried first (the prior
        first), and now and then the way the rates do not favour."""
        n = self.decisions[b] = self.decisions.get(b, 0) + 1
        seen = {way: self.sums.get((b, way)) for way in (prior, not prior)}
        for way, s in seen.items():
            if s is None:
                return way
        rate = {way: s[0] / max(s[1], 1e-9) for way, s in seen.items()}
        best = max(rate, key=lambda way: (rate[way], way == prior))
        every = self.EXPLORE_FAR if rate[best] > self.FAR * rate[not best] else self.EXPLORE
        return (not best) if n % every == 0 else best


class MergedDrafter:
    """Two drafters proposing into one tree: Clover-2 heads with n-gram lookup (the default when heads exist).

    The heads predict what comes next from the target's hidden state; lookup copies long stretches that already
    occurred in the conversation. Each node keeps the better of the two scores. Whether a step runs the first
    drafter at all (it costs a draft step; lookup is nearly free) is learned when `choices` is given: by what the
    second tree alone expects, the way that gave more tokens per second so far, timed from one proposal to the
    next (ChoiceStats). Otherwise, and before anything is learned, the first is skipped when the second alone
    expects `enough` accepted tokens.
    """

    def __init__(self, first, second, enough: float | None = None, choices: ChoiceStats | None = None):
        self.first, self.second = first, second
        self.enough = enough  # when the second tree alone expects this many accepted tokens, the first is skipped
        self.choices = choices
        self.name = f"{first.name}+{second.name}"
        self.max_depth = max(getattr(first, "max_depth", 1), getattr(second, "max_depth", 1))
        self._open: list | None = None  # [bin, ran the first, proposal time, tokens since] of the last proposal

    @property
    def min_score(self) -> float:
        return getattr(self.first, "min_score", 0.0)

    @min_score.setter
    def min_score(self, value: float) -> None:
        for d in (self.first, self.second):
            if hasattr(d, "min_score"):
                d.min_score = value

    @property
    def curve(self):
        return getattr(self.first, "curve", None)

    @curve.setter
    def curve(self, value) -> None:
        for d in (self.first, self.second):
            if hasattr(d, "curve"):
                d.curve = value

    def reset(self, length: int) -> None:
        self.first.reset(length)
        self.second.reset(length)
        self._open = None  # the time to the next proposal includes a prefill: not a step's

    def observe(self, hidden, next_tokens) -> None:
        self.first.observe(hidden, next_tokens)
        self.second.observe(hidden, next_tokens)
        if self._open is not None:
            self._open[3] += next_tokens.numel()

    def propose(self, context, budget) -> DraftTree:
        from time import perf_counter

        from ..tree import merge_trees

        now = perf_counter()
        if self._open is not None and self._open[3] and self.choices is not None:
            b, ran, since, tokens = self._open
            self.choices.add((b, ran), tokens, now - since)
        second = self.second.propose(context, budget)
        expected = sum(second.scores[1:])
        prior = self.enough is None or expected < self.enough
        b = self.choices.bin(expected) if self.choices is not None else 0
        run_first = self.choices.choose(b, prior) if self.choices is not None else prior
        self._open = [b, run_first, now, 0]
        if not run_first:
            return second
        # the second tree goes first: its best chain then takes nodes 1, 2, ... and an accepted run of it needs no
        # move in the target's cache
        return merge_trees(second, self.first.propose(context, budget)).prune(budget)
