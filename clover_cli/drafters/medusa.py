"""Medusa-1: head i is a residual SiLU block on the target's post-norm hidden state h_t, o_i = h_t + SiLU(W_i h_t + b_i)
(`blocks` of them in a row), projected by the same frozen lm_head (for tok_{t+2+i}), or by the head's own vocabulary
projection (`lm_heads`, as Medusa's published heads have); heads do not see each other's tokens.

Medusa's published layout (GitHub FasterDecoding/Medusa, e.g. FasterDecoding/medusa-vicuna-7b-v1.3): config.json
with "medusa_num_heads"; medusa_lm_head.safetensors or a pickled medusa_lm_head.pt. Head i is `{i}.{j}.linear` (j <
n: residual SiLU blocks; the reference repeats one block n times, so they are equal) then `{i}.{n}.weight`, the
head's own vocabulary projection. The number of heads is read from the tensors: the published 7B config says 2 where
the file holds 5 (the reference code overrides it too).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import CloverError
from ..families import Layout, Spec, Training
from ..packed import packed_linears
from ..target import Target, find_final_norm
from ..tree import DraftTree, TreeBuilder
from .common import (DraftProjection, GrowsTree, HeadsConfig, TreeGrower, check_size, finish_loading, first_file,
                     heads_to_run, read_config, read_tensors, top_tokens)

ARCHITECTURE = "medusa"
LAYOUT = "medusa-authors"
FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_lm_head.bin")


class MedusaHeads(nn.Module):
    """`blocks[i]` is head i's first residual block (the only one unless cfg.blocks > 1: then `more[i]` holds the
    rest); `lm_heads[i]`, when cfg.lm_heads, projects head i's output to the vocabulary instead of the target's."""

    def __init__(self, cfg: HeadsConfig, target_config=None, layer_class=None):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.blocks = nn.ModuleList(nn.Linear(H, H) for _ in range(cfg.num_heads))
        for b in self.blocks:
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)
        if cfg.blocks > 1:
            self.more = nn.ModuleList(nn.ModuleList(nn.Linear(H, H) for _ in range(cfg.blocks - 1))
                                      for _ in range(cfg.num_heads))
            for block in (b for head in self.more for b in head):
                nn.init.zeros_(block.weight)
                nn.init.zeros_(block.bias)
        if cfg.lm_heads:
            self.lm_heads = nn.ModuleList(nn.Linear(H, cfg.vocab_size, bias=False) for _ in range(cfg.num_heads))

    def init_from_target(self, target_model):
        if self.cfg.lm_heads:
            with torch.no_grad():
                for proj in self.lm_heads:
                    proj.weight.copy_(target_model.get_output_embeddings().weight)

    def outputs(self, post_hidden):
        """post_hidden [..., H] -> list of head outputs [..., H] (head i predicts token t+2+i)."""
        outs = []
        for i, block in enumerate(self.blocks):
            x = post_hidden + F.silu(block(post_hidden))
            for b in (self.more[i] if self.cfg.blocks > 1 else ()):
                x = x + F.silu(b(x))
            outs.append(x)
        return outs

    def forward_train(self, post_hidden):
        return self.outputs(post_hidden)

    def forward(self, post_hidden):
        """The training forward (forward_train), so that a DistributedDataParallel wrapper syncs its gradients."""
        return self.forward_train(post_hidden)


def build(cfg: HeadsConfig, target_model) -> nn.Module:
    heads = MedusaHeads(cfg)
    heads.draft_vocab = None
    return heads


# ---------------------------------------------------------------------------------------------------- the drafter

class MedusaLevels(torch.nn.Module):
    """Every Medusa head at once on the last hidden state: (pre-norm hidden [1, H]) -> probabilities [D, k] and token
    ids [D, k], head d's k best tokens for depth d."""

    def __init__(self, heads, target: Target, project: DraftProjection, k: int):
        super().__init__()
        self.heads, self.out, self.k = heads, project.linear, k
        self.norm = find_final_norm(target.base)
        self.dtype = next(heads.parameters()).dtype
        # a buffer (not a plain attribute): a compiled program names it, and reads the drafter's own
        self.register_buffer("token_ids", project.token_ids, persistent=False)
        self.project = project

    def forward(self, hidden):
        post = self.norm(hidden) if self.norm is not None else hidden
        outs = self.heads.outputs(post.to(self.dtype))  # D x [1, H]
        if self.heads.cfg.lm_heads:  # each head's own vocabulary projection
            logits = torch.cat([proj(out).to(outs[0].dtype) for proj, out in zip(self.heads.lm_heads, outs)])
            return top_tokens(logits, self.k)
        return top_tokens(self.project(torch.cat(outs)), self.k, self.token_ids)


