"""Drafters that run trained heads on the target's hidden states: Clover-2 and Medusa.

Both grow a dynamic tree level by level. At each depth the `width` best nodes are expanded through one batched head
call; each expanded node's children are the head's top tokens, cut by the Clover-1 rule (drop a candidate below
`min_ratio` of its best sibling) and a top-p cut on the head's probabilities. A node's score is the product of the
head probabilities along its path; the engine keeps the best-scoring nodes within its budget.
"""

from __future__ import annotations

import torch

from ..packed import pack_linears, packed_linears
from ..target import Target, TreeKVCache, find_final_norm
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

    def expand(self, builder: TreeBuilder, level: list[int], top_p: list, top_i: list, budget: int,
               min_score: float = 0.0) -> list[int]:
        """Add the children of the nodes in `level` (rows of top_p/top_i: each node's best candidate tokens and
        their head probabilities, best first); return the next level's nodes.

        A dynamic tree gets no child scored below min_score (one not worth verifying).
        """
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


def top_tokens(logits: torch.Tensor, k: int, token_ids: torch.Tensor | None = None):
    """(probabilities, token ids) of the k most likely tokens of each row of `logits` [r, V], best first.
    token_ids maps logit columns to token ids when the heads draft from a shortlist of the vocabulary."""
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, top_i = probs.topk(min(k, probs.shape[-1]), dim=-1)
    if token_ids is not None:
        top_i = token_ids[top_i]
    return top_p, top_i


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

    @property
    def linear(self) -> torch.nn.Module:
        return self.lm_head if self.token_ids is None else self.shortlist

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        if self.token_ids is None:
            return self.lm_head(out)
        return self.shortlist(out.to(self.shortlist.weight.dtype))


class CloverAugment(torch.nn.Module):
    """What a Clover-2 proposal first catches up on: the augmenting block over the newly committed positions,
    (target hidden [n, H], next tokens [n], positions [n], the heads' cache) -> states [n, H]. Run eager, or exported
    and compiled (clover_cli/compiled.py) with the cache made over its buffers."""

    def __init__(self, heads, target: Target):
        super().__init__()
        self.heads, self.embed, self.rotary = heads, heads.token_embedding(target.model), heads.rotary(target.model)
        self.dtype = next(heads.parameters()).dtype

    def forward(self, hidden, tokens, positions, cache):
        x = hidden.to(self.dtype)[None]
        emb = self.embed(tokens)[None].to(self.dtype)
        return self.heads.augment(x, emb, self.rotary(x, positions[None]), positions[None], cache=cache)[0]


class CloverLevel(torch.nn.Module):
    """One depth of Clover-2 heads over a level of tree nodes: (states [r, H], the nodes' tokens [r]) -> (next states,
    probabilities [r, k] and token ids [r, k] of each node's k best children). The first depth (head 0) reads the
    state alone; later depths share one set of weights and also read the embedding of the node's token."""

    def __init__(self, heads, target: Target, project: DraftProjection, first: bool, k: int):
        super().__init__()
        self.heads, self.embed, self.out = heads, heads.token_embedding(target.model), project.linear
        self.first, self.k = first, k
        self.dtype = next(heads.parameters()).dtype
        self.token_ids = project.token_ids
        self.project = project

    def forward(self, states, tokens):
        if self.first:
            states, out = self.heads.step(0, states)
        else:
            states, out = self.heads.step(1, states, self.embed(tokens).to(self.dtype))
        top_p, top_i = top_tokens(self.project(out), self.k, self.token_ids)
        return states, top_p, top_i


class MedusaLevels(torch.nn.Module):
    """Every Medusa head at once on the last hidden state: (pre-norm hidden [1, H]) -> probabilities [D, k] and token
    ids [D, k], head d's k best tokens for depth d."""

    def __init__(self, heads, target: Target, project: DraftProjection, k: int):
        super().__init__()
        self.heads, self.out, self.k = heads, project.linear, k
        self.norm = find_final_norm(target.base)
        self.dtype = next(heads.parameters()).dtype
        self.token_ids = project.token_ids
        self.project = project

    def forward(self, hidden):
        post = self.norm(hidden) if self.norm is not None else hidden
        outs = self.heads.outputs(post.to(self.dtype))  # D x [1, H]
        if self.heads.cfg.lm_heads:  # each head's own vocabulary projection
            logits = torch.cat([proj(out).to(outs[0].dtype) for proj, out in zip(self.heads.lm_heads, outs)])
            return top_tokens(logits, self.k)
        return top_tokens(self.project(torch.cat(outs)), self.k, self.token_ids)


