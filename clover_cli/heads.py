"""Draft heads: Clover-2 (arXiv 2408.00264) and Medusa-1, their config, and the heads directory format (which also
holds EAGLE heads: their module lives in clover_cli/drafters/eagle.py).

Clover-2, as built here (our own code, after the paper and its reference implementation):

    x_t  = target's last-layer hidden state at t, before the final norm        [H]
    e(v) = the target's frozen input embedding of token v                      [H]

    fuse:     u_t = x_t + concat_h( cos(q_h, k_h) * v_h ),  q = Wq norm(x_t), k = Wk e(tok_{t+1}), v = Wv e(tok_{t+1})
    augment:  s_t = norm( N decoder layers of the target's own class over u_0..u_t )    (own small KV cache)
    head 0:   o_0 = head_norm(W0 s_t)                               -> logits lm_head(o_0), for tok_{t+2}
    head i>0: s   = rnn(s, e(d_{i-1}))   (the same gated block)    -> o_i = head_norm(W [s; e(d_{i-1})])
              where d_{i-1} is the token drafted at depth i-1; logits lm_head(o_i), for tok_{t+2+i}

`lm_head` and the embedding belong to the target: shared, frozen, never stored in the heads file. Heads made by
the Clover-2 authors' code embed the drafted tokens with the target's lm_head weight instead of its input embedding
(`embed: "lm_head"`), and their augmenting layers use RoPE base 10000 whatever the target's (`rope_theta`). Each o_i is
trained to match the target's post-norm hidden state one step further on, and its logits the target's
distribution there.

Medusa-1: head i is a residual SiLU block on the target's post-norm hidden state h_t, o_i = h_t + SiLU(W_i h_t + b_i)
(`blocks` of them in a row), projected by the same frozen lm_head (for tok_{t+2+i}), or by the head's own vocabulary
projection (`lm_heads`, as Medusa's published heads have); heads do not see each other's tokens.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import CloverError

FORMAT_VERSION = 1
DRAFT_VOCAB_KEY = "draft_vocab"  # optional int64 [n]: the token ids heads draft from (most used first)
# The parts of the target's config the heads depend on: a mismatch means the heads cannot run on this target.
TARGET_KEYS = ("model_type", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "head_dim")


@dataclass
class HeadsConfig:
    architecture: str = "clover2"  # or "medusa", "eagle"
    num_heads: int = 5  # EAGLE: the depth of its draft tree (one model, run once per depth)
    num_layers: int = 2  # Clover-2 augmenting block depth
    hidden_size: int = 0
    vocab_size: int = 0
    num_gate_heads: int = 0  # heads of the regressive attention gates (the target's attention heads)
    rms_norm_eps: float = 1e-6
    draft_vocab_size: int = 0  # >0: heads draft only from this many of the target's most used tokens
    embed: str = "input"  # Clover-2: drafted tokens embedded by the target's "input" embedding, its "lm_head" weight,
    #                       or the heads' "own" table
    rope_theta: float | None = None  # Clover-2: the augmenting layers' RoPE base; None: the target's
    gate_eps: float = 1e-6  # Clover-2: the eps of the gates' cosine similarity
    blocks: int = 1  # Medusa: residual SiLU blocks per head
    lm_heads: bool = False  # Medusa: each head has its own vocabulary projection (else the target's lm_head)
    fc_bias: bool = True  # EAGLE: whether its fc (2H -> H) has a bias
    layer: dict = field(default_factory=dict)  # EAGLE: its decoder layer's settings where they differ from the
    #                                            target's (a published file's own attention heads, eps, ...)
    layout: str = "clover"  # the file layout the heads were read from (clover's own, or a published one)
    target: dict = field(default_factory=dict)  # TARGET_KEYS of the target, plus its name and revision
    training: dict = field(default_factory=dict)  # what `clover train` measured and used
    format_version: int = FORMAT_VERSION

    @staticmethod
    def for_target(target_config, architecture="clover2", num_heads=5, num_layers=2, name=None, revision=None):
        tc = target_config.to_dict()
        target = {k: tc.get(k) for k in TARGET_KEYS}
        target.update(name_or_path=name or tc.get("_name_or_path"), revision=revision)
        return HeadsConfig(
            architecture=architecture, num_heads=num_heads, num_layers=num_layers,
            hidden_size=target_config.hidden_size, vocab_size=target_config.vocab_size,
            num_gate_heads=target_config.num_attention_heads,
            rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6), target=target,
        )

    def check_target(self, target_config, where: str):
        tc = target_config.to_dict()
        if (self.hidden_size, self.vocab_size) != (tc.get("hidden_size"), tc.get("vocab_size")):
            raise CloverError(f"heads {where} were made for hidden size {self.hidden_size} and vocabulary "
                              f"{self.vocab_size}; this model has {tc.get('hidden_size')} and {tc.get('vocab_size')}")
        # Clover-2's augmenting layers and EAGLE's layer are copies of the target's decoder layer: its shape must
        # match too.
        for key in TARGET_KEYS if self.architecture in ("clover2", "eagle") else ():
            want, have = self.target.get(key), tc.get(key)
            if want is not None and want != have:
                raise CloverError(f"heads {where} were made for a target with {key}={want}, this model has {have}")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _near_identity(linear: nn.Linear, in_block: int = 0):
    """Identity on input columns [in_block, in_block + out), small noise elsewhere, zero bias."""
    with torch.no_grad():
        nn.init.normal_(linear.weight, std=0.002)
        out = linear.weight.shape[0]
        linear.weight[:, in_block:in_block + out] += torch.eye(out)
        if linear.bias is not None:
            linear.bias.zero_()


class GatedFusion(nn.Module):
    """Clover's regressive attention block: a per-head cosine gate between the state and a token embedding."""

    def __init__(self, hidden: int, heads: int, eps: float, gate_eps: float = 1e-6):
        super().__init__()
        self.heads, self.gate_eps = heads, gate_eps
        self.norm = RMSNorm(hidden, eps)
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        _near_identity(self.q)
        _near_identity(self.k)
        nn.init.normal_(self.v.weight, std=0.01)
        nn.init.zeros_(self.v.bias)

    def forward(self, state, emb):
        shape = (*state.shape[:-1], self.heads, -1)
        q = self.q(self.norm(state)).view(shape)
        k = self.k(emb).view(shape)
        v = self.v(emb).view(shape)
        gate = F.cosine_similarity(q.float(), k.float(), dim=-1, eps=self.gate_eps).to(v.dtype)
        return state + (gate.unsqueeze(-1) * v).flatten(-2)


