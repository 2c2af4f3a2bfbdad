"""Draft token trees: what a drafter proposes and the target verifies in one forward pass.

Node 0 is the root: the token the target chose last, not yet in the KV cache. Every other node is a drafted token
whose parent comes before it, so a tree is a list ordered parents-first and the ancestor mask is built in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


def long_tensor(values: list[int], device) -> torch.Tensor:
    """A 1-D int64 tensor of `values` on `device` (a torch.device or its name). On a CPU made through numpy: the
    engine makes these right after a forward whose weights have flushed the CPU's caches, and there torch.tensor()
    of a list costs several times as much (docs/BENCHMARKS.md, "The step's glue")."""
    if getattr(device, "type", device) == "cpu":
        return torch.from_numpy(np.array(values, dtype=np.int64))
    return torch.tensor(values, dtype=torch.long, device=device)


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]
    scores: list[float] = field(default_factory=list)  # the drafter's estimate that each node is accepted
    # node -> the distribution its children were sampled from (in their order, without replacement), for q-aware
    # verification under sampling (decode.verify.accept); None: every drafted token is a fixed candidate
    proposals: dict | None = None
    # node -> (its rank among its siblings, its probability given its parent) as the drafter gave them (None where
    # it gives none), before any calibration: what the engine's acceptance curve learns from
    # (decode.budget.AcceptanceCurve)
    drafted: list | None = None

    @staticmethod
    def root_only(root: int) -> "DraftTree":
        return DraftTree([root], [-1], [1.0])

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        d = [0] * len(self.tokens)
        for i in range(1, len(self.tokens)):
            d[i] = d[self.parents[i]] + 1
        return d

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            kids[self.parents[i]].append(i)
        return kids

    def ancestor_mask(self) -> np.ndarray:
        """bool [n, n]: mask[i, j] is True when node j is node i or one of its ancestors."""
        n = len(self.tokens)
        mask = np.zeros((n, n), dtype=bool)
        for i in range(n):
            p = self.parents[i]
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def tensors(self, device, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(tokens, positions = offset + depth, ancestor mask or None for a single chain) on `device`."""
        depths = self.depths()
        tokens = long_tensor(self.tokens, device)
        positions = long_tensor([offset + d for d in depths] if offset else depths, device)
        if depths[-1] == len(depths) - 1:  # as deep as it has nodes: a single chain, causal
            return tokens, positions, None
        return tokens, positions, torch.from_numpy(self.ancestor_mask()).to(device)

    def prune(self, budget: int) -> "DraftTree":
        """Keep the root and the `budget` best-scoring nodes whose ancestors are all kept.

        Scores never grow along a path (a node's score is its path probability), so the best nodes form a tree;
        ties go to the earlier node, which keeps parents ahead of their children. A pruned tree keeps no proposals:
        which sampled candidates survive depends on their values, so they are verified as fixed tokens (still exact).
        """
        if len(self.tokens) <= budget + 1:
            return self
        order = sorted(range(1, len(self.tokens)), key=lambda i: (-self.scores[i], i))
        keep = {0}
        for i in order:
            if len(keep) > budget:
                break
            if self.parents[i] in keep:
                keep.add(i)
        kept = sorted(keep)
        new_index = {old: new for new, old in enumerate(kept)}
        return DraftTree(
            tokens=[self.tokens[i] for i in kept],
            parents=[new_index[self.parents[i]] if i else -1 for i in kept],
            scores=[self.scores[i] for i in kept],
            drafted=[self.drafted[i] for i in kept] if self.drafted is not None else None,
        )

    def validate(self):
        assert len(self.tokens) == len(self.parents) and self.parents[0] == -1
        for i in range(1, len(self.tokens)):
            assert 0 <= self.parents[i] < i, "parents must come before their children"
        kids = self.children()
        for k in kids:
            toks = [self.tokens[c] for c in k]
            assert len(toks) == len(set(toks)), "siblings must be distinct tokens"


class TreeBuilder:
    """Collect candidate nodes (parents first), then keep the root and the best `budget` of them.

    A node's score is the drafter's estimate that the target accepts it (its path probability), which never
    exceeds its parent's, so the best nodes form a tree; a node whose parent was dropped is dropped too.
    """

    def __init__(self, root: int):
        self.tokens, self.parents, self.scores = [root], [-1], [1.0]
        self.drafted: list | None = None  # the drafter's own (rank, probability) of each node, when it gives them

    def add(self, parent: int, token: int, score: float, drafted: tuple[int, float] | None = None) -> int:
        if drafted is not None and self.drafted is None:
            self.drafted = [None] * len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        if self.drafted is not None:
            self.drafted.append(drafted)
        return len(self.tokens) - 1

    def build(self, budget: int) -> DraftTree:
        return DraftTree(self.tokens, self.parents, self.scores, drafted=self.drafted).prune(budget)


def merge_trees(a: DraftTree, b: DraftTree) -> DraftTree:
    """The union of two trees with the same root: shared paths once, each node scored by the better estimate.

    Scores stay non-increasing along every path (a node never outscores its parent), so prune() still applies.
    A node's drafter (rank, probability) (`drafted`) is the first tree's where it has one, else the second's.
    """
    assert a.tokens[0] == b.tokens[0], "trees to merge must share their root"
    tokens, parents, scores = [a.tokens[0]], [-1], [1.0]
    drafted: list = [None]
    kids: list[dict[int, int]] = [{}]

    def add(tree: DraftTree):
        where = {0: 0}  # node of `tree` -> node of the union
        for i in range(1, len(tree)):
            parent = where[tree.parents[i]]
            tok = tree.tokens[i]
            node = kids[parent].get(tok)
            if node is None:
                node = len(tokens)
                kids[parent][tok] = node
                kids.append({})
                tokens.append(tok)
                parents.append(parent)
                scores.append(0.0)
                drafted.append(None)
            scores[node] = min(scores[parent], max(scores[node], tree.scores[i]))
            if drafted[node] is None and tree.drafted is not None:
                drafted[node] = tree.drafted[i]
            where[i] = node

    add(a)
    add(b)
    has = a.drafted is not None or b.drafted is not None
    return DraftTree(tokens, parents, scores, drafted=drafted if has else None)
