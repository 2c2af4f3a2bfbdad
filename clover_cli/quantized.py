"""Quantized weights on the CPU: a GGUF's own blocks (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) kept as
they are, any float model's linears quantized in groups of 32 (--quantize int8 | int4), or its weights rounded to
bfloat16 (--dtype bfloat16), run by the kernels of clover_kernels.quant (C++, AVX-512 where the CPU has it), inside
the eager forward and the compiled step.

The weights a step streams are what bounds it on a CPU: SmolLM2-135M's Q4_1 file holds 98 MB where its float32
weights take 538 MB (bfloat16: 269 MB). Where the kernel has AVX-512 VNNI, a QuantLinear of integers rounds its
activations to int8 per group of the weights' scales and multiplies integers by integers exactly, as llama.cpp runs a
GGUF's blocks (2-3x cheaper than float32 activations from 8 rows up; elsewhere the float32 activations as they are);
bfloat16 weights are widened and multiply the float32 activations as they are. A row's result does not depend on the
other rows. The int8 rounding turns float32 noise into different numbers, so with it every attention of the model
runs clover's attention whose rows do not depend on the batch either (clover_kernels.attention.exact_rows;
EXACT_ROWS): a draft tree's verify then gives each node bit for bit what a one-token step gives, and speculative
decoding stays exact with respect to the quantized target that runs (its own greedy decoding; transformers' generate
on the same model, eager). A bfloat16 model runs it too where it has its AVX-512 path (its rows then match one-token
steps bit for bit as well, and it is cheaper than SDPA at a few rows). `--dtype float32` runs the dequantized weights
as floats instead.

A GGUF's blocks are decoded when the file is converted (gguf_model.py) and written beside the converted model
(BLOCKS_FILE), each tensor only after its blocks were checked to hold exactly the float weights transformers made of
it (rows reordered where transformers reorders them: Llama's q and k); a tensor of another type, or one that does not
match, stays float and is counted in the description.

    weights_for(...)                  which weights a session runs: "float", "gguf", "int8", "int4"
    apply(model, model_dir, weights)  the model's linears as QuantLinears; returns what was done, in words
    gguf_blocks(reader, model)        decode and check a GGUF's tensors (at conversion)
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from clover_kernels.attention import HEAD_SIZES

from .errors import CloverError, one_line
from .loading import DTYPES
from .options import check_quantize
from .target import EXACT_ROWS, KV_FLOAT16, head_size

BLOCKS_FILE = "clover-gguf-blocks.safetensors"  # in a converted GGUF directory: its tensors' blocks, repacked
BLOCKS_VERSION = 1  # bump when the packed records change: older files are not used (the model runs float)
WEIGHTS = ("float", "gguf", "int8", "int4", "bf16")
GROUP = 32  # --quantize: weights per scale
# GGUF tensor types run in their own blocks, and how: (bits of the kernel's integers, weights per scale)
GGUF_TYPES = {"Q8_0": (8, 32), "Q4_0": (4, 32), "Q4_1": (4, 32), "Q5_0": (8, 32), "Q5_1": (8, 32),
              "Q4_K": (4, 32), "Q5_K": (8, 32), "Q6_K": (8, 16)}

_kernels_ok: bool | None = None


def kernels(warn=None) -> bool:
    """Whether the quantized kernels are built and loaded (built once per machine into clover's cache, ~20 s);
    False with one line when this machine cannot build them (no C++ compiler, say)."""
    global _kernels_ok
    if _kernels_ok is None:
        from clover_kernels import quant

        from .store import kernels_dir

        try:
            quant.load(kernels_dir())
            _kernels_ok = True
        except Exception as e:  # noqa: BLE001 - a compiler's failure comes in many shapes
            _kernels_ok = False
            (warn or _say)(f"cannot build the quantized kernels here ({one_line(e)}): the weights run as floats")
    return _kernels_ok


def _say(text: str) -> None:
    print(f"clover: {text}", file=sys.stderr)


class QuantLinear(nn.Module):
    """A linear layer whose weight is packed records of integers and scales (clover_kernels.quant.Packed), its
    activations rounded to int8 per group with `act8` (the kernel's ACT8; or the packed kind's flag), else multiplied
    as they are; or bfloat16 records, multiplied by the float32 activations. `weight` gives the float weight it holds
    (dequantized when first asked, or the float tensor it was made from, as a tied embedding is): the drafters
    project through the target's lm_head weight."""

    def __init__(self, packed, in_features: int, bias: torch.Tensor | None = None, weight=None, fmt: str = "",
                 act8: bool = False):
        from clover_kernels.quant import ACT8, BF16, act8_records

        super().__init__()
        if act8 and packed.kind != BF16 and not packed.kind & ACT8:
            packed = act8_records(packed)
        self.register_buffer("packed", packed.data, persistent=False)
        self.out_features, self.in_features = packed.out_features, in_features
        self.padded, self.kind, self.format = packed.in_features, packed.kind, fmt
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._weight = weight

    @property
    def weight(self) -> torch.Tensor:
        if self._weight is None:
            from clover_kernels.quant import Packed

            w = Packed(self.packed, self.out_features, self.padded, self.kind).dequantize()
            self._weight = w[:, :self.in_features].contiguous()
        return self._weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.clover_quant.linear(x, self.packed, self.out_features, self.padded, self.kind)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.format}"


