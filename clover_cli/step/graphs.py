"""The target's step with static shapes, captured as CUDA graphs on a GPU.

A step of n new tokens runs as a fixed number of rows (SIZES: the smallest >= n; the rows after the real ones are
padding) over a fixed span of the KV buffers (the smallest of 256, 512, 1024, ... >= committed + rows), so no shape
depends on the step: the committed length is a device tensor, each layer writes its new keys and values with
`index_copy_` at it, and the attention mask is built on the device from it and the tree. On CUDA each (rows, span)
pair is captured once as a CUDA graph (`torch.cuda.graph`, on its first use: two forwards' time) and replayed after
that: one launch per step instead of a dozen kernels per layer and the Python between them. Elsewhere (a CPU, the
tests) the same function runs as it is, so CI checks the arithmetic that the graphs capture.

It is the stock transformers forward with our attention function (`Target.run`), writing into the live cache's own
buffers, so eager steps (a prefill longer than the largest size) and graph replays follow each other in one
conversation. The accepted nodes' keys and values move afterwards as in eager mode (`TreeKVCache.commit`).

The draft heads' per-step modules run the same way (`heads_graphs`: Clover-2's catch-up over its own cache and its
levels, per padded size of rows; Medusa's heads). `check` runs a small tree through the eager and the static step before
a session uses it; a capture that fails later sends the target (or the heads) back to eager for good, said once.
"""

from __future__ import annotations

import torch

from ..errors import one_line
from ..target import STATIC_KWARG, TreeKVCache, TreeKVLayer
from . import fits, heads_kind, padded_size

# The rows a static call runs as (padded_size): a CUDA graph is captured per (rows, span), and none past the last size
# (a longer step, a prefill, runs eager).
SIZES = (1, 2, 4, 8, 16, 32, 64)
FIRST_SPAN = 256


class SpanLayer(TreeKVLayer):
    """A layer of the live cache seen through a static step: new keys and values go at the device positions
    `owner.write_at`, attention reads the first `owner.span` positions."""

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.index_copy_(2, self.owner.write_at, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, self.owner.write_at, value_states.to(self.values.dtype))
        return self.keys.narrow(2, 0, self.owner.span), self.values.narrow(2, 0, self.owner.span)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.span, 0


class SpanView(TreeKVCache):
    """The live cache's buffers as one static step sees them (made per call; holds no memory of its own)."""

    def __init__(self, cache: TreeKVCache, write_at: torch.Tensor, span: int):
        super().__init__(len(cache.layers), cache.capacity, cache.capacity, cache.kv_dtype)
        self.layers = [SpanLayer(self) for _ in cache.layers]
        for mine, live in zip(self.layers, cache.layers):
            mine.keys, mine.values, mine.is_initialized = live.keys, live.values, True
        self.length = cache.length  # what transformers reads as the past length; nothing of the step depends on it
        self.write_at, self.span = write_at, span


class Graphs:
    """Functions run by key: on CUDA each key's is captured once as a CUDA graph (its first call) and replayed after
    that; elsewhere called as they are. All of one owner's graphs share a memory pool: they never run at once, and
    every caller copies what it keeps out of the outputs before the next replay."""

    def __init__(self, capture: bool, device=None):
        self.capture = capture
        self.device = device  # the CUDA device the graphs run on (the model's: it may be another than the current)
        self.graphs: dict = {}  # key -> (graph, its output tensors)
        self.pool = None

    def run(self, key, fn, failed=None):
        """fn()'s outputs, through key's graph; when capturing it fails and `failed` is given, failed(the error)."""
        if not self.capture:
            return fn()
        try:
            with torch.cuda.device(self.device):
                if key not in self.graphs:
                    self.graphs[key] = self._capture(fn)
                graph, outputs = self.graphs[key]
                graph.replay()
        except Exception as e:
            if failed is None or key in self.graphs:
                raise
            return failed(e)
        return outputs

    def _capture(self, fn):
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):  # a first run off the graph: cuBLAS's workspaces, lazy initialisations
                fn()
        finally:
            torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn()
        return graph, outputs

    def __len__(self):
        return len(self.graphs)

    def keys(self):
        return self.graphs.keys()


