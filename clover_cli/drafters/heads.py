"""Drafters that run trained heads on the target's hidden states: Clover-2 and Medusa.

Both grow a dynamic tree level by level. At each depth the `width` best nodes are expanded through one batched head
call; each expanded node's children are the head's top tokens, cut by the Clover-1 rule (drop a candidate below
`min_ratio` of its best sibling) and a top-p cut on the head's probabilities. A node's score is the product of the
head probabilities along its path; the engine keeps the best-scoring nodes within its budget.
"""

from __future__ import annotations

import torch

from ..packed import pack_linears, packed_linears
from ..target import Target, TreeKVCache
from ..tree import DraftTree, TreeBuilder


# The static tree (--tree static): paths of top-k ranks, Medusa/EAGLE style. (1, 0) is the best child of the
# root's second-best child. 24 nodes, 5 deep.
STATIC_TREE = [
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (2, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 1, 0),
]


class _TreeGrower:
    """Chooses the children of each expanded node: dynamic (by probability) or static (fixed rank paths)."""

    def __init__(self, topk: int = 8, width: int = 6, min_ratio: float = 0.25, top_p: float = 0.95,
                 static: bool = False):
        self.topk, self.width, self.min_ratio, self.top_p = topk, width, min_ratio, top_p
        self.static = set(STATIC_TREE) if static else None
        self.paths: dict[int, tuple] = {0: ()}

    def start(self):
        self.paths = {0: ()}

    def expand(self, builder: TreeBuilder, level: list[int], logits: torch.Tensor, budget: int,
               token_ids: torch.Tensor | None = None, min_score: float = 0.0) -> list[int]:
        """Add the children of the nodes in `level` (rows of logits); return the next level's nodes.

        token_ids maps logit columns to token ids when the heads draft from a shortlist of the vocabulary.
        A dynamic tree gets no child scored below min_score (one not worth verifying).
        """
        probs = torch.softmax(logits.float(), dim=-1)
        top_p, top_i = probs.topk(min(self.topk, probs.shape[-1]), dim=-1)
        if token_ids is not None:
            top_i = token_ids[top_i]
        top_p, top_i = top_p.tolist(), top_i.tolist()
        children = []
        for row, parent in enumerate(level):
            base, best, mass = builder.scores[parent], top_p[row][0], 0.0
            for rank, (p, tok) in enumerate(zip(top_p[row], top_i[row])):
                if self.static is not None:
                    path = self.paths[parent] + (rank,)
                    if path not in self.static:
                        continue
                elif p < self.min_ratio * best or mass >= self.top_p or base * p < min_score:
                    break
                mass += p
                child = builder.add(parent, tok, base * p)
                self.paths[child] = self.paths[parent] + (rank,)
                children.append(child)
        if self.static is not None:
            return children
        children.sort(key=lambda i: -builder.scores[i])
        # A child can only make the final tree if it beats the budget-th best node already there.
        if len(builder.scores) > budget + 1:
            floor = sorted(builder.scores[1:], reverse=True)[budget - 1]
            children = [c for c in children if builder.scores[c] >= floor]
        return children[: self.width]


class DraftProjection:
    """The target's frozen lm_head, restricted to the heads' draft vocabulary when they have one.

    Reading the whole [vocabulary x hidden] matrix at every draft depth is what a draft step mostly costs on a CPU;
    a shortlist of the target's most used tokens (as in FR-Spec) reads a fraction of it. Verification always uses
    the full lm_head, so this changes which tokens get proposed, never the output.
    """

    def __init__(self, lm_head, vocab: torch.Tensor | None):
        self.lm_head, self.token_ids = lm_head, None
        if vocab is not None and vocab.numel() < lm_head.weight.shape[0]:
            self.token_ids = vocab.to(lm_head.weight.device)
            bias = getattr(lm_head, "bias", None)
            self.shortlist = torch.nn.Linear(lm_head.weight.shape[1], self.token_ids.numel(), bias=bias is not None,
                                             device="meta")
            self.shortlist.weight = torch.nn.Parameter(lm_head.weight.detach()[self.token_ids], requires_grad=False)
            if bias is not None:
                self.shortlist.bias = torch.nn.Parameter(bias.detach()[self.token_ids], requires_grad=False)
            pack_linears(self.shortlist)

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        if self.token_ids is None:
            return self.lm_head(out)
        return self.shortlist(out.to(self.shortlist.weight.dtype))