def keep_pending(cache: TreeKVCache, pending: list, length: int) -> list:
    """A drafter with its own cache over committed positions and observations queued for it (`pending`: (hidden,
    next tokens) pairs) forgets everything from position `length` on: the cache is cut there, or the queue is cut to
    what still lies before it. Returns the queue to keep."""
    keep = length - cache.length
    if keep <= 0:
        cache.truncate(length)
        return []
    kept = []
    for hidden, tokens in pending:
        if keep <= 0:
            break
        kept.append((hidden[:keep], tokens[:keep]))
        keep -= tokens.numel()
    return kept


class CloverDrafter:
    """Clover-2 heads growing a dynamic (or static) tree. Per proposal: the augmenting block catches up on what the
    target committed since the last one (CloverAugment), then one CloverLevel per depth. Each of those runs eager,
    or compiled once `attach_programs` gives their compiled twins (same inputs, same outputs)."""

    name = "clover"

    def __init__(self, heads, target: Target, **grow):
        self.heads = heads
        self.target = target
        self.grower = _TreeGrower(**grow)
        self.dtype = next(heads.parameters()).dtype
        pack_linears(heads)
        self.project = DraftProjection(target.lm_head, getattr(heads, "draft_vocab", None))
        self.cache = TreeKVCache(heads.cfg.num_layers, 256, target.max_context)
        self.augment_block = CloverAugment(heads, target)
        self.levels = (CloverLevel(heads, target, self.project, True, self.grower.topk),
                       CloverLevel(heads, target, self.project, False, self.grower.topk))
        self.programs = None  # compiled twins of (augment_block, levels[0], levels[1]), once attached
        self.state = None
        # what observe() was given and the augmenting block has not run over yet: it runs once, over all of it,
        # when a proposal needs the state (a step whose tree comes from lookup alone skips the heads)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.max_depth = heads.cfg.num_heads
        self.min_score = 0.0  # set by the engine: nodes scored below it do not pay for their verification

    def attach_programs(self, programs) -> None:
        """Run the compiled twins from now on (clover_cli.compiled.CloverPrograms); the cache takes their capacity."""
        self.cache.grow_to(programs.capacity)
        self.programs = programs

    def reset(self, length: int) -> None:
        self.pending = keep_pending(self.cache, self.pending, length)
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
        pos = torch.arange(start, start + n, device=hidden.device)
        compiled = self.programs is not None and self.programs.fits(self.cache, n)
        block = self.programs.augment if compiled else self.augment_block
        state = block(hidden, next_tokens, pos, self.cache)
        self.cache.append(n)
        self.state = state[-1]

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
        levels = self.programs.levels if self.programs is not None else self.levels
        level, states = [0], self.state[None]
        tokens = torch.tensor(context[-1:], device=states.device)
        for depth in range(self.heads.cfg.num_heads):
            new_states, top_p, top_i = levels[min(depth, 1)](states, tokens)
            children = self.grower.expand(builder, level, top_p.tolist(), top_i.tolist(), budget, self.min_score)
            if not children:
                break
            row_of = {node: row for row, node in enumerate(level)}
            states = new_states[[row_of[builder.parents[c]] for c in children]]
            level = children
            tokens = torch.tensor([builder.tokens[i] for i in level], device=states.device)
        return builder.build(budget)


class MedusaDrafter:
    """Medusa heads: every head reads the last hidden state (MedusaLevels, eager or compiled); head d proposes the
    tokens at depth d for every node of the level above."""

    name = "medusa"

    def __init__(self, heads, target: Target, **grow):
        self.heads = heads
        self.target = target
        self.grower = _TreeGrower(**grow)
        self.dtype = next(heads.parameters()).dtype
        pack_linears(heads)
        self.project = DraftProjection(target.lm_head, getattr(heads, "draft_vocab", None))
        self.levels = MedusaLevels(heads, target, self.project, self.grower.topk)
        self.programs = None  # the compiled twin of `levels`, once attached
        self.last = None  # the last observed hidden state; the heads run on it when a proposal needs them
        self.max_depth = heads.cfg.num_heads
        self.min_score = 0.0  # set by the engine: nodes scored below it do not pay for their verification

    def attach_programs(self, programs) -> None:
        self.programs = programs

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
        levels = self.programs.levels if self.programs is not None else self.levels
        top_p, top_i = levels(self.last)
        top_p, top_i = top_p.tolist(), top_i.tolist()
        level = [0]
        for depth in range(len(top_p)):
            children = self.grower.expand(builder, level, [top_p[depth]] * len(level), [top_i[depth]] * len(level),
                                          budget, self.min_score)
            if not children:
                break
            level = children
        return builder.build(budget)