def fits_rows(sizes: tuple[int, ...], capacity: int, cache, n: int) -> bool:
    """Whether a static call of the padded size for n rows can write into `cache` (buffers made, of this capacity;
    the rows may fill them to the last slot: see step.fits_at)."""
    rows = padded_size(n, sizes)
    return rows is not None and fits(cache, capacity, rows)


def span_for(end: int, capacity: int) -> int:
    """The keys a static step attends over: the smallest of FIRST_SPAN * 2^k >= end, at most the capacity."""
    span = FIRST_SPAN
    while span < end:
        span *= 2
    return min(span, capacity)


class Rows:
    """Input buffers of a static call over up to `rows` new positions: tokens, positions, and the tree (which new
    positions each one sees; padding rows see themselves only, so nothing is NaN), plus the committed length as a
    device tensor. `mask(rows, span)` is the whole attention mask [1, 1, rows, span] built from them on the device,
    with what a sliding window needs: the keys' positions (committed token i taken to sit at position i, as the eager
    path takes it) and committed + real new tokens (the eager path applies a window only past that many keys)."""

    def __init__(self, rows: int, capacity: int, device):
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.eye = torch.eye(rows, dtype=torch.bool, device=device)
        self.causal = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
        self.tree = self.eye.clone()
        self.past = torch.zeros((), dtype=torch.long, device=device)
        self.end = torch.zeros((), dtype=torch.long, device=device)  # committed + real new tokens
        self.index = torch.arange(capacity, device=device)

    def fill(self, past: int, rows: int, tokens, positions, tree_mask=None) -> None:
        n = tokens.numel()
        self.tokens[:n].copy_(tokens)
        self.positions[:n].copy_(positions)
        self.tree[:rows].copy_(self.eye[:rows])
        self.tree[:n, :n].copy_(tree_mask if tree_mask is not None else self.causal[:n, :n])
        self.past.fill_(past)
        self.end.fill_(past + n)

    def mask(self, rows: int, span: int):
        rel = self.index[:span] - self.past  # a key's offset among the new positions (negative: committed)
        new = (rel >= 0) & (rel < rows)
        at = rel.clamp(0, rows - 1)
        mask = (self.tree[:rows].index_select(1, at) & new) | (rel < 0)
        key_positions = torch.where(rel < 0, self.index[:span], self.positions[:rows].index_select(0, at))
        return mask[None, None], {STATIC_KWARG: (self.positions[:rows], key_positions, self.end)}

    def write_at(self, rows: int) -> torch.Tensor:
        return self.past + self.index[:rows]


class StaticStep:
    """A program for Target.attach_program: `fits(cache, n)`, then `(cache, tokens, positions, tree_mask,
    logits_for) -> (pre-norm hidden [n, H], logits)`, as Target.forward's eager path returns them."""

    def __init__(self, target, capacity: int, sizes: tuple[int, ...] = SIZES, capture: bool | None = None):
        self.target = target
        self.capacity = capacity
        self.sizes = tuple(sorted(sizes))
        self.inputs = Rows(self.sizes[-1], capacity, target.device)
        self.graphs = Graphs(target.device.type == "cuda" if capture is None else capture, target.device)
        self.on_failure = None  # called with a one-line reason when a capture fails (the target then runs eager)

    def rows_for(self, n: int) -> int | None:
        return padded_size(n, self.sizes)

    def span_for(self, end: int) -> int:
        return span_for(end, self.capacity)

    def fits(self, cache, n: int) -> bool:
        return fits_rows(self.sizes, self.capacity, cache, n)

    @torch.inference_mode()
    def __call__(self, cache, tokens, positions, tree_mask, logits_for):
        n = tokens.numel()
        rows = self.rows_for(n)
        span = self.span_for(cache.length + rows)
        self.inputs.fill(cache.length, rows, tokens, positions, tree_mask)

        def failed(e):  # this model's forward cannot be captured (a host sync, a shape that depends on values)
            self.target.program = None  # eager from now on
            if self.on_failure is not None:
                self.on_failure(f"cannot capture a CUDA graph of this model's step ({one_line(e, 160, kind=True)})")
            return None

        out = self.graphs.run((rows, span), lambda: self._forward(cache, rows, span), failed)
        if out is None:
            return self.target.forward(tokens, positions, tree_mask, logits_for)
        pre, logits = out
        logits = logits[:n] if logits_for is None else logits[:n][logits_for]
        return pre[:n].clone(), logits.clone()

    def _forward(self, cache, rows: int, span: int):
        """The step itself, every shape fixed by (rows, span): what a graph captures."""
        mask, extra = self.inputs.mask(rows, span)
        view = SpanView(cache, self.inputs.write_at(rows), span)
        return self.target.run(self.inputs.tokens[:rows], self.inputs.positions[:rows], mask, view, None, **extra)


