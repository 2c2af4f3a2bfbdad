"""Self-speculation with no extra weights (issue #16 item 5): `--draft self`.

The draft is the target itself with a set of its decoder layers skipped (Draft & Verify, arXiv 2309.08168; SWIFT,
arXiv 2410.06916): the same module objects, no copy of a weight. `skipping(model, skip)` makes a shallow copy of
the model whose decoder-layer list holds only the kept layers; every kept layer keeps its own index, so it writes
its keys and values into the same slot of its own TreeKVCache as in the target (the skipped layers' slots are
never allocated). It runs through ModelDrafter unchanged: the draft model's chain or MCSD tree, its own cache
kept in step with the accepted tokens. The target verifies every token, so the output is the target's whatever
layers are skipped.

Which layers to skip is chosen once per model, device and dtype by a short calibration on the first prompt
(`calibrate`) and kept on disk beside the step costs (store.self_draft_path: store.cache_root() / "self"): a later
run reads it. The first and last layers are never skipped. The calibration runs the full model once over the
calibration tokens
(the prompt; a short prompt is extended by the target's own greedy continuation), then grows the skipped set
greedily, one layer at a time, adding the layer whose skipping keeps the most top-1 agreement with the full model;
each set is scored by the speedup a chain of its drafts would give,

    max over depths g of  E[tokens per step] / cost per step  =  (1 - a^(g+1)) / (1 - a)  /  (1 + g c)

with a the measured top-1 agreement (Laplace-smoothed: (matches + 1) / (positions + 2)) and c the draft's cost
relative to the target's forward: a one-token forward's time is measured once with all layers and with every other
middle layer skipped, which splits it into a part the layers take (divided among them by their weights) and a part
they do not (embedding, lm_head, the framework's overhead per forward), and c is the second part plus the kept
layers' share of the first. The best-scoring set along the way is kept. (The verification's real cost, a tree of
tokens and perhaps a compiled step, is not what is timed: c is an estimate.)
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

from ..errors import CloverError
from ..packed import finish_packing
from ..store import read_cache_json
from ..target import Target, cache_kwarg, decoder_layers, find_final_norm
from .draft_model import ModelDrafter

MIN_LAYERS = 4  # fewer and there is no middle layer worth skipping (never the first or the last)
CALIBRATION_TOKENS = 32  # a shorter prompt is extended by the target's greedy continuation to this length
MAX_CALIBRATION_TOKENS = 256  # the prompt's last this many tokens
CALIBRATION_SECONDS = 1.5  # the search stops here (the best set found so far is kept)
MAX_DEPTH_SCORED = 8


class _Norm(torch.nn.Module):
    """The target's final norm without its hooks: the target's Target captures the hidden state before its norm
    with a hook; the draft's Target hooks this proxy instead, and neither sees the other's forwards. The norm is
    not registered as a submodule (a plain attribute): find_final_norm finds the proxy, not the shared one."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "_inner", norm)

    def forward(self, *args, **kwargs):
        return self._inner.forward(*args, **kwargs)