def weight_count(module: nn.Module) -> int:
    """The module's distinct parameters (a tied one counted once), a QuantLinear's weight counted as the float
    weight it holds (once: a tied output embedding's is the input embedding's)."""
    seen, total = set(), 0
    for p in module.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel()
    for m in module.modules():
        if isinstance(m, QuantLinear) and (m._weight is None or m._weight.data_ptr() not in seen):
            total += m.out_features * m.in_features
    return total


def float_state_dict(module: nn.Module) -> dict:
    """module.state_dict() with each QuantLinear's float weight in it, as an nn.Linear's would be (the drafters
    start their layers as copies of the target's)."""
    state = module.state_dict()
    for name, sub in module.named_modules():
        if isinstance(sub, QuantLinear):
            state[f"{name}.weight" if name else "weight"] = sub.weight
    return state


def weights_for(quantize: str | None, dtype: str, device: torch.device, model_dir: Path) -> str:
    """The weights a session runs: --quantize's; on a CPU, --dtype bfloat16's ("bf16": a float32 model whose
    weights are rounded to bfloat16, its linears run by the kernels from half the bytes), or a GGUF's own blocks
    unless a --dtype asks for floats; else float."""
    if quantize is not None:
        check_quantize(quantize, dtype)
        if device.type != "cpu":
            raise CloverError("--quantize runs on the CPU; on a GPU use --load-in-8bit or --load-in-4bit")
        return quantize
    if device.type == "cpu" and DTYPES.get(dtype) == torch.bfloat16:  # --dtype bfloat16 (or bf16)
        return "bf16"
    if device.type == "cpu" and dtype == "auto" and (Path(model_dir) / BLOCKS_FILE).is_file():
        return "gguf"
    return "float"


def load_dtype(weights: str, dtype: str) -> str:
    """The --dtype a model is loaded in for `weights`: bfloat16 weights are loaded in float32 (and rounded by
    apply) since their kernels compute in float32."""
    return "float32" if weights == "bf16" else dtype


def apply(model, model_dir: Path, weights: str, warn=None) -> str | None:
    """Make the model's linears QuantLinears for `weights` ("gguf": the blocks in model_dir's BLOCKS_FILE; "int8" or
    "int4": quantized now; "bf16": every weight of the float32 model rounded to bfloat16, the linears' kept so).
    Returns what runs, in words (None for float weights, or when the kernels cannot be built: the model then runs as
    it is, with one line)."""
    if weights == "float":
        return None
    if not kernels(warn):
        return None
    if weights == "gguf":
        blocks = read_blocks(Path(model_dir) / BLOCKS_FILE, warn)
        if not blocks:
            return None
    elif weights == "bf16":
        blocks = bf16_model(model)
    else:
        blocks = quantize_model(model, 8 if weights == "int8" else 4)
    # integers take int8 activations where the kernel has SIMD for them (AVX-512 VNNI or AVX2) and every attention
    # can run rows independent of the batch (EXACT_ROWS); elsewhere the float32 activations as they are. The kernel's
    # rows never depend on the batch, so with exact_rows a bfloat16 model's verify gives every node a one-token step's
    # bits too
    from clover_kernels import attention
    from clover_kernels.quant import int8_activations

    exact = head_size(model.config) in HEAD_SIZES and attention.simd()
    act8 = weights != "bf16" and int8_activations() and exact
    replace_linears(model, blocks, act8)
    if act8 or (weights == "bf16" and exact):
        for module in model.modules():
            setattr(module, EXACT_ROWS, True)
    # with int8 activations the target is llama.cpp's kind of computation already: its KV cache in float16, as
    # llama.cpp keeps it (a bfloat16 model keeps float32 keys and values: it matches transformers' generate)
    setattr(model, KV_FLOAT16, act8)
    return describe(model)


