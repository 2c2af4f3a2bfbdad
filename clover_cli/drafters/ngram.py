"""Training-free drafting for any model: prompt lookup plus adaptive tri-gram statistics.

Prompt lookup (as in prompt-lookup / aggressive decoding): find earlier places where the last n tokens (n = 4..1,
longest first) occurred in the conversation and propose what followed them. The tri-gram statistics (as in
ADED) count, over everything this session has seen, the model's own replies included, which token followed each
pair of tokens; their most likely chain is proposed too. Both go into one trie rooted at the current token.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from ..tree import DraftTree, TreeBuilder


class NgramDrafter:
    name = "ngram"

    def __init__(self, max_n: int = 4, max_depth: int = 8, matches: int = 4, decay: float = 0.8):
        self.max_n, self.max_depth, self.matches, self.decay = max_n, max_depth, matches, decay
        self.tokens: list[int] = []
        self.index: dict[tuple, list[int]] = defaultdict(list)
        self.trigrams: dict[tuple, Counter] = defaultdict(Counter)  # session-wide, survives resets

    def reset(self, length: int) -> None:
        pass  # propose() re-synchronises with the context it is given

    def observe(self, hidden, next_tokens) -> None:
        pass  # the statistics come from the context itself

    def _sync(self, context: list[int]) -> None:
        n = len(self.tokens)
        if n > len(context) or self.tokens != context[:n]:
            self.tokens, self.index, n = [], defaultdict(list), 0
            learn = False  # a rewritten conversation: index it again, but count its tri-grams only once
        else:
            learn = True
        for i in range(n, len(context)):
            self.tokens.append(context[i])
            for k in range(1, self.max_n + 1):
                if i - k + 1 >= 0:
                    self.index[tuple(context[i - k + 1:i + 1])].append(i)
            if learn and i >= 2:
                self.trigrams[(context[i - 2], context[i - 1])][context[i]] += 1

    def _lookup(self, context: list[int]) -> list[list[int]]:
        last = len(context) - 1
        for k in range(min(self.max_n, len(context)), 0, -1):
            ends = [p for p in self.index.get(tuple(context[-k:]), ()) if p < last]
            if ends:
                picked = ends[::-1][: self.matches]
                return [context[p + 1:p + 1 + self.max_depth] for p in picked]
        return []

    def _trigram_chain(self, context: list[int]) -> tuple[list[int], list[float]]:
        chain, probs = [], []
        a, b = (context[-2], context[-1]) if len(context) >= 2 else (None, context[-1])
        for _ in range(self.max_depth):
            counts = self.trigrams.get((a, b))
            if not counts:
                break
            tok, c = counts.most_common(1)[0]
            p = c / sum(counts.values())
            if p < 0.1:
                break
            chain.append(tok)
            probs.append(p)
            a, b = b, tok
        return chain, probs

    def propose(self, context, budget) -> DraftTree:
        """A trie of the looked-up continuations and the tri-gram chain. A node's score is the share of earlier
        matches that continued through it (or the chain's tri-gram probability), times decay per depth."""
        self._sync(context)
        kids: list[dict[int, int]] = [{}]
        tokens, parents, depth, score = [context[-1]], [-1], [0], [1.0]

        def child(node: int, tok: int) -> int:
            if tok not in kids[node]:
                kids[node][tok] = len(tokens)
                kids.append({})
                tokens.append(tok)
                parents.append(node)
                depth.append(depth[node] + 1)
                score.append(0.0)
            return kids[node][tok]

        found = self._lookup(context)
        mass = [0.0]
        for seq in found:
            node = 0
            for tok in seq:
                node = child(node, tok)
                mass.extend([0.0] * (len(tokens) - len(mass)))
                mass[node] += 1.0 / len(found)
        mass.extend([0.0] * (len(tokens) - len(mass)))
        for i in range(1, len(tokens)):
            score[i] = mass[i] * self.decay ** depth[i]
        chain, probs = self._trigram_chain(context)
        node, p_path = 0, 1.0
        for tok, p in zip(chain, probs):
            node = child(node, tok)
            p_path *= p * self.decay
            score[node] = max(score[node], p_path)
        builder = TreeBuilder(context[-1])
        for i in range(1, len(tokens)):
            builder.add(parents[i], tokens[i], min(score[i], builder.scores[parents[i]]))
        return builder.build(budget)