def attach(target, capacity: int, sizes: tuple[int, ...] = SIZES, capture: bool | None = None) -> StaticStep:
    """Give `target` a static step over KV buffers of `capacity` tokens (made now)."""
    step = StaticStep(target, capacity, sizes, capture)
    target.attach_program(step)
    return step


@torch.inference_mode()
def check(step: StaticStep, tolerance: float | None = None) -> str | None:
    """Why the static step cannot serve its target (None: it can): after a prefix of 5 and then of 7 tokens (the
    second replays what the first captured, at another committed length), a small tree (two branches, depth 2)
    through the eager step and through the static one (captured, on CUDA) must give the same logits and hidden
    states. Catches a model whose attention ignores the mask it is given, a value of the first step baked into a
    graph, and a forward that cannot be captured. The cache is left empty."""
    from ..tree import DraftTree

    target = step.target
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(min(3, vocab - 1), vocab, (11,), generator=g)
    tokens, depths, mask = DraftTree(ids[7:].tolist(), [-1, 0, 0, 1]).tensors(target.device)
    out, failed, listener = {}, [], step.on_failure
    step.on_failure = failed.append  # a capture that fails falls back to eager: that is a failed check too
    try:
        for length in (5, 7):
            prefix = ids[:length].to(target.device)
            for program in (None, step):
                target.program = program
                target.reset(0)
                target.forward(prefix)
                target.cache.append(length)
                out[length, program is None] = target.forward(tokens, length + depths, mask)
    except Exception as e:
        return f"the static step fails on this model ({one_line(e, 160, kind=True)})"
    finally:
        target.reset(0)
        target.program, step.on_failure = step, listener
    if failed:
        return f"the static step fails on this model: {failed[0]}"
    if tolerance is None:
        half = next(target.model.parameters()).dtype != torch.float32
        tolerance = 5e-2 if half else 1e-3
    error = 0.0
    for length in (5, 7):
        for got, want in zip(out[length, False], out[length, True]):
            error = max(error, float((got - want).abs().max()) / max(1.0, float(want.abs().max())))
    if not error <= tolerance:
        return f"the static step's logits or hidden states differ from the eager step's by {error:.2g} (relative)"
    return None


# ---------------------------------------------------------------------------------------------------------------
# The draft heads' per-step modules, the same way (a twin of aot.HeadsPrograms for the drafters' attach_programs)

class HeadsCalls:
    """What the heads' static calls share: their graphs, and a way out when one cannot be captured (the drafter's
    modules then run eager, and `on_failure` hears why once)."""

    def __init__(self, drafter, capture: bool | None):
        device = next(drafter.heads.parameters()).device
        self.drafter = drafter
        self.graphs = Graphs(device.type == "cuda" if capture is None else capture, device)
        self.on_failure = None

    def guarded(self, key, fn, eager):
        """fn() through the graphs, or eager() (and the drafter back on its eager modules) when a capture fails."""
        def failed(e):
            if self.drafter.programs is self:
                self.drafter.programs = None
                if self.on_failure is not None:
                    self.on_failure(f"cannot capture a CUDA graph of the heads ({one_line(e, 160, kind=True)})")
            return eager()

        return self.graphs.run(key, fn, failed)