def describe(model) -> str:
    """The weight formats of the model's linears and their bytes, in words ("Q4_1 x210, Q8_0 x1: 96 MiB of linear
    weights, int8 activations")."""
    from clover_kernels.quant import ACT8

    kinds: dict[str, int] = {}
    size, act8 = 0, False
    for module in model.modules():
        if isinstance(module, QuantLinear):
            act8 = act8 or bool(module.kind & ACT8)
            kinds[module.format] = kinds.get(module.format, 0) + 1
            size += module.packed.numel()
        elif isinstance(module, nn.Linear):
            kinds["float"] = kinds.get("float", 0) + 1
            size += module.weight.numel() * module.weight.element_size()
    parts = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    return f"{parts}: {size / 2**20:.0f} MiB of linear weights" + (", int8 activations" if act8 else "")


def replace_linears(model, blocks: dict, act8: bool = False) -> int:
    """Swap each nn.Linear named in `blocks` (module name -> (Packed, format)) for a QuantLinear (int8 activations
    with `act8`). The output embedding keeps its float weight for the drafters (a tied one: the input embedding's).
    Returns how many."""
    out_embed = model.get_output_embeddings()
    tied = out_embed is not None and out_embed.weight is model.get_input_embeddings().weight
    done = 0
    for name, module in list(model.named_modules()):
        if name not in blocks or not isinstance(module, nn.Linear):
            continue
        packed, fmt = blocks[name]
        if packed.out_features != module.out_features or packed.in_features < module.in_features:
            raise CloverError(f"the quantized weights of {name} are {packed.out_features}x{packed.in_features}, "
                              f"the model's {module.out_features}x{module.in_features}")
        keep = module.weight.detach() if module is out_embed and tied else None
        quant = QuantLinear(packed, module.in_features, module.bias, keep, fmt, act8)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, quant)
        done += 1
    return done


# ---------------------------------------------------------------------------------------------------------------
# The compiled step's fused products: q/k/v and gate/up, each one call of the kernel

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # siblings a decoder layer feeds one input


class _Shared:
    """A fused QuantLinear's output for the input it was last called with (its slices ask in turn)."""

    def __init__(self, fused: QuantLinear):
        self.fused, self.x, self.y = fused, None, None

    def __call__(self, x):
        if x is not self.x:
            self.x, self.y = x, self.fused(x)
        return self.y


class SliceOf(nn.Module):
    """One of several linears computed as one QuantLinear: its outputs [start, stop). Called with another input
    than its siblings it computes the fused product again: the result is right either way."""

    def __init__(self, shared: _Shared, start: int, stop: int):
        super().__init__()
        self.fused = shared.fused  # a submodule: export sees its records
        self.shared, self.start, self.stop = shared, start, stop

    def forward(self, x):
        return self.shared(x)[..., self.start:self.stop]


@contextmanager
def fused_linears(model):
    """While the block runs (an export), each decoder layer's q/k/v and gate/up QuantLinears of one layout are one
    QuantLinear whose records are theirs end to end (their outputs a multiple of 16: whole tiles), sliced: fewer,
    larger calls of the kernel. Put back after."""
    from clover_kernels.quant import Packed

    swapped, shared = [], []
    for parent in list(model.modules()):
        for names in FUSED:
            parts = [getattr(parent, n, None) for n in names]
            if not all(isinstance(p, QuantLinear) for p in parts):
                continue
            if len({(p.kind, p.padded, p.in_features, p.bias is None) for p in parts}) != 1 or \
                    any(p.out_features % 16 for p in parts):
                continue
            first = parts[0]
            bias = None if first.bias is None else torch.cat([p.bias for p in parts])
            packed = Packed(torch.cat([p.packed for p in parts]), sum(p.out_features for p in parts), first.padded,
                            first.kind)
            one = _Shared(QuantLinear(packed, first.in_features, bias, fmt=first.format))
            shared.append(one)
            start = 0
            for name, part in zip(names, parts):
                setattr(parent, name, SliceOf(one, start, start + part.out_features))
                swapped.append((parent, name, part))
                start += part.out_features
    try:
        yield len(swapped)
    finally:
        for parent, name, part in reversed(swapped):
            setattr(parent, name, part)
        for one in shared:
            one.x = one.y = None


