"""Verify/accept on the device: walk the draft tree with the target's verdict without a host round-trip.

Inputs (n tree nodes, V vocabulary; node 0 is the root, every parent comes before its children):

    logits / probs  [n, V] float    the target's output at each tree node (probs: already warped, rows need not
                                    be normalised)
    tokens          [n] int         the drafted token of each node (tokens[0], the root, is not checked);
                                    siblings carry distinct tokens, as DraftTree.validate requires
    parents         [n] int         parents[0] = -1
    uniforms        [n] float       sampling only, each in [0, 1): uniforms[c] (c >= 1) decides whether node c is
                                    accepted when it is tried; uniforms[0] (the root is never tried) draws the
                                    bonus token. A node is tried at most once and the bonus drawn once, so the
                                    result is a deterministic function of these numbers.
    max_depth       int | None      the tree's depth (deepest node's distance to the root); None computes it
                                    from `parents` on the host (a device sync if parents lives on the GPU)

Outputs, all int64 device tensors (the same for the reference and the kernels):

    path        [max_depth + 1]  accepted node indices, root first (path[0] = 0), padded with -1
    accept_len  []               number of accepted drafted nodes (path[:accept_len + 1] is valid)
    bonus       []               the token the target contributes after the accepted path

The KV commit of the result is `kv_commit_triton(..., path, accept_len + 1)` (root included), still on the device.
No kernel entry point synchronises with the host when tokens/parents/uniforms already live on the scores' device
and max_depth is given.

Greedy rule: from node x follow the child whose token is argmax(logits[x]) (first maximal index on ties, like
torch.argmax); stop when there is none; bonus = argmax(logits[last]).

Sampling rule (the engine's recursive rejection over siblings): at node x with distribution p = probs[x], try
x's children in tree order; child c with token t is accepted when uniforms[c] * sum(p) < p[t], otherwise
p[t] = 0 and the next child is tried. If no child is accepted, the bonus is drawn from what remains of p by
inverse CDF: the first token t with cumsum(p)[t] > uniforms[0] * sum(p). (The kernels sum in fp32 in blocks,
the reference in float64: they can differ only when a uniform lands within rounding of a decision boundary.)
If nothing remains (all of p's mass was on rejected children, possible only through rounding), the bonus is
argmax(probs[x]).

Kernels:
  * `_row_stats` (grid n): argmax and sum of each row, one program a row, looping over V in blocks.
  * `_walk` (one program): the walk, vectorised over the n nodes at each depth. In sampling mode the children of
    x in tree order have exclusive prefix sums `excl` of their token probabilities, so child c is tried against
    the remaining mass sum(p) - excl[c] (its siblings before it were all rejected if it is tried at all), and the
    first child passing its test is accepted. It also writes the final node and the list of its children's
    tokens (all rejected) for the bonus.
  * `_bonus_block_sums` (grid V / BLOCK_V, sampling only): the remaining mass of each vocabulary block of the
    final node's row, rejected tokens zeroed.
  * `_bonus_pick` (one program, sampling only): prefix sums over the block sums find the block where the CDF
    crosses uniforms[0] * total, then a cumulative sum inside that block finds the token.
"""

from __future__ import annotations

import torch

from ._triton import require_triton, tl, triton

__all__ = ["verify_greedy_ref", "verify_greedy_triton", "verify_sample_ref", "verify_sample_triton",
           "tree_max_depth"]


def tree_max_depth(parents) -> int:
    """Depth of the deepest node (0 for a root-only tree). Reads `parents` on the host."""
    par = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    depth = [0] * len(par)
    for i in range(1, len(par)):
        depth[i] = depth[par[i]] + 1
    return max(depth, default=0)


def _outputs(path: list[int], bonus: int, max_depth: int, device):
    padded = path + [-1] * (max_depth + 1 - len(path))
    return (torch.tensor(padded, dtype=torch.int64, device=device),
            torch.tensor(len(path) - 1, dtype=torch.int64, device=device),
            torch.tensor(bonus, dtype=torch.int64, device=device))