class RowBuffers:
    """Input buffers of a module applied row by row (rows independent): copied in, padded to a size, run."""

    def __init__(self, sizes: tuple[int, ...], calls: HeadsCalls):
        self.sizes, self.calls, self.graphs = sizes, calls, calls.graphs
        self.states = self.tokens = None

    @torch.inference_mode()
    def run(self, key, module, states, tokens):
        r = states.shape[0]
        rows = padded_size(r, self.sizes)
        if rows is None:
            return module(states, tokens)
        if self.states is None or self.states.dtype != states.dtype or self.states.shape[1] != states.shape[1]:
            self.states = states.new_zeros(self.sizes[-1], states.shape[1])
            self.tokens = torch.zeros(self.sizes[-1], dtype=torch.long, device=states.device)
            self.graphs.graphs = {k: v for k, v in self.graphs.graphs.items() if k[0] != "level"}  # on old buffers
        self.states[:r].copy_(states)
        self.tokens[:r].copy_(tokens)
        outputs = self.calls.guarded(("level", key, rows), lambda: module(self.states[:rows], self.tokens[:rows]),
                                     lambda: module(states, tokens))
        return tuple(out[:r].clone() for out in outputs)


class CloverGraphs(HeadsCalls):
    """Clover-2's catch-up (the augmenting block over up to SIZES[-1] new positions, writing the heads' own cache as
    the target's step writes its cache) and its two level modules (per padded size of rows), as static calls."""

    kind = "clover"

    def __init__(self, drafter, capacity: int, sizes: tuple[int, ...] = SIZES, capture: bool | None = None):
        super().__init__(drafter, capture)
        device = next(drafter.heads.parameters()).device
        self.capacity, self.sizes = capacity, tuple(sorted(sizes))
        self.block = drafter.augment_block
        self.inputs = Rows(self.sizes[-1], capacity, device)
        self.hidden = None
        rows = RowBuffers(self.sizes, self)
        first, later = drafter.levels
        self.levels = (lambda states, tokens: rows.run(0, first, states, tokens),
                       lambda states, tokens: rows.run(1, later, states, tokens))

    def fits(self, cache, n: int) -> bool:
        return fits_rows(self.sizes, self.capacity, cache, n)

    @torch.inference_mode()
    def augment(self, hidden, tokens, positions, cache):
        n = tokens.numel()
        rows = padded_size(n, self.sizes)
        span = span_for(cache.length + rows, self.capacity)
        if self.hidden is None or self.hidden.dtype != hidden.dtype or self.hidden.shape[1] != hidden.shape[1]:
            self.hidden = hidden.new_zeros(self.sizes[-1], hidden.shape[1])
            self.graphs.graphs = {k: v for k, v in self.graphs.graphs.items() if k[0] != "augment"}
        self.hidden[:n].copy_(hidden)
        self.inputs.fill(cache.length, rows, tokens, positions)
        states = self.guarded(("augment", rows, span), lambda: self._augment(cache, rows, span),
                              lambda: self.block(hidden, tokens, positions, cache))
        return states[:n].clone()

    def _augment(self, cache, rows: int, span: int):
        mask, extra = self.inputs.mask(rows, span)
        view = SpanView(cache, self.inputs.write_at(rows), span)
        return self.block(self.hidden[:rows], self.inputs.tokens[:rows], self.inputs.positions[:rows], view, mask,
                          extra)


class MedusaGraphs(HeadsCalls):
    """Medusa's heads over the last hidden state (one row) as one static call."""

    kind = "medusa"

    def __init__(self, drafter, capture: bool | None = None):
        super().__init__(drafter, capture)
        self.module, self.hidden = drafter.levels, None

    @torch.inference_mode()
    def levels(self, hidden):
        if self.hidden is None or self.hidden.shape != hidden.shape or self.hidden.dtype != hidden.dtype:
            self.hidden, self.graphs.graphs = torch.zeros_like(hidden), {}
        self.hidden.copy_(hidden)
        return tuple(out.clone() for out in self.guarded("levels", lambda: self.module(self.hidden),
                                                         lambda: self.module(hidden)))


def heads_graphs(drafter, capacity: int, capture: bool | None = None):
    """The static twin of a Clover-2 or Medusa drafter's per-step modules (None for other drafters)."""
    kind = heads_kind(drafter)
    if kind == "clover":
        return CloverGraphs(drafter, capacity, capture=capture)
    if kind == "medusa":
        return MedusaGraphs(drafter, capture=capture)
    return None