# ---------------------------------------------------------------------------------------------------------------
# --quantize: groupwise round-to-nearest, scales in float16 (as a GGUF's Q8_0 and Q4_1 keep them)

def quantize_weight(w: torch.Tensor, bits: int, group: int = GROUP):
    """(q [N, K padded to the group], d, m) of float weight w [N, K] in groups of `group`: 8-bit symmetric (d = max|w| / 127, Q8_0's rule) or
    4-bit affine (d = (max - min) / 15, m = min, Q4_1's), d and m rounded to float16 first."""
    w = w.detach().float()
    n, k = w.shape
    pad = -k % group
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    g = w.view(n, -1, group)
    if bits == 8:
        d = (g.abs().amax(dim=2) / 127).half().float()
        q = torch.where(d[..., None] > 0, torch.round(g / d[..., None].clamp_min(1e-30)), 0).clamp(-127, 127)
        return q.view(n, -1).to(torch.int8).numpy(), d.numpy(), None
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    m = lo.half().float()
    d = ((hi - m) / 15).half().float()
    q = torch.where(d[..., None] > 0, torch.round((g - m[..., None]) / d[..., None].clamp_min(1e-30)), 0).clamp(0, 15)
    return q.view(n, -1).to(torch.uint8).numpy(), d.numpy(), m.numpy()


def quantize_model(model, bits: int) -> dict:
    """Module name -> (Packed, format) for every linear of the model's decoder (`bits`) and its output embedding
    (8 bits: the logits are where a coarser weight shows most, and llama.cpp's 4-bit files keep it wider too)."""
    from clover_kernels.quant import pack

    out_embed = model.get_output_embeddings()
    blocks = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module.weight.device.type == "meta":
            continue
        b = 8 if module is out_embed else bits
        q, d, m = quantize_weight(module.weight, b)
        blocks[name] = (pack(q, d, m, b), f"int{b}")
    return blocks


def runs_quantized(model: nn.Module) -> bool:
    """Whether `model` runs linears of integers on a CPU whose kernel multiplies int8 activations with SIMD (the
    weights a GGUF brings, or --quantize's): then small models that run beside it (draft heads) can too."""
    from clover_kernels import quant

    return quant.int8_activations() and any(isinstance(m, QuantLinear) and m.packed.device.type == "cpu"
                                            and m.kind & quant.ACT8 for m in model.modules())


def heads_int8(weights: str) -> bool:
    """Whether draft heads beside a target with these weights (weights_for) run as 8-bit integers: what
    runs_quantized says of the target once it is loaded (for `clover compile`, which names their programs first)."""
    if weights not in ("gguf", "int8", "int4") or not kernels(warn=lambda _: None):
        return False
    from clover_kernels import quant

    return quant.int8_activations()


def int8_linear(linear: nn.Linear) -> QuantLinear:
    """A float linear (nn.Linear, or a PackedLinear made of one) as a QuantLinear of 8-bit integers in groups of 32
    with int8 activations: --quantize int8's weights, a quarter of float32's bytes."""
    from clover_kernels.quant import pack

    q, d, m = quantize_weight(linear.weight, 8)
    bias = None if linear.bias is None else linear.bias.detach().float()
    return QuantLinear(pack(q, d, m, 8), linear.in_features, bias, None, "int8", act8=True)


def int8_linears(module: nn.Module) -> int:
    """Every float linear inside `module` made an int8_linear, in place; returns how many. For what only proposes
    tokens (draft heads): the target verifies each, so the rounding changes what is drafted, never the output."""
    done = 0
    for name, linear in list(module.named_modules()):
        if not name or not isinstance(linear, nn.Linear) or linear.weight.device.type != "cpu":
            continue
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child, int8_linear(linear))
        done += 1
    return done