class CloverDrafter:
    name = "clover"

    def __init__(self, heads, target: Target, **grow):
        self.heads = heads
        self.target = target
        self.grower = _TreeGrower(**grow)
        self.dtype = next(heads.parameters()).dtype
        pack_linears(heads)
        self.project = DraftProjection(target.lm_head, getattr(heads, "draft_vocab", None))
        self.cache = TreeKVCache(heads.cfg.num_layers, 256, target.max_context)
        self.state = None
        # what observe() was given and the augmenting block has not run over yet: it runs once, over all of it,
        # when a proposal needs the state (a step whose tree comes from lookup alone skips the heads)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.max_depth = heads.cfg.num_heads
        self.min_score = 0.0  # set by the engine: nodes scored below it do not pay for their verification

    def reset(self, length: int) -> None:
        keep = length - self.cache.length
        if keep <= 0:
            self.cache.truncate(length)
            self.pending = []
        else:
            kept = []
            for hidden, tokens in self.pending:
                if keep <= 0:
                    break
                kept.append((hidden[:keep], tokens[:keep]))
                keep -= tokens.numel()
            self.pending = kept
        self.state = None

    def observe(self, hidden, next_tokens) -> None:
        self.pending.append((hidden, next_tokens))
        self.state = None

    @torch.inference_mode()
    @packed_linears()
    def _catch_up(self) -> None:
        if not self.pending:
            return
        hiddens, tokens = zip(*self.pending)
        self.pending = []
        hidden = torch.cat(hiddens) if len(hiddens) > 1 else hiddens[0]
        next_tokens = torch.cat(tokens) if len(tokens) > 1 else tokens[0]
        n = next_tokens.numel()
        self.cache.reserve(n)
        start = self.cache.length
        pos = torch.arange(start, start + n, device=hidden.device)[None]
        x = hidden.to(self.dtype)[None]
        rope = self.target.base.rotary_emb(x, pos)
        emb = self.target.embed_tokens(next_tokens)[None].to(self.dtype)
        state = self.heads.augment(x, emb, rope, pos, cache=self.cache)
        self.cache.append(n)
        self.state = state[0, -1]

    @torch.inference_mode()
    @packed_linears()
    def propose(self, context, budget) -> DraftTree:
        builder = TreeBuilder(context[-1])
        self.grower.start()
        if budget <= 0:
            return builder.build(0)
        self._catch_up()
        if self.state is None:
            return builder.build(0)
        level, states = [0], self.state[None]
        for depth in range(self.heads.cfg.num_heads):
            prev = None
            if depth:
                prev = self.target.embed_tokens(
                    torch.tensor([builder.tokens[i] for i in level], device=states.device)).to(self.dtype)
            new_states, out = self.heads.step(depth, states, prev)
            children = self.grower.expand(builder, level, self.project(out), budget, self.project.token_ids,
                                          self.min_score)
            if not children:
                break
            row_of = {node: row for row, node in enumerate(level)}
            states = new_states[[row_of[builder.parents[c]] for c in children]]
            level = children
        return builder.build(budget)


class MedusaDrafter:
    name = "medusa"

    def __init__(self, heads, target: Target, **grow):
        self.heads = heads
        self.target = target
        self.grower = _TreeGrower(**grow)
        self.dtype = next(heads.parameters()).dtype
        pack_linears(heads)
        self.project = DraftProjection(target.lm_head, getattr(heads, "draft_vocab", None))
        self.norm = getattr(target.base, "norm", None)
        self.last = None  # the last observed hidden state; the heads run on it when a proposal needs them
        self.max_depth = heads.cfg.num_heads
        self.min_score = 0.0  # set by the engine: nodes scored below it do not pay for their verification

    def reset(self, length: int) -> None:
        self.last = None

    def observe(self, hidden, next_tokens) -> None:
        self.last = hidden[-1:]

    @torch.inference_mode()
    @packed_linears()
    def propose(self, context, budget) -> DraftTree:
        builder = TreeBuilder(context[-1])
        self.grower.start()
        if budget <= 0 or self.last is None:
            return builder.build(0)
        post = self.norm(self.last) if self.norm is not None else self.last
        outs = self.heads.outputs(post.to(self.dtype))
        logits = [self.project(o).float() for o in outs]  # head i: [1, V or the draft vocabulary]
        level = [0]
        for depth, head_logits in enumerate(logits):
            children = self.grower.expand(builder, level, head_logits.expand(len(level), -1), budget,
                                          self.project.token_ids, self.min_score)
            if not children:
                break
            level = children
        return builder.build(budget)