class LmHeadEmbedding(nn.Module):
    """The target's lm_head weight [V, H] read as an embedding table (row v embeds token v): shared, not copied."""

    def __init__(self, lm_head: nn.Module):
        super().__init__()
        self.lm_head = lm_head

    def forward(self, ids):
        return F.embedding(ids, self.lm_head.weight)


def _layer_class(target_model, what: str = "Clover-2 heads copy"):
    from .target import decoder_layers, rotary_embedding

    layers = decoder_layers(target_model.base_model)
    problem = None
    if layers is None:
        problem = "no decoder layer stack"
    elif rotary_embedding(target_model.base_model) is None:
        problem = "no rotary embedding"
    else:
        params = inspect.signature(type(layers[-1]).forward).parameters
        required = [name for name, p in list(params.items())[2:] if p.default is p.empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if "position_embeddings" not in params or required:
            problem = f"a decoder layer that takes {', '.join(required) or 'no position_embeddings'}"
    if problem:
        raise CloverError(f"{what} the target's last decoder layer and its rotary position embedding; "
                          f"{target_model.config.model_type} models have {problem}, which clover cannot drive "
                          f"(Medusa heads work: --arch medusa)")
    return type(layers[-1])


def _draft_config(target_config, overrides: dict | None = None):
    from .target import ATTN_NAME

    cfg = copy.deepcopy(target_config)
    cfg._attn_implementation = ATTN_NAME
    for key, value in (overrides or {}).items():
        setattr(cfg, key, value)
    return cfg


def rotary_for(target_model, theta: float | None, overrides: dict | None = None) -> nn.Module:
    """The rotary embedding of draft layers: the target's own, or one of its class with base `theta` (and the draft
    layer's own head size, `overrides`) when they differ from the target's."""
    from .target import rotary_embedding

    own = rotary_embedding(target_model.base_model)
    params = getattr(target_model.config, "rope_parameters", None) or {}
    default = params.get("rope_type", "default") == "default"
    same_theta = theta is None or (default and params.get("rope_theta") == theta)
    if same_theta and not overrides:
        return own
    cfg = _draft_config(target_model.config, overrides)
    if theta is not None:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": float(theta)}
    return type(own)(cfg).to(own.inv_freq.device)


class Clover2Heads(nn.Module):
    def __init__(self, cfg: HeadsConfig, target_config, layer_class):
        super().__init__()
        self.cfg = cfg
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fuse = GatedFusion(H, cfg.num_gate_heads, eps, cfg.gate_eps)
        dcfg = _draft_config(target_config)
        self.layers = nn.ModuleList(layer_class(dcfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(H, eps)
        self.head0 = nn.Linear(H, H)
        self.rnn = GatedFusion(H, cfg.num_gate_heads, eps, cfg.gate_eps)
        self.head_next = nn.Linear(2 * H, H)
        self.head_norm = RMSNorm(H, eps)
        _near_identity(self.head0)
        _near_identity(self.head_next)
        if cfg.embed == "own":  # the heads' own frozen token table (a published file's that matches no table of
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)  # the target's)
            self.embed_tokens.weight.requires_grad_(False)

    def init_from_target(self, target_model):
        """Augmenting layers start as copies of the target's last decoder layer; norms from its final norm."""
        from .target import decoder_layers, find_final_norm

        last = decoder_layers(target_model.base_model)[-1].state_dict()
        for layer in self.layers:
            layer.load_state_dict(last)
        final_norm = find_final_norm(target_model.base_model)
        if final_norm is not None and hasattr(final_norm, "weight"):
            with torch.no_grad():
                self.norm.weight.copy_(final_norm.weight.float())
                self.head_norm.weight.copy_(final_norm.weight.float())

    def token_embedding(self, target_model) -> nn.Module:
        """What embeds a token for the heads: the target's input embedding, or its lm_head weight read as one."""
        if self.cfg.embed == "lm_head":
            return LmHeadEmbedding(target_model.get_output_embeddings())
        if self.cfg.embed == "own":
            return self.embed_tokens
        return target_model.get_input_embeddings()

    def rotary(self, target_model) -> nn.Module:
        """The augmenting layers' rotary embedding: the target's, or one of its class with base `rope_theta`."""
        return rotary_for(target_model, self.cfg.rope_theta)

    def augment(self, hidden, next_emb, position_embeddings, position_ids, cache=None):
        """hidden, next_emb: [B, T, H]. Returns the augmented state [B, T, H] (causal over T, after the cache)."""
        u = self.fuse(hidden, next_emb)
        for layer in self.layers:
            out = layer(u, attention_mask=None, position_ids=position_ids, past_key_values=cache,
                        use_cache=cache is not None, position_embeddings=position_embeddings)
            u = out[0] if isinstance(out, tuple) else out
        return self.norm(u)

    def step(self, depth: int, state, prev_emb=None):
        """Head `depth` (0-based): returns (next recurrent state, output hidden for lm_head)."""
        if depth == 0:
            return state, self.head_norm(self.head0(state))
        state = self.rnn(state, prev_emb)
        return state, self.head_norm(self.head_next(torch.cat([state, prev_emb], -1)))

    def forward_train(self, hidden, input_ids, embed, position_embeddings, position_ids):
        """Teacher-forced outputs of every head: list of [B, T, H]; head i at t predicts token t+2+i.

        hidden: pre-norm target hidden [B, T, H]; input_ids [B, T]. Positions past the end use token 0 and
        must be masked out of the loss.
        """
        T = input_ids.shape[1]
        ids = F.pad(input_ids, (0, self.cfg.num_heads + 1), value=0)
        state = self.augment(hidden, embed(ids[:, 1:T + 1]), position_embeddings, position_ids)
        state, out = self.step(0, state)
        outs = [out]
        for i in range(1, self.cfg.num_heads):
            state, out = self.step(i, state, embed(ids[:, 1 + i:T + 1 + i]))
            outs.append(out)
        return outs

    def forward(self, hidden, input_ids, embed, position_embeddings, position_ids):
        """The training forward (forward_train), so that a DistributedDataParallel wrapper syncs its gradients."""
        return self.forward_train(hidden, input_ids, embed, position_embeddings, position_ids)


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


ARCHITECTURES = {"clover2": Clover2Heads, "medusa": MedusaHeads}


def build_heads(cfg: HeadsConfig, target_model) -> nn.Module:
    from .drafters.eagle import EagleHead
    from .drafters.eagle3 import Eagle3Head

    architectures = {**ARCHITECTURES, "eagle": EagleHead, "eagle3": Eagle3Head}
    if cfg.architecture not in architectures:
        raise CloverError(f"unknown heads architecture {cfg.architecture!r}")
    layer_class = None
    if cfg.architecture == "clover2":
        layer_class = _layer_class(target_model)
    elif cfg.architecture == "eagle":
        layer_class = _layer_class(target_model, "EAGLE heads copy")
    heads = architectures[cfg.architecture](cfg, target_model.config, layer_class)
    heads.draft_vocab = None  # all of the target's vocabulary, unless train/load sets a shortlist
    return heads


def save_heads(heads: nn.Module, out: Path, card: str):
    """Weights, config.json and model card, each written atomically and readable by all (0644)."""
    from safetensors.torch import save_file

    from . import atomic

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    vocab = getattr(heads, "draft_vocab", None)
    if vocab is not None:
        state[DRAFT_VOCAB_KEY] = vocab.to("cpu", torch.long).contiguous()
    atomic.write_with(out / "model.safetensors", lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    atomic.write_text(out / "config.json", json.dumps(asdict(heads.cfg), indent=2) + "\n")
    atomic.write_text(out / "README.md", card)


def is_heads_dir(path: Path) -> bool:
    """Whether `path` holds heads in a layout clover knows (its own or a published one: drafters/layouts.py)."""
    from .drafters.layouts import detect

    return detect(Path(path)) is not None


def load_heads_config(path: Path) -> HeadsConfig:
    path = Path(path)
    if not path.is_dir():
        raise CloverError(f"heads directory not found: {path}")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        raise CloverError(f"{path} is not a heads directory (no readable config.json)")
    if not isinstance(raw, dict) or "architecture" not in raw:
        raise CloverError(f"{path} is not a heads directory (config.json has no 'architecture')")
    known = set(HeadsConfig.__dataclass_fields__)
    cfg = HeadsConfig(**{k: v for k, v in raw.items() if k in known})
    why = _config_problem(cfg)
    if why:
        raise CloverError(f"heads {path}: config.json is not valid ({why})")
    return cfg


def _config_problem(cfg: HeadsConfig) -> str | None:
    """What is wrong with a heads config read from a file (types, ranges, a gate that cannot split the state), or
    None: a config that passes builds heads whose every step runs."""
    for name, f in HeadsConfig.__dataclass_fields__.items():
        value, want = getattr(cfg, name), type(f.default) if f.default_factory is MISSING else dict
        if f.default is None:  # optional numbers (rope_theta)
            want = float
            if value is None:
                continue
        ok = isinstance(value, (int, float)) if want is float else isinstance(value, want)
        if not ok or (want is not bool and isinstance(value, bool)):
            return f"{name} must be {'a number' if want is float else f'a {want.__name__}'}, not {value!r}"
    if cfg.architecture not in (*ARCHITECTURES, "eagle", "eagle3"):
        return f"unknown architecture {cfg.architecture!r}"
    if cfg.embed not in ("input", "lm_head", "own"):
        return f"embed must be input, lm_head or own, not {cfg.embed!r}"
    for name, lo, hi in (("num_heads", 1, 64), ("num_layers", 0, 64), ("hidden_size", 1, 1 << 20),
                         ("vocab_size", 1, 1 << 24), ("draft_vocab_size", 0, cfg.vocab_size)):
        if not lo <= getattr(cfg, name) <= hi:
            return f"{name} must be between {lo} and {hi}, not {getattr(cfg, name)}"
    if cfg.architecture == "clover2" and not (cfg.num_gate_heads >= 1 and cfg.hidden_size % cfg.num_gate_heads == 0):
        return f"num_gate_heads must divide hidden_size {cfg.hidden_size}, not {cfg.num_gate_heads}"
    if not (math.isfinite(cfg.rms_norm_eps) and 0 < cfg.rms_norm_eps < 1):
        return f"rms_norm_eps must be in (0, 1), not {cfg.rms_norm_eps}"
    return None


def load_heads(path: Path, target_model, dtype=None) -> nn.Module:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg = load_heads_config(path)
    cfg.check_target(target_model.config, str(path))
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise CloverError(f"heads {path} have no model.safetensors")
    heads = build_heads(cfg, target_model)
    device = target_model.get_input_embeddings().weight.device
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise CloverError(f"heads {path}: unreadable model.safetensors ({e})")
    vocab = state.pop(DRAFT_VOCAB_KEY, None)
    if vocab is not None:
        if (vocab.ndim != 1 or vocab.is_floating_point() or len(vocab) != cfg.draft_vocab_size
                or int(vocab.max()) >= cfg.vocab_size or int(vocab.min()) < 0):
            raise CloverError(f"heads {path}: the draft vocabulary does not match the config")
        heads.draft_vocab = vocab.to(device, torch.long)
    try:
        missing, unexpected = heads.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of another shape than the config gives
        shape = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e)[:200])
        raise CloverError(f"heads {path} do not match their config ({shape})")
    if missing or unexpected:
        raise CloverError(f"heads {path} do not match their config ({len(missing)} missing, "
                          f"{len(unexpected)} unexpected tensors)")
    compute_dtype = dtype or _compute_dtype(target_model)
    return heads.to(device=device, dtype=compute_dtype).eval()


def _compute_dtype(target_model):
    dt = target_model.get_input_embeddings().weight.dtype
    return dt if dt.is_floating_point else torch.float16
