"""Making the compiled step's programs (clover_cli/step/aot.py runs them): the target's step and the heads' per-step
modules exported by torch.export with symbolic sizes, compiled by AOTInductor with the weights frozen into them,
checked against the eager modules (logits, hidden states and cache writes on random trees; the heads' states and
ranked tokens) and timed per tree size before a package is written: the engine sizes its trees from those timings
instead of measuring its own forwards on every start (StepCosts), keeps the sizes it runs current from its own
forwards, and scales the rest by them. Building takes one to two minutes on two cores: aot_build.py runs it in a
child process.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from .. import atomic
from ..errors import CloverError
from ..quantized import QuantLinear, fused_linears
from ..store import PROGRAM_VERSION
from . import SIZES, STATIC, heads_kind, static_sizes, weight_bytes
from .aot import (HEADS_PROGRAM_VERSION, MAX_LEVEL_ROWS, META, SMALL_ROWS, CompiledStep, HeadsPrograms, Program,
                  augment_name, describe_weights, heads_program_names, heads_weights, step_weights, sums)

# A step of a few tokens reads every weight once for a few rows of arithmetic, so its time is the weights' bytes. A
# checkpoint stored in float16 or bfloat16 and run in float32 (the bundled model; most Hub models on a CPU) holds only
# values that narrow type represents exactly: the programs for exactly 1, 2 and 4 tokens keep the linears' weights in
# it and widen each as it is read, the same float32 products from half the bytes (NarrowLinear). On the AVX2 machine
# the bundled model's programs took 2.0 / 2.4 / 3.9 ms a call for 1 / 2 / 4 tokens against 2.8 / 3.6 / 4.5 with
# float32 weights; for 8 tokens 7.2 against 6.2 (docs/BENCHMARKS.md): larger programs keep float32 weights, frozen
# and prepacked as before.
# For a small model whose weights stay in the CPU's caches the bytes do not count and the reductions lose: the
# bundled draft model (6 MB of float32 weights) took 0.37 / 0.32 / 0.46 ms for 1 / 2 / 4 tokens narrow against
# 0.25 / 0.26 / 0.37 ms. So weights narrow only where the float32 ones exceed NARROW_MIN_BYTES, half the last-level
# cache: every program holds its own copy of the weights, and the steps take turns with the drafters' programs.
NARROW_ROWS = 4


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The size of CPU 0's largest cache level (Linux sysfs), else `default`."""
    best = (0, default)
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
            size = int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0)
        except (OSError, ValueError):
            continue
        best = max(best, (level, size))
    return best[1]


NARROW_MIN_BYTES = last_level_cache_bytes() // 2
NARROW = (torch.float16, torch.bfloat16)


def narrow_dtype(model) -> torch.dtype | None:
    """The first of NARROW that holds every float32 nn.Linear weight of `model` exactly, or None (some weight needs
    float32, there are no linears, or they are NARROW_MIN_BYTES or fewer)."""
    # each weight once (linears may share one)
    weights = list({id(m.weight): m.weight.detach() for m in model.modules()
                    if isinstance(m, torch.nn.Linear)}.values())
    if not weights or any(w.dtype != torch.float32 for w in weights):
        return None
    if sum(w.numel() * w.element_size() for w in weights) <= NARROW_MIN_BYTES:
        return None  # they stay cached: the bytes do not count
    for dtype in NARROW:
        if all(torch.equal(w.to(dtype).float(), w) for w in weights):
            return dtype
    return None