def _path_of(root: torch.nn.Module, module: torch.nn.Module) -> str | None:
    for name, m in root.named_modules():
        if m is module:
            return name
    return None


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object over the same parameters, buffers and submodules (its own dict of submodules)."""
    out = copy.copy(module)
    out.__dict__ = dict(module.__dict__)
    out._modules = dict(module._modules)
    for key in [k for k in out.__dict__ if k.startswith("_clover")]:  # the target's runner and memos are its own
        del out.__dict__[key]
    return out


def _replace(root: torch.nn.Module, path: str, new: torch.nn.Module, copied: set) -> None:
    """Put `new` at `path` under `root` (itself a copy), shallow-copying each module on the way that is not one
    of ours yet (`copied`: ids of the copies made so far)."""
    parts = path.split(".")
    parent = root
    for part in parts[:-1]:
        child = parent._modules[part]
        if id(child) not in copied:
            child = _shallow(child)
            copied.add(id(child))
            parent._modules[part] = child
        parent = child
    parent._modules[parts[-1]] = new


def layer_count(model) -> int:
    layers = decoder_layers(model.base_model)
    return len(layers) if layers is not None else 0


def check_skippable(model) -> int:
    """The number of decoder layers; CloverError in one line when there are too few to skip any."""
    n = layer_count(model)
    if n < MIN_LAYERS:
        raise CloverError(f"--draft self: {model.config.model_type} model has {n} decoder layers, too few layers to "
                          f"skip (it needs at least {MIN_LAYERS}; the first and last are never skipped)")
    return n


def skipping(model, skip) -> torch.nn.Module:
    """`model` with the decoder layers in `skip` left out: a shallow copy sharing every weight. Made once per skip
    set and kept on the model (drafters made afresh share it, and its runner's cache)."""
    skip = tuple(sorted(set(int(i) for i in skip)))
    memo = model.__dict__.setdefault("_clover_skipping", {})
    if skip in memo:
        return memo[skip]
    n = check_skippable(model)
    if any(i <= 0 or i >= n - 1 for i in skip):
        raise CloverError(f"--draft self: cannot skip layers {list(skip)} of {n} (never the first or the last)")
    layers = decoder_layers(model.base_model)
    layers_path = _path_of(model, layers)
    norm = find_final_norm(model.base_model)
    norm_path = _path_of(model, norm) if norm is not None else None
    if layers_path is None or norm_path is None:
        raise CloverError(f"--draft self: cannot find the decoder layers of this {model.config.model_type} model")
    out = _shallow(model)
    copied = {id(out)}
    _replace(out, layers_path, torch.nn.ModuleList([m for i, m in enumerate(layers) if i not in skip]), copied)
    _replace(out, norm_path, _Norm(norm), copied)
    out.eval()
    memo[skip] = out
    return out


# ------------------------------------------------------------------------------------------------------ calibration

def _layer_weights(model) -> tuple[list[int], int]:
    """Parameters read per forward: each decoder layer's, and the lm_head's."""
    from ..quantized import weight_count

    layers = decoder_layers(model.base_model)
    return [weight_count(layer) for layer in layers], weight_count(model.get_output_embeddings())


def merit(agreement: float, cost: float) -> float:
    """The speedup over plain decoding of the best chain of drafts: expected tokens per step over the step's cost
    (one target forward, plus `cost` per drafted token), with each drafted token accepted with `agreement`."""
    a = min(max(agreement, 0.0), 1.0 - 1e-9)
    return max((1 - a ** (g + 1)) / (1 - a) / (1 + g * cost) for g in range(1, MAX_DEPTH_SCORED + 1))


def _top1(model, ids: torch.Tensor) -> torch.Tensor:
    from ..packed import packed_linears

    with packed_linears():
        return model(input_ids=ids[None], use_cache=False).logits[0].argmax(-1)


def _continue(model, ids: list[int], length: int, device) -> list[int]:
    """`ids` extended by the model's greedy continuation to `length` tokens (transformers' own cache, not the
    target's: that one holds the conversation)."""
    from transformers import DynamicCache

    from ..packed import packed_linears

    ids = list(ids)
    cache = DynamicCache()
    new = ids
    with packed_linears():
        while len(ids) < length:
            logits = model(input_ids=torch.tensor([new], device=device), **{cache_kwarg(model): cache},
                           use_cache=True).logits
            new = [int(logits[0, -1].argmax())]
            ids += new
    return ids


def _seconds(model, tokens: torch.Tensor, repeats: int = 5) -> float:
    """Median wall time of a forward over `tokens` (after one untimed run)."""
    sync = torch.cuda.synchronize if tokens.device.type == "cuda" else (lambda: None)
    times = []
    for i in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        _top1(model, tokens)
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def step_shares(model, per: list[int], device) -> tuple[float, float]:
    """(the share of a one-token forward's time that does not depend on the layers: embedding, lm_head, framework;
    the share the decoder layers take), measured on this device: the full model against one skipping every other
    middle layer, the layers' time split by their weights. Clamped to [0.05, 0.95]: timings on a busy machine."""
    n = len(per)
    half = list(range(1, n - 1, 2))
    one = torch.tensor([int(getattr(model.config, "bos_token_id", None) or 1)], device=device)
    full, part = _seconds(model, one), _seconds(skipping(model, half), one)
    removed = sum(per[i] for i in half) / sum(per)
    stack = min(max((full - part) / removed / full, 0.05), 0.95) if full > 0 else 0.5
    return 1.0 - stack, stack


@torch.inference_mode()
def calibrate(model, context: list[int], seconds: float = CALIBRATION_SECONDS) -> dict:
    """Choose the layers to skip from the full model's top-1 agreement with itself skipping them, on `context`
    (see the module docstring). Returns {"skip", "agreement", "merit", "layers", "tokens", "seconds", "tried"}."""
    n = check_skippable(model)
    device = model.get_input_embeddings().weight.device
    ids = list(context[-MAX_CALIBRATION_TOKENS:]) or [int(getattr(model.config, "bos_token_id", None) or 1)]
    if len(ids) < CALIBRATION_TOKENS:
        ids = _continue(model, ids, CALIBRATION_TOKENS, device)
    tokens = torch.tensor(ids, device=device)
    start = time.perf_counter()  # the search's time (the short prompt's continuation is a few cached forwards)
    want = _top1(model, tokens)
    per, _ = _layer_weights(model)
    fixed, stack = step_shares(model, per, device)
    middle = list(range(1, n - 1))
    skip: list[int] = []
    best = None
    tried = 0
    while len(skip) < len(middle):
        round_best = None
        for layer in middle:
            if layer in skip:
                continue
            trial = sorted(skip + [layer])
            matches = int((_top1(skipping(model, trial), tokens) == want).sum())
            agree = matches / len(ids)
            tried += 1
            cost = fixed + stack * (1 - sum(per[i] for i in trial) / sum(per))
            score = merit((matches + 1) / (len(ids) + 2), cost)  # Laplace: 32 of 32 is not certainty
            if round_best is None or (agree, score) > (round_best[1], round_best[2]):
                round_best = (trial, agree, score)
            if time.perf_counter() - start > seconds:
                break
        if round_best is None:
            break
        skip = round_best[0]
        if best is not None and round_best[2] < best[2] and len(skip) > len(best[0]) + 1:
            break  # two rounds past the best: the agreement falls faster than the cost now
        if best is None or round_best[2] > best[2]:
            best = round_best
        if time.perf_counter() - start > seconds:
            break
    # drop the memoised trial copies that are not kept (each holds a runner's cache once used)
    memo = model.__dict__.get("_clover_skipping", {})
    for key in [k for k in memo if k != tuple(best[0])]:
        memo.pop(key)
    cost = fixed + stack * (1 - sum(per[i] for i in best[0]) / sum(per))
    return {"skip": best[0], "agreement": round(best[1], 4), "merit": round(best[2], 4), "layers": n,
            "draft_cost": round(cost, 4), "layers_share": round(stack, 4), "tokens": len(ids),
            "seconds": round(time.perf_counter() - start, 3), "tried": tried}


def load_choice(path: Path | None, n_layers: int) -> dict | None:
    """The stored choice in `path` for a model of `n_layers`, or None (none there, another model's, or damaged:
    read_cache_json says so in one line)."""
    if path is None:
        return None
    def parse(choice):
        skip = [int(i) for i in choice["skip"]]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in choice["skip"]) \
                or not isinstance(choice.get("layers"), int):
            raise ValueError("not a choice of layers")
        choice["skip"] = skip
        return choice

    choice = read_cache_json(path, parse)
    if not choice or not choice["skip"] or choice["layers"] != n_layers \
            or any(i <= 0 or i >= n_layers - 1 for i in choice["skip"]):
        return None
    return choice