class MedusaDrafter(GrowsTree):
    """Medusa heads: every head reads the last hidden state (MedusaLevels, eager or compiled); head d proposes the
    tokens at depth d for every node of the level above."""

    name = "medusa"
    programs_kind = "medusa"

    def __init__(self, heads, target: Target, **grow):
        heads, self.int8 = heads_to_run(heads, target)  # 8-bit integers beside a quantized target
        self.heads = heads
        self.target = target
        self.grower = TreeGrower(**grow)
        self.dtype = next(heads.parameters()).dtype
        self.project = DraftProjection(target.lm_head, getattr(heads, "draft_vocab", None), int8=self.int8)
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


# ---------------------------------------------------------------------------------------------------- Medusa's layout

def is_layout(path: Path, raw: dict) -> bool:
    """Whether directory `path` (whose config.json is `raw`) holds heads in Medusa's layout."""
    return "medusa_num_heads" in raw or any((path / f).is_file() for f in FILES)


BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")


PROJ = re.compile(r"^(\d+)\.(\d+)\.weight$")


def load(path: Path, target_model, dtype=None) -> torch.nn.Module:
    raw = read_config(path)
    file = first_file(path, FILES)
    if file is None:
        raise CloverError(f"heads {path} have no weights ({' or '.join(FILES)})")
    state = read_tensors(file, "heads")
    state = {k[len("medusa_head."):] if k.startswith("medusa_head.") else k: v for k, v in state.items()}
    blocks: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    projs: dict[int, tuple[int, torch.Tensor]] = {}
    for key, value in state.items():
        m = BLOCK.match(key)
        if m:
            blocks.setdefault(int(m[1]), {}).setdefault(int(m[2]), {})[m[3]] = value
            continue
        m = PROJ.match(key)
        if m:
            projs[int(m[1])] = (int(m[2]), value)
            continue
        raise CloverError(f"heads {path}: {file.name} holds {key!r}, which Medusa's layout does not have")
    num_heads = len(blocks)
    if num_heads == 0 or sorted(blocks) != list(range(num_heads)):
        raise CloverError(f"heads {path}: {file.name} holds no Medusa heads numbered 0, 1, ...")
    depth = {len(b) for b in blocks.values()}
    if len(depth) != 1 or any(sorted(b) != list(range(len(b))) for b in blocks.values()):
        raise CloverError(f"heads {path}: Medusa's heads in {file.name} differ in their residual blocks")
    n = depth.pop()
    if projs and (sorted(projs) != list(range(num_heads)) or any(j != n for j, _ in projs.values())):
        raise CloverError(f"heads {path}: Medusa's vocabulary projections in {file.name} do not follow the blocks")
    hidden = blocks[0][0]["weight"].shape[-1]
    tc = target_model.config.to_dict()
    vocab = projs[0][1].shape[0] if projs else tc.get("vocab_size")
    check_size(path, hidden, vocab, target_model)
    mapped = {}
    for i, head in blocks.items():
        for j, tensors in head.items():
            for kind, value in tensors.items():
                mapped[f"blocks.{i}.{kind}" if j == 0 else f"more.{i}.{j - 1}.{kind}"] = value
        if projs:
            mapped[f"lm_heads.{i}.weight"] = projs[i][1]
    cfg = HeadsConfig(architecture="medusa", num_heads=num_heads, num_layers=0, hidden_size=hidden,
                      vocab_size=vocab, blocks=n, lm_heads=bool(projs), layout="medusa-authors",
                      target={"name_or_path": raw.get("base_model_name_or_path") if raw else None},
                      training={"config_num_heads": raw.get("medusa_num_heads")} if raw else {})
    return finish_loading(build(cfg, target_model), mapped, path, target_model, dtype)


SPEC = Spec(build=build, drafter=MedusaDrafter, layout=Layout(LAYOUT, "Medusa's", is_layout, load),
            training=Training(card_name="Medusa-1"))  # its heads read the post-norm features alone