class NarrowLinear(torch.nn.Module):
    """An nn.Linear whose weight is kept in a narrower type that holds it exactly, computed in the input's type as
    one multiply-and-sum per row of the input (its rows, dimension -2, a static size): inductor fuses the widening
    into the loads and the rows' sums into one loop, so the product reads each weight once, at half the bytes."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", linear.weight.detach().to(dtype))
        self.bias = linear.bias

    def forward(self, x):
        weight = self.weight.to(x.dtype)
        out = torch.stack([(x.select(-2, r).unsqueeze(-2) * weight).sum(-1) for r in range(x.shape[-2])], -2)
        return out if self.bias is None else out + self.bias


@contextmanager
def narrow_linears(model, dtype: torch.dtype):
    """Every nn.Linear of `model` a NarrowLinear of `dtype` while the block runs (an export), put back after."""
    swapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, NarrowLinear(child, dtype))
                swapped.append((parent, name, child))
    try:
        yield len(swapped)
    finally:
        for parent, name, child in reversed(swapped):
            setattr(parent, name, child)


def program_table(static=STATIC) -> tuple:
    """The programs of a package: (file, fewest rows, most (None: the capacity), the example size it is tuned at,
    autotuned, the register blocking of inductor's C++ float32 products (None: its own choice)).

    The static programs are autotuned: inductor times its own C++ kernels against oneDNN's per product on this machine
    at build and keeps the faster (on an AVX-512 machine 5-6 rows ran 15-18% faster than with oneDNN alone; on the
    AVX2 one oneDNN's were 3-4x slower for 1 row). For 5-8 rows on AVX-512 its kernels are built on 16x16 register
    blocks: on its default 8x48 ones a step of 7-8 tokens cost 15-19% more. The program for larger steps uses
    oneDNN's products, prepacked for its example size."""
    table = [(f"step-{n}.pt2", n, n, n, True, (16, 16) if 5 <= n <= 8 else None) for n in static]
    first = max(static, default=0) + 1
    return tuple(table) + (("step.pt2", first, None, max(first, 32), False, None),)


PROGRAMS = program_table()


# ---------------------------------------------------------------------------------------------------------------
# The target's step

class OnBuffers(torch.nn.Module):
    """Export wrapper: block(*inputs, cache) with the cache made over the trailing buffer inputs (every layer's keys,
    then every layer's values, [1, Hkv, capacity, D]), holding as many tokens as the `past` input is long. Its
    inputs are one variadic argument: dynamic shapes are given as a 1-tuple holding one spec per tensor."""

    def __init__(self, block: torch.nn.Module, n_inputs: int):
        super().__init__()
        self.block, self.n_inputs = block, n_inputs

    def forward(self, *args):
        from ..target import TreeKVCache

        inputs, past, buffers = args[:self.n_inputs], args[self.n_inputs], args[self.n_inputs + 1:]
        layers = len(buffers) // 2
        return self.block(*inputs, TreeKVCache.over(list(buffers[:layers]), list(buffers[layers:]), past.shape[0]))


class TargetStep(torch.nn.Module):
    """The target's step as the program computes it: Target.run with the tree mask after the committed tokens."""

    def __init__(self, target):
        super().__init__()
        self.model = target.model  # a submodule, so export sees its weights as parameters (frozen when compiled)
        self.target = target

    def forward(self, tokens, positions, tree, rows, cache):
        mask = torch.cat([tree.new_ones(tree.shape[0], cache.length), tree], 1)[None, None]
        return self.target.run(tokens, positions, mask, cache, rows)


def _example(target, n: int, past: int, seed: int = 0):
    """Program inputs for random tokens in a random tree (parents before children) after `past` committed ones."""
    from ..tree import DraftTree

    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    tree = DraftTree(torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist(), parents)
    return (torch.tensor(tree.tokens), past + torch.tensor(tree.depths()), torch.from_numpy(tree.ancestor_mask()),
            torch.arange(n), torch.empty(past, 0))


def export(module: torch.nn.Module, args: tuple, shapes) -> "torch.export.ExportedProgram":
    """torch.export with symbolic sizes where `shapes` says; sizes 0 and 1 are not special-cased (one program for a
    single token and for a tree)."""
    from torch.fx.experimental import _config as fx_config

    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        return torch.export.export(module, args, dynamic_shapes=shapes, strict=False)


def input_ranges(exported, dims: dict[str, tuple[int, int]]) -> dict[str, list[int]]:
    """The sizes an exported program accepts, as export worked them out: name -> [least, most] for the sizes named
    in `dims` (name -> (input index, dimension))."""
    inputs = [node for node in exported.graph.nodes if node.op == "placeholder"
              if node.name in set(exported.graph_signature.user_inputs)]
    out = {}
    for name, (index, dim) in dims.items():
        size = inputs[index].meta["val"].shape[dim]
        if isinstance(size, int):
            out[name] = [size, size]
            continue
        bounds = exported.range_constraints[size.node.expr]
        out[name] = [int(bounds.lower), int(bounds.upper)]
    return out


def compile_package(exported, path: Path, autotune: bool = False, blocking: tuple[int, int] | None = None,
                    freeze: bool = True, weights: bool = True) -> None:
    """AOTInductor, the weights frozen into the program (on a CPU: prepacked for oneDNN; q/k/v and gate/up fused).
    autotune: inductor also times its own C++ matrix-product kernels on this machine and keeps what is fastest.
    blocking: (rows, columns) of the register blocks those kernels use for float32 on AVX-512, when inductor has
    them (see register_blocking). freeze=False keeps the weights as the program's constants without folding anything
    into them (narrow weights: folding would widen them once, into float32 copies). weights=False leaves them out
    of the package: whoever loads it gives them (CompiledStep.share_weights)."""
    config = {"freezing": freeze, "cpp.enable_concat_linear": freeze, "aot_inductor.package_constants_in_so": weights}
    if autotune:  # quietly: inductor writes every product's timings to stderr otherwise
        config.update({"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                       "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False})
    with torch.no_grad(), torch._inductor.config.patch(config), register_blocking(blocking), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # inductor's own call, torch 2.13
        torch._inductor.aoti_compile_and_package(exported, package_path=str(path))


@contextmanager
def register_blocking(blocking: tuple[int, int] | None):
    """Inductor's C++ float32 products on AVX-512 built on (rows, columns) register blocks only, for the block.

    Inductor picks one of its blockings (8x48, 8x32, 16x16) by a static score that prefers the largest; for 7-8 rows
    the 16x16 ones ran 1.4-1.5x faster here (the products of a step alone; docs/BENCHMARKS.md). It offers no setting
    for this, so its table of micro-kernels is narrowed while the block runs. Without that table, or without such an
    entry (another torch, another instruction set), nothing changes."""
    if blocking is None:
        yield
        return
    try:
        import torch._inductor.compile_fx  # noqa: F401  (inductor's modules import in this order)
        from torch._inductor.codegen import cpp_micro_gemm
        from torch._inductor.cpu_vec_isa import VecAVX512

        table = cpp_micro_gemm.micro_gemm_configs
    except (ImportError, AttributeError):
        yield
        return

    def other_fp32_avx512(config) -> bool:
        return (config.vec_isa_cls is VecAVX512 and config.input_dtype == torch.float
                and config.input2_dtype == torch.float and tuple(config.register_blocking)[:2] != tuple(blocking))

    saved = {cls: list(configs) for cls, configs in table.items()}
    wanted = any(c.vec_isa_cls is VecAVX512 and tuple(c.register_blocking)[:2] == tuple(blocking)
                 for configs in saved.values() for c in configs)
    try:
        if wanted:
            for configs in table.values():
                configs[:] = [c for c in configs if not other_fp32_avx512(c)]
        yield
    finally:
        for cls, configs in saved.items():
            table[cls][:] = configs


@contextmanager
def building(out: Path):
    """A fresh directory beside `out` to build into; renamed to `out` (replacing it) when the block succeeds,
    removed when it fails: a package directory is complete or absent."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic.clean_stale(out)  # what builds that were killed left
    tmp = atomic.temp_dir(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_for(target, out: Path, log=print, static: tuple[int, ...] | None = None, autotune: bool = True) -> dict:
    """Export, compile, check and time the step programs of `target` (a Target whose cache capacity is the
    programs'), one for each of the `static` sizes (default: static_sizes() for its weights) and one for larger
    steps; write them to directory `out` atomically (built beside it, renamed into place). Returns the metadata
    written. autotune=False compiles the programs meant for autotuning without it (quicker to build, slower to
    run)."""
    t0 = time.perf_counter()
    capacity = target.cache.capacity
    with torch.inference_mode():  # allocates the cache buffers at full capacity
        target.cache.truncate(0)
        target.forward(torch.tensor([0], device=target.device))
    keys, values = target.cache.buffers()
    Dim = torch.export.Dim
    program = OnBuffers(TargetStep(target), 4).eval()
    exported, ranges = {}, {}
    if static is None:
        static = static_sizes(weight_bytes(target.model))
    narrow = narrow_dtype(target.model)
    narrowed = {}  # program -> the type its linears' weights are kept in (NarrowLinear)
    # a quantized model's q/k/v and gate/up products are one call of its kernel each (fused_linears), in every
    # program; check() compares them with the eager step, which calls them one by one
    with fused_linears(target.model):
        for name, lo, hi, example_n, tuned, blocking in program_table(static):
            hi = min(hi or capacity - 1, capacity - 1)
            if lo > hi:
                continue  # more rows than the buffers hold
            example_n = min(example_n, hi)
            # how many committed tokens a program takes is for export to work out (past + n < capacity at least; some
            # models need more): the ranges it finds are kept and a step outside them runs another program or eager
            if lo == hi:  # every size static: the program computes the logits of all its rows
                shapes = ((None, None, None, None, {0: Dim.DYNAMIC}, *(None for _ in keys + values)),)
            else:
                n, rows = Dim("n", min=lo, max=hi), Dim("rows", min=1, max=hi)
                shapes = (({0: n}, {0: n}, {0: n, 1: n}, {0: rows}, {0: Dim.DYNAMIC}, *(None for _ in keys + values)),)
            example = _example(target, example_n, min(max(37, capacity // 2), capacity - example_n - 1))
            if narrow is not None and lo == hi <= NARROW_ROWS:  # a few rows: half the bytes (see NARROW)
                with narrow_linears(target.model, narrow):
                    exported[name] = (export(program, (*example, *keys, *values), shapes), False, None)
                narrowed[name] = str(narrow).removeprefix("torch.")
            else:
                exported[name] = (export(program, (*example, *keys, *values), shapes), autotune and tuned, blocking)
            ranges[name] = input_ranges(exported[name][0], {"n": (0, 0), "past": (4, 0)})
    log(f"compiling (AOTInductor, weights frozen) ... {time.perf_counter() - t0:.0f} s")
    # a quantized (or bfloat16) model's programs read its own records (CompiledStep.share_weights): built without a
    # copy of them, which cost ~200 MB of disk and ~400 MB of memory once loaded for each of SmolLM2's Q4_1 programs
    bare = any(isinstance(m, QuantLinear) for m in target.model.modules())
    weights = step_weights(target.model)
    outside, shapes = [], {}
    try:
        with building(out) as tmp:
            for name, (program, tuned, blocking) in exported.items():
                freeze = name not in narrowed
                if bare and freeze:
                    compile_package(program, tmp / name, tuned, blocking, weights=False)
                    names = Program(tmp / name).constant_names() or [None]
                    if set(names) <= set(weights):
                        outside.append(name)
                        shapes.update(describe_weights(weights, names))
                        continue
                    # it reads a constant of its own (folded at build time): the package keeps its weights
                compile_package(program, tmp / name, tuned, blocking, freeze=freeze)
            step = CompiledStep(tmp, capacity, ranges, outside, shapes)
            step.share_weights(target.model)
            check(step, target)
            meta = {"program": PROGRAM_VERSION, "capacity": capacity, "ranges": ranges, "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "narrow": narrowed, "weights_outside": outside,
                    "weight_shapes": shapes,
                    "verify_s": measure(step, target),
                    "build_s": round(time.perf_counter() - t0, 1), "files": sums(tmp, ranges)}
            atomic.write_text(tmp / META, json.dumps(meta, indent=1))
    finally:
        target.cache.truncate(0)
    return meta


@torch.inference_mode()
def check(step: "CompiledStep", target, tolerance: float = 1e-3):
    """The package must compute what the eager forward computes: logits, hidden states and the keys and values it
    writes, on random trees of a few sizes after the keys and values of random committed tokens (the model's own:
    random values in the cache make a deep model's attention chaotic, and two correct programs 1e-3 apart)."""
    from clover_kernels.quant import float_activations

    from ..target import EXACT_ROWS

    keys, values = target.cache.buffers()
    g = torch.Generator().manual_seed(1)
    attached, target.program = target.program, None  # the reference is the eager forward
    try:
        with float_activations():  # int8 rounding would turn the two programs' float32 noise into differences
            _compare(step, target, keys, values, g, tolerance)
        if getattr(target.model, EXACT_ROWS, False):
            _same_rows(step, target, keys, values, g)
    finally:
        target.program = attached
        target.cache.truncate(0)


def _compare(step, target, keys, values, g, tolerance):
    from ..target import TreeKVCache

    served = 0
    for n, past in ((1, 0), (1, 9), (3, 12), (7, 23), (16, 40), (20, 3), (2, 300), (9, 200), (33, 150)):
        past = min(past, step.capacity - n - 1)
        if step._route(n, past) is None:
            continue  # a step the program does not take runs eager
        served += 1
        target.cache.truncate(0)
        if past:  # the committed tokens' keys and values, by the eager forward
            target.forward(torch.randint(0, target.config.vocab_size, (past,), generator=g, device=target.device))
        tokens, positions, tree, rows, _ = _example(target, n, past, seed=n)
        mine = TreeKVCache.over([k.clone() for k in keys], [v.clone() for v in values], past)
        pre_c, logits_c = step(mine, tokens, positions, tree, None)
        target.cache.length = past
        pre_e, logits_e = target.forward(tokens, positions, tree)
        scale = max(1.0, float(logits_e.abs().max()))
        errors = {"logits": float((logits_c - logits_e).abs().max()) / scale,
                  "hidden states": float((pre_c - pre_e).abs().max()) / max(1.0, float(pre_e.abs().max())),
                  "keys": 0.0}
        for a, b in zip(mine.buffers()[0], keys):
            a, b = a[:, :, past:past + n].float(), b[:, :, past:past + n].float()
            error = float((a - b).abs().max())
            if keys[0].dtype == torch.float16:
                # float32 noise rounds a key to the neighbouring float16 now and then, and that difference goes on
                # through the later layers' attention into their keys: one float16 step of the layer's largest key
                # (an element-wise bound of one step failed on SmolLM2 by 0.002 at 16 tokens, in a deep layer)
                error = max(0.0, error / max(1.0, float(b.abs().max())) - 2.0 ** -10)
            errors["keys"] = max(errors["keys"], error)
        worst = max(errors, key=lambda k: (errors[k] != errors[k], errors[k]))  # NaN first
        if not errors[worst] <= tolerance:  # also catches NaN
            raise CloverError(f"the compiled step disagrees with the eager one (its {worst} by {errors[worst]:.2g} "
                              f"with {n} new tokens after {past})")
    if served < 5:
        raise CloverError("the compiled step takes too few of the step sizes it was built for")


def _same_rows(step, target, keys, values, g):
    """Activations rounded to int8: exactness rests on every program giving a row the same bits, so a chain of new
    tokens in one forward must give each of them exactly the logits of one-token forwards, one after the other."""
    from ..target import TreeKVCache

    for n, past in ((5, 40), (16, 300), (40, 100)):
        past = min(past, step.capacity - n - 1)
        if step._route(n, past) is None or step._route(1, past) is None:
            continue
        target.cache.truncate(0)
        target.forward(torch.randint(0, target.config.vocab_size, (past,), generator=g, device=target.device))
        tokens = torch.randint(0, target.config.vocab_size, (n,), generator=g, device=target.device)
        positions = torch.arange(past, past + n, device=target.device)
        chain = TreeKVCache.over([k.clone() for k in keys], [v.clone() for v in values], past)
        _, together = step(chain, tokens, positions, torch.ones(n, n, dtype=torch.bool).tril(), None)
        alone = TreeKVCache.over([k.clone() for k in keys], [v.clone() for v in values], past)
        for i in range(n):
            _, logits = step(alone, tokens[i:i + 1], positions[i:i + 1], None, None)
            alone.append(1)
            if not torch.equal(logits[0], together[i]):
                raise CloverError(f"the compiled step gives token {i + 1} of {n} after {past} other logits alone than "
                                  f"in one forward with the others (int8 activations need the same bits)")


@torch.inference_mode()
def measure(step: "CompiledStep", target, repeats: int = 7) -> dict[str, float]:
    """Seconds per compiled forward by number of new tokens (the best of `repeats`). The sizes take turns, one
    forward each per round: a build often shares the machine (with the chat it runs beside), and a busy spell then
    slows every size alike instead of a few of them, which would skew the trees the engine sizes from this table
    (sizes it does not run keep these costs). The first round only warms up."""
    from ..target import TreeKVCache

    keys, values = target.cache.buffers()
    cache = TreeKVCache.over(keys, values, 0)
    examples = {}
    for n in SIZES:
        past = min(200, step.capacity - n - 1)
        if step._route(n, past) is not None:
            examples[n] = (past, _example(target, n, past, seed=n)[:3])
    best = {n: float("inf") for n in examples}
    for round_ in range(repeats + 1):
        for n, (past, (tokens, positions, tree)) in examples.items():
            cache.length = past
            t = time.perf_counter()
            step(cache, tokens, positions, tree, None)
            if round_:
                best[n] = min(best[n], time.perf_counter() - t)
    return {str(n): seconds for n, seconds in best.items()}


# ---------------------------------------------------------------------------------------------------------------
# The heads' programs

def augment_sizes() -> tuple[int, ...]:
    """The fixed sizes of a Clover-2 catch-up's own programs: those of static_sizes() up to SMALL_ROWS (default 1, 2
    and 4). A catch-up of up to 4 positions (nearly all) runs the smallest >= its size, padded. Built for exactly its
    rows, the augmenting block cost 0.41-0.60 ms right after a target step, against 0.93-1.20 ms in a program for 1-4
    rows (bundled heads, AVX2 machine; docs/BENCHMARKS.md)."""
    return tuple(n for n in static_sizes() if n <= SMALL_ROWS)


def build_heads_for(drafter, capacity: int, out: Path, log=print, autotune: bool = True) -> dict:
    """Export, compile and check the programs of a heads drafter (on an eager target); write them to `out`.
    autotune=False compiles the programs meant for autotuning without it (quicker to build, slower to run)."""
    t0 = time.perf_counter()
    kind = heads_kind(drafter)
    H = drafter.heads.cfg.hidden_size
    dev = drafter.target.device
    Dim = torch.export.Dim
    exported = {}
    if kind == "clover":
        drafter.cache.grow_to(capacity)
        drafter.reset(0)
        drafter.observe(torch.zeros(1, H, device=dev), torch.zeros(1, dtype=torch.long, device=dev))
        drafter._catch_up()  # allocates the heads' cache buffers at full capacity
        drafter.reset(0)
        keys, values = drafter.cache.buffers()
        ranges = {}
        # (program, fewest and most new positions, example size, autotuned): one for any size, one for each fixed size
        for name, least, most, example_n, tuned in (("augment.pt2", 1, capacity - 1, 5, False),
                                                    *((augment_name(m), m, m, m, True) for m in augment_sizes())):
            example = (torch.randn(example_n, H), torch.arange(example_n), torch.arange(20, 20 + example_n),
                       torch.empty(20, 0))
            n = Dim("n", min=least, max=most) if least < most else None
            rows = {0: n} if n is not None else None
            program = export(OnBuffers(drafter.augment_block, 3).eval(), (*example, *keys, *values),
                             ((rows, rows, rows, {0: Dim.DYNAMIC}, *(None for _ in keys + values)),))
            exported[name] = (program, tuned)
            ranges[name] = input_ranges(program, {"n": (0, 0), "past": (3, 0)})
        exported["level0.pt2"] = (export(drafter.levels[0].eval(), (torch.randn(1, H), torch.tensor([3])), None),
                                  True)
        for name, most, example_n, tuned in (("level.pt2", MAX_LEVEL_ROWS, 3, False),
                                             ("level-small.pt2", SMALL_ROWS, 2, True)):
            rows = Dim("rows", min=1, max=most)
            exported[name] = (export(drafter.levels[1].eval(), (torch.randn(example_n, H),
                                                                torch.arange(3, 3 + example_n)),
                                     ({0: rows}, {0: rows})), tuned)
    else:
        exported["levels.pt2"] = (export(drafter.levels.eval(), (torch.randn(1, H),), None), True)
        ranges = None
    log(f"compiling the {kind} heads' programs ... {time.perf_counter() - t0:.0f} s")
    # heads of 8-bit integers (beside a quantized target) are built without their weights and read the drafter's
    # (HeadsPrograms.share_weights): each program held a copy of the target's input embedding otherwise, ~113 MB of
    # disk and ~226 MB of memory for SmolLM2's
    bare = getattr(drafter, "int8", False)
    outside, shapes = [], {}
    with building(out) as tmp:
        for name, (program, tuned) in exported.items():
            if bare:
                compile_package(program, tmp / name, autotune and tuned, weights=False)
                names, named = Program(tmp / name).constant_names() or [None], heads_weights(drafter, name)
                if set(names) <= set(named):
                    outside.append(name)
                    shapes[name] = describe_weights(named, names)
                    continue
            compile_package(program, tmp / name, autotune and tuned)
        check_heads(HeadsPrograms(tmp, kind, capacity, ranges, outside, drafter, shapes), drafter)
        meta = {"program": HEADS_PROGRAM_VERSION, "kind": kind, "capacity": capacity, "topk": drafter.grower.topk,
                "augment_ranges": ranges, "weights_outside": outside, "weight_shapes": shapes,
                "build_s": round(time.perf_counter() - t0, 1),
                "files": sums(tmp, heads_program_names(kind, ranges))}
        atomic.write_text(tmp / META, json.dumps(meta, indent=1))
    drafter.reset(0)
    return meta


@torch.inference_mode()
def check_heads(programs: HeadsPrograms, drafter, tolerance: float = 1e-3):
    """The heads' programs must compute what their eager modules compute, on random states and tokens."""
    g = torch.Generator().manual_seed(2)
    H = drafter.heads.cfg.hidden_size
    vocab = drafter.target.config.vocab_size

    def close(a, b, what):
        worst = float((a - b).abs().max()) / max(1.0, float(b.abs().max()))
        if not worst <= tolerance:
            raise CloverError(f"the compiled {programs.kind} heads disagree with the eager ones ({what}: relative "
                              f"error {worst:.2g})")

    def same_top(compiled, eager, what):
        (cp, ci), (ep, ei) = compiled, eager
        close(cp, ep, what)
        distinct = (ep[..., :-1] - ep[..., 1:]).abs() > 1e-4  # ranks of near-equal probabilities may swap
        if not torch.equal(ci[..., :-1][distinct], ei[..., :-1][distinct]):
            raise CloverError(f"the compiled {programs.kind} heads rank tokens differently ({what})")

    if programs.kind == "medusa":
        hidden = torch.randn(1, H, generator=g)
        same_top(programs.levels(hidden), drafter.levels(hidden), "levels")
        return
    keys, values = drafter.cache.buffers()
    served = 0
    for n, past in ((1, 0), (6, 17), (3, 100), (9, 40)):
        drafter.cache.length = past
        if not programs.fits(drafter.cache, n):
            continue
        served += 1
        for buf in keys + values:
            buf.copy_(torch.randn(buf.shape, generator=g) * 0.5)
        hidden = torch.randn(n, H, generator=g)
        tokens = torch.randint(0, vocab, (n,), generator=g)
        positions = torch.arange(past, past + n)
        mine = type(drafter.cache).over([k.clone() for k in keys], [v.clone() for v in values], past)
        drafter.cache.length = past
        close(programs.augment(hidden, tokens, positions, mine),
              drafter.augment_block(hidden, tokens, positions, drafter.cache), f"augment {n} after {past}")
        for a, b in zip(mine.buffers()[0] + mine.buffers()[1], keys + values):
            close(a[:, :, past:past + n], b[:, :, past:past + n], "the heads' cache")
    if served < 2:
        raise CloverError(f"the compiled {programs.kind} heads take too few of the sizes they were built for")
    for first, rows in ((True, 1), (False, 1), (False, SMALL_ROWS), (False, SMALL_ROWS + 1)):
        states, tokens = torch.randn(rows, H, generator=g), torch.randint(0, vocab, (rows,), generator=g)
        compiled = programs.levels[0 if first else 1](states, tokens)
        eager = drafter.levels[0 if first else 1](states, tokens)
        close(compiled[0], eager[0], "level states")
        same_top(compiled[1:], eager[1:], f"level of {rows}")
    drafter.cache.length = 0