def bf16_model(model) -> dict:
    """Round every float32 parameter of the model (embeddings and norms too; not the buffers it computes, as RoPE's
    frequencies) to bfloat16 in place: it becomes a bfloat16 checkpoint loaded in float32 (transformers'
    `from_pretrained(..., dtype=torch.float32)` of the model saved in bfloat16).
    Module name -> (Packed, "bf16") for its linears (the kernels multiply them widened, exactly, by float32
    activations)."""
    from clover_kernels.quant import pack_bf16

    with torch.no_grad():
        for tensor in model.parameters():
            if tensor.dtype == torch.float32 and tensor.device.type != "meta":
                tensor.copy_(tensor.to(torch.bfloat16))
    return {name: (pack_bf16(module.weight), "bf16") for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module.weight.device.type != "meta"}


# ---------------------------------------------------------------------------------------------------------------
# A GGUF's own blocks: decoded into integers and scales, checked against transformers' float weights

def _half(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 8 six-bit scales and mins of each super-block from its 12 bytes [blocks, 12]."""
    s = s.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), np.uint8)
    mn = np.empty((s.shape[0], 8), np.uint8)
    sc[:, :4], mn[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def decode(type_name: str, raw: np.ndarray, n: int, k: int):
    """(q [n, k], d, m or None, bits) of a GGUF tensor of `type_name` from its bytes, such that d * q + m (per group)
    is what the gguf package dequantizes it to; None for a type not run in its own blocks."""
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if type_name == "Q8_0":
        b = raw.reshape(-1, 34)
        return b[:, 2:].view(np.int8).reshape(n, k), _half(b[:, :2]).reshape(n, -1), None, 8
    if type_name in ("Q4_0", "Q4_1"):
        width = 18 if type_name == "Q4_0" else 20
        b = raw.reshape(-1, width)
        qs = b[:, width - 16:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1).reshape(n, k)
        d = _half(b[:, :2]).reshape(n, -1)
        m = -8 * d if type_name == "Q4_0" else _half(b[:, 2:4]).reshape(n, -1)
        return q, d, m, 4
    if type_name in ("Q5_0", "Q5_1"):
        width = 22 if type_name == "Q5_0" else 24
        b = raw.reshape(-1, width)
        qh = np.ascontiguousarray(b[:, width - 20:width - 16]).view(np.uint32)[:, 0]
        qs = b[:, width - 16:].astype(np.int16)
        bits = ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4
        q = (np.concatenate([qs & 0xF, qs >> 4], axis=1) | bits).reshape(n, k)
        d = _half(b[:, :2]).reshape(n, -1)
        if type_name == "Q5_0":
            return (q - 16).astype(np.int8), d, None, 8
        return q.astype(np.int8), d, _half(b[:, 2:4]).reshape(n, -1), 8
    if type_name in ("Q4_K", "Q5_K"):
        width = 144 if type_name == "Q4_K" else 176
        b = raw.reshape(-1, width)
        d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        qs = b[:, width - 128:].reshape(-1, 4, 32)
        q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 256).astype(np.int16)  # chunk i: sub-blocks 2i, 2i+1
        if type_name == "Q5_K":
            qh = b[:, 16:48]
            hi = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).astype(np.int16)
            q = q | (hi.reshape(-1, 256) << 4)  # bit j of qh[l]: element 32 j + l
        return (q.reshape(n, k).astype(np.uint8 if type_name == "Q4_K" else np.int8),
                (d * sc).reshape(n, -1), -(dmin * mn).reshape(n, -1), 4 if type_name == "Q4_K" else 8)
    if type_name == "Q6_K":
        b = raw.reshape(-1, 210)
        ql, qh = b[:, 0:128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
        scales = b[:, 192:208].view(np.int8).astype(np.float32)
        d = _half(b[:, 208:210])
        parts = [(ql[:, :, :32] & 0xF) | ((qh & 3) << 4), (ql[:, :, 32:] & 0xF) | (((qh >> 2) & 3) << 4),
                 (ql[:, :, :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[:, :, 32:] >> 4) | (((qh >> 6) & 3) << 4)]
        q = np.stack(parts, axis=2).reshape(-1, 256).astype(np.int16) - 32  # per half: l, l+32, l+64, l+96
        return q.reshape(n, k).astype(np.int8), (d * scales).reshape(n, -1), None, 8
    return None


def _row_order(reference: torch.Tensor, weight: torch.Tensor) -> np.ndarray | None:
    """order such that reference[order] == weight bitwise (rows moved, as transformers moves Llama's q and k
    rows), or None when some row of `weight` is in no row of `reference`."""
    if torch.equal(reference, weight):
        return np.arange(weight.shape[0])
    rows = {bytes(r): i for i, r in enumerate(reference.contiguous().view(torch.uint8).numpy())}
    order = [rows.get(bytes(r)) for r in weight.contiguous().view(torch.uint8).numpy()]
    return None if None in order else np.array(order)


def gguf_blocks(reader, model) -> tuple[dict, dict]:
    """({module name: (Packed, GGUF type)}, {GGUF type: tensors left float}) for the linears of `model` (transformers'
    model of the file `reader` reads), each packed only where its blocks dequantize exactly to the model's weight."""
    import gguf
    from clover_kernels.quant import pack

    arch = reader.fields["general.architecture"].contents()
    by_name = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in by_name:
        return {}, {}
    names = gguf.get_tensor_name_map(by_name[arch], model.config.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}
    out_embed = model.get_output_embeddings()
    blocks, left = {}, {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        key = names.get_name(name)
        key = None if key is None else f"{key}.weight"
        if (key not in tensors and module is out_embed and "token_embd.weight" in tensors
                and module.weight is model.get_input_embeddings().weight):
            key = "token_embd.weight"  # a tied output embedding: the file holds it once
        tensor = tensors.get(key)
        if tensor is None:
            continue
        type_name = tensor.tensor_type.name
        n, k = module.weight.shape
        decoded = decode(type_name, tensor.data, n, k) if type_name in GGUF_TYPES else None
        if decoded is None:
            left[type_name] = left.get(type_name, 0) + 1
            continue
        q, d, m, bits = decoded
        weight = module.weight.detach()
        reference = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(n, k).copy())
        order = _row_order(reference.to(weight.dtype), weight)
        if order is not None:
            q, d, m = q[order], d[order], None if m is None else m[order]
            packed = pack(q, d, m, bits)
            if torch.equal(packed.dequantize()[:, :k].to(weight.dtype), weight):
                blocks[name] = (packed, type_name)
                continue
        left[type_name] = left.get(type_name, 0) + 1  # not the weight transformers made: it runs float
    return blocks, left


def write_blocks(path: Path, blocks: dict, left: dict) -> None:
    """The blocks (gguf_blocks) as a safetensors file: their records, and in its header their shapes and layouts and
    the GGUF types left float (gguf_model.py writes it into the conversion's temporary directory, renamed whole)."""
    from safetensors.torch import save_file

    meta = {name: [p.out_features, p.in_features, p.kind, fmt] for name, (p, fmt) in blocks.items()}
    header = {"clover-blocks": json.dumps({"version": BLOCKS_VERSION, "tensors": meta, "float": left})}
    tensors = {name: p.data for name, (p, _) in blocks.items()}
    save_file(tensors, str(path), metadata=header)  # not atomic: into the conversion's temporary directory


def read_blocks(path: Path, warn=None) -> dict | None:
    """The blocks written by write_blocks, or None (with one line) when the file is damaged or from another
    version."""
    from clover_kernels.quant import Packed
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header = json.loads(f.metadata()["clover-blocks"])
            if header.get("version") != BLOCKS_VERSION:
                raise ValueError(f"version {header.get('version')}, not {BLOCKS_VERSION}")
            out = {}
            for name, (n, k, kind, fmt) in header["tensors"].items():
                data = f.get_tensor(name)
                if data.dtype != torch.uint8 or data.dim() != 1:
                    raise ValueError(f"{name} is not a byte tensor")
                out[name] = (Packed(data, int(n), int(k), int(kind)), str(fmt))
        return out
    except Exception as e:  # noqa: BLE001 - a damaged cache file of any shape
        (warn or _say)(f"ignoring the damaged quantized weights {path} ({one_line(e)}): the weights run as floats")
        return None