def _children(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        kids[parents[i]].append(i)
    return kids


def verify_greedy_ref(logits, tokens, parents, max_depth: int | None = None):
    """Host reference of the greedy walk (the engine's `accept` with temperature 0)."""
    max_depth = tree_max_depth(parents) if max_depth is None else max_depth
    toks, kids = tokens.tolist(), _children(parents.tolist())
    choice = logits.argmax(-1).tolist()
    node, path = 0, [0]
    while True:
        nxt = next((c for c in kids[node] if toks[c] == choice[node]), None)
        if nxt is None:
            return _outputs(path, choice[node], max_depth, logits.device)
        path.append(nxt)
        node = nxt


def verify_sample_ref(probs, tokens, parents, uniforms, max_depth: int | None = None):
    """Host reference of the sampling walk with given uniforms (float64 arithmetic)."""
    max_depth = tree_max_depth(parents) if max_depth is None else max_depth
    toks, kids = tokens.tolist(), _children(parents.tolist())
    u = uniforms.double().cpu()
    node, path = 0, [0]
    while True:
        p = probs[node].double().cpu().clone()
        for c in kids[node]:
            if u[c] * p.sum() < p[toks[c]]:
                path.append(c)
                node = c
                break
            p[toks[c]] = 0.0
        else:
            cdf = p.cumsum(0)
            total = cdf[-1]
            if total > 0:
                bonus = int(torch.searchsorted(cdf, u[0] * total, right=True).clamp(max=p.numel() - 1))
            else:
                bonus = int(probs[node].argmax())
            return _outputs(path, bonus, max_depth, probs.device)


@triton.jit
def _row_stats(X, stride, V, ArgMax, Sum, BLOCK_V: tl.constexpr):
    """Per row: index of the first maximum and the sum (fp32), looping over the row in BLOCK_V lanes."""
    row = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK_V], 2147483647, tl.int32)
    total = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        idx = start + lanes
        x = tl.load(X + row.to(tl.int64) * stride + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        better = x > best  # strict: a lane keeps its earliest maximum
        best_idx = tl.where(better, idx, best_idx)
        best = tl.where(better, x, best)
        total += tl.where(idx < V, x, 0.0)
    top = tl.max(best, 0)
    first = tl.min(tl.where(best == top, best_idx, 2147483647), 0)
    first = tl.where(first == 2147483647, 0, first)  # a row of -inf: index 0
    tl.store(ArgMax + row, first.to(tl.int64))
    tl.store(Sum + row, tl.sum(total, 0))


@triton.jit
def _walk(
    X, stride, Tokens, Parents, Uniforms, ArgMax, Sum,
    Path, AcceptLen, Bonus, Final, Rejected, NumRejected,
    n, max_depth,
    SAMPLE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Walk the tree from the root, one depth per iteration, all n nodes in one vector."""
    idx = tl.arange(0, BLOCK_T)
    valid = idx < n
    tokens = tl.load(Tokens + idx, mask=valid, other=-1)
    parents = tl.load(Parents + idx, mask=valid, other=-2)
    none = n  # "no child" marker, larger than any node index
    node = tl.zeros([], tl.int64)
    length = tl.zeros([], tl.int64)
    tl.store(Path, node)
    for dpt in range(0, max_depth):
        tl.store(Path + 1 + dpt, -1)
    for dpt in range(0, max_depth):
        kids = valid & (parents == node)
        if SAMPLE:
            p_kid = tl.load(X + node * stride + tokens, mask=kids, other=0.0).to(tl.float32)
            excl = tl.cumsum(p_kid, 0) - p_kid  # mass of the siblings tried (and rejected) before
            remaining = tl.load(Sum + node) - excl
            u = tl.load(Uniforms + idx, mask=kids, other=1.0)
            ok = kids & (u * remaining < p_kid)
        else:
            ok = kids & (tokens == tl.load(ArgMax + node))
        child = tl.min(tl.where(ok, idx, none), 0).to(tl.int64)
        found = child < none
        tl.store(Path + 1 + length, child, mask=found)
        length += found.to(tl.int64)
        node = tl.where(found, child, node)  # once nothing is found, later depths find nothing again
    tl.store(AcceptLen, length)
    if SAMPLE:
        # The walk stopped at `node`: all its children were rejected. List their tokens for the bonus draw.
        kids = valid & (parents == node)
        slot = tl.cumsum(kids.to(tl.int32), 0) - 1
        tl.store(Rejected + slot, tokens, mask=kids)
        tl.store(NumRejected, tl.sum(kids.to(tl.int32), 0))
        tl.store(Final, node)
    else:
        tl.store(Bonus, tl.load(ArgMax + node))


@triton.jit
def _zero_rejected(x, vocab, Rejected, NumRejected):
    """x (one vocabulary block) with the rejected tokens' entries set to 0."""
    for r in range(0, tl.load(NumRejected)):
        x = tl.where(vocab == tl.load(Rejected + r), 0.0, x)
    return x


@triton.jit
def _bonus_block_sums(X, stride, V, Final, Rejected, NumRejected, BlockSums, BLOCK_V: tl.constexpr):
    blk = tl.program_id(0)
    vocab = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    node = tl.load(Final)
    x = tl.load(X + node * stride + vocab, mask=vocab < V, other=0.0).to(tl.float32)
    x = _zero_rejected(x, vocab, Rejected, NumRejected)
    tl.store(BlockSums + blk, tl.sum(x, 0))


@triton.jit
def _bonus_pick(
    X, stride, V, Final, Rejected, NumRejected, BlockSums, Uniforms, ArgMax, Bonus, num_blocks,
    BLOCK_V: tl.constexpr, BLOCK_B: tl.constexpr,
):
    b = tl.arange(0, BLOCK_B)
    sums = tl.load(BlockSums + b, mask=b < num_blocks, other=0.0)
    cum = tl.cumsum(sums, 0)
    total = tl.max(cum, 0)  # the last prefix sum: the entries are >= 0
    target = tl.load(Uniforms) * total
    # First block whose CDF passes the target; it exists when total > 0 because uniforms[0] < 1.
    hit = tl.min(tl.where((cum > target) & (b < num_blocks), b, BLOCK_B), 0)
    hit = tl.minimum(hit, num_blocks - 1)
    before = tl.max(tl.where(b < hit, cum, 0.0), 0)  # CDF at the end of the previous block
    node = tl.load(Final)
    vocab = hit * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(X + node * stride + vocab, mask=vocab < V, other=0.0).to(tl.float32)
    x = _zero_rejected(x, vocab, Rejected, NumRejected)
    inside = before + tl.cumsum(x, 0)
    pick = tl.min(tl.where((inside > target) & (vocab < V), vocab, V), 0)
    # Rounding can leave the crossing just past the block's last positive entry: take that entry then.
    last = tl.max(tl.where(x > 0.0, vocab, -1), 0)
    pick = tl.where(pick == V, last, pick)
    pick = tl.where(total > 0.0, pick, tl.load(ArgMax + node).to(tl.int32))
    tl.store(Bonus, pick.to(tl.int64))


def _prepare(x, tokens, parents, max_depth):
    if x.dim() != 2 or tokens.shape != (x.shape[0],) or parents.shape != (x.shape[0],):
        raise ValueError(f"expected [n, V] scores and [n] tokens/parents, got {tuple(x.shape)}, "
                         f"{tuple(tokens.shape)}, {tuple(parents.shape)}")
    max_depth = tree_max_depth(parents) if max_depth is None else int(max_depth)
    x = x if x.stride(-1) == 1 else x.contiguous()
    dev = x.device
    tokens = tokens.to(device=dev, dtype=torch.int64).contiguous()
    parents = parents.to(device=dev, dtype=torch.int64).contiguous()
    n, V = x.shape
    argmax = torch.empty(n, dtype=torch.int64, device=dev)
    sums = torch.empty(n, dtype=torch.float32, device=dev)
    _row_stats[(n,)](x, x.stride(0), V, argmax, sums, BLOCK_V=min(4096, triton.next_power_of_2(V)))
    path = torch.empty(max_depth + 1, dtype=torch.int64, device=dev)
    accept_len = torch.empty((), dtype=torch.int64, device=dev)
    bonus = torch.empty((), dtype=torch.int64, device=dev)
    return x, tokens, parents, max_depth, argmax, sums, path, accept_len, bonus


def verify_greedy_triton(logits, tokens, parents, max_depth: int | None = None):
    """Greedy verify on the device: two launches (row argmax, walk), no host synchronisation."""
    require_triton()
    x, tokens, parents, max_depth, argmax, sums, path, accept_len, bonus = _prepare(logits, tokens, parents,
                                                                                     max_depth)
    n = x.shape[0]
    _walk[(1,)](x, x.stride(0), tokens, parents, sums, argmax, sums, path, accept_len, bonus, bonus, bonus, bonus,
                n, max_depth, SAMPLE=False, BLOCK_T=max(16, triton.next_power_of_2(n)))
    return path, accept_len, bonus


def verify_sample_triton(probs, tokens, parents, uniforms, max_depth: int | None = None):
    """Sampling verify on the device: four launches, no host synchronisation."""
    require_triton()
    x, tokens, parents, max_depth, argmax, sums, path, accept_len, bonus = _prepare(probs, tokens, parents,
                                                                                     max_depth)
    n, V = x.shape
    if uniforms.shape != (n,):
        raise ValueError(f"uniforms must be [{n}], got {tuple(uniforms.shape)}")
    uniforms = uniforms.to(device=x.device, dtype=torch.float32).contiguous()
    final = torch.empty((), dtype=torch.int64, device=x.device)
    rejected = torch.empty(n, dtype=torch.int64, device=x.device)
    num_rejected = torch.empty((), dtype=torch.int32, device=x.device)
    _walk[(1,)](x, x.stride(0), tokens, parents, uniforms, argmax, sums, path, accept_len, bonus, final,
                rejected, num_rejected, n, max_depth, SAMPLE=True, BLOCK_T=max(16, triton.next_power_of_2(n)))
    BLOCK_V = min(2048, triton.next_power_of_2(V))
    blocks = triton.cdiv(V, BLOCK_V)
    block_sums = torch.empty(blocks, dtype=torch.float32, device=x.device)
    _bonus_block_sums[(blocks,)](x, x.stride(0), V, final, rejected, num_rejected, block_sums, BLOCK_V=BLOCK_V)
    _bonus_pick[(1,)](x, x.stride(0), V, final, rejected, num_rejected, block_sums, uniforms, argmax, bonus,
                      blocks, BLOCK_V=BLOCK_V, BLOCK_B=max(16, triton.next_power_of_2(blocks)))
    return path, accept_len, bonus