def save_choice(path: Path | None, choice: dict) -> None:
    if path is None:
        return
    from .. import atomic

    try:
        atomic.write_text(path, json.dumps(choice))
    except OSError:
        pass  # a cache that cannot be written only costs the next process a calibration


# ---------------------------------------------------------------------------------------------------- the drafter

class SelfDrafter(ModelDrafter):
    """ModelDrafter over the target with layers skipped, chosen by `calibrate` on the first prompt (observed at its
    prefill, else the first proposal's context) unless the choice is cached on disk at `cache`. Until then the
    draft model is a provisional set (every other middle layer)."""

    observes = True  # the prompt's tokens, at its prefill, are what it calibrates on

    def __init__(self, target: Target, tree: str = "mcsd", skip=None, cache: Path | None = None,
                 log=None, **kw):
        n = check_skippable(target.model)
        embed = target.model.get_input_embeddings().weight
        if embed.device.type == "meta":
            raise CloverError("--draft self runs the target's own layers: it cannot follow a --device-map that "
                              "offloads the target's embedding")
        self.cache_file = cache
        self.log = log
        finish_packing(target.model)  # its layers run eager, whatever step the target's verify runs
        # the file, else what this process chose for the model before (a cache directory that cannot be written)
        self.choice = ({"skip": list(skip)} if skip else
                       load_choice(cache, n) or target.model.__dict__.get("_clover_self_choice"))
        provisional = self.choice["skip"] if self.choice else list(range(2, n - 1, 2)) or [1]
        super().__init__(skipping(target.model, provisional), target, tree=tree, **kw)
        self.target_ref = target
        self.name = "self" if tree == "mcsd" else "self-chain"

    @property
    def skip(self) -> list[int]:
        return list(self.choice["skip"]) if self.choice else []

    def _calibrate(self, context) -> None:
        model = self.target_ref.model
        self.choice = calibrate(model, context)
        save_choice(self.cache_file, self.choice)
        model.__dict__["_clover_self_choice"] = self.choice
        if self.log is not None:
            c = self.choice
            self.log(f"--draft self: skipping layers {c['skip']} of {c['layers']} (top-1 agreement "
                     f"{c['agreement']:.2f} on {c['tokens']} tokens, calibrated in {c['seconds']:.2f} s)")
        self.draft.reset(0)
        self.draft = _runner_for(skipping(model, self.choice["skip"]), self.target_ref, self.root_k, self.max_depth)
        self.ids = []

    def observe(self, hidden, next_tokens) -> None:
        # the prompt's prefill: calibrate now, before its first token is shown (the context, less its first token)
        if self.choice is None:
            self._calibrate(next_tokens.tolist())

    def propose(self, context, budget):
        if self.choice is None:
            self._calibrate(context)
        return super().propose(context, budget)


def _runner_for(draft_model, target, root_k, max_depth):
    from .draft_model import runner

    made = runner(draft_model, target)
    made.cache.max_capacity = max(made.cache.max_capacity, made.max_context + root_k * max_depth)
    made.reset(0)
    return made
