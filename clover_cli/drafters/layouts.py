"""Heads directories in every layout clover reads, told apart by their files, and mapped into clover's modules.

    clover            what `clover train` writes: config.json with an "architecture", model.safetensors
    clover2-authors   the Clover-2 authors' (GitHub XiaoBin1992/clover, e.g. BinXiao/clover-2-vicuna-7b-v1.5): a Llama
                      config with a "clover" block; model.safetensors (or a pickled pytorch_model.bin)
    medusa-authors    Medusa-1's (GitHub FasterDecoding/Medusa, e.g. FasterDecoding/medusa-vicuna-7b-v1.3): config.json
                      with "medusa_num_heads"; medusa_lm_head.safetensors or a pickled medusa_lm_head.pt
    eagle             EAGLE-1's (GitHub SafeAILab/EAGLE, e.g. yuhuili/EAGLE-Vicuna-7B-v1.3): a one-layer Llama config;
                      model.safetensors or a pickled pytorch_model.bin with `fc.weight`: read by drafters/eagle.py
    eagle3            EAGLE-3's (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): the same, with `draft_vocab_size` in the
                      config or `midlayer.*` tensors: read by drafters/eagle3.py

A published layout loads into the same modules as clover's own (heads.Clover2Heads, heads.MedusaHeads,
drafters.eagle.EagleHead), with the config switches that make them compute the authors' function exactly:

Clover-2 authors': their `ResAttentionBlock`s are our gates (`clover_head_mlp_rnn` -> fuse, `clover_head_mlp_rnn2` ->
rnn, their `input_layernorm` -> norm), `clover_norm` -> norm, `clover_head_mlp` -> head0, `clover_head_mlp2` ->
head_next, `clover_head_norm` -> head_norm, `layers.*` unchanged. Drafted tokens are embedded with
`clover_embed_tokens` (a frozen copy of the target's lm_head: shared with the target when it equals it, kept
otherwise), the augmenting layers use RoPE base 10000 (their code's fixed default, whatever the target's), and the
gates' cosine takes the config's rms_norm_eps as its eps. The file's `lm_head.weight` must be the target's.

Medusa's: head i is `{i}.{j}.linear` (j < n: residual SiLU blocks; the reference repeats one block n times, so they
are equal) then `{i}.{n}.weight`, the head's own vocabulary projection. The number of heads is read from the
tensors: the published 7B config says 2 where the file holds 5 (the reference code overrides it too).

Pickled files are read tensors-only (torch.load with weights_only=True); a pickle that needs anything else is
refused. safetensors is preferred where both exist.

`family` says which drafter family a directory holds ("clover2", "medusa", "eagle") without loading it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..errors import CloverError
from ..heads import TARGET_KEYS, HeadsConfig, build_heads

CLOVER_AUTHORS_FILES = ("model.safetensors", "pytorch_model.bin", "model.pt")
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_lm_head.bin")
AUTHORS_ROPE_THETA = 10000.0  # the Clover-2 reference's LlamaRotaryEmbedding default; its code never reads the config's


def _config(path: Path) -> dict | None:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def detect(path: Path) -> str | None:
    """The layout of heads directory `path` ("clover", "clover2-authors", "medusa-authors", "eagle"), or None when it
    is not a heads directory clover knows."""
    path = Path(path)
    raw = _config(path)
    if raw is None:
        return None
    if "architecture" in raw:
        return "clover"
    if isinstance(raw.get("clover"), dict):
        return "clover2-authors"
    if "medusa_num_heads" in raw or any((path / f).is_file() for f in MEDUSA_FILES):
        return "medusa-authors"
    from .eagle import is_layout
    from .eagle3 import is_layout as is_eagle3

    if is_eagle3(path, raw):  # before EAGLE-1's test, which an EAGLE-3 file (fc.weight, one layer) also passes
        return "eagle3"
    if is_layout(path, raw):
        return "eagle"
    return None


FAMILIES = {"clover2-authors": "clover2", "medusa-authors": "medusa", "eagle": "eagle", "eagle3": "eagle3"}


def family(path: Path) -> str | None:
    """The drafter family of heads directory `path`: "clover2", "medusa" or "eagle" (None: not a heads directory
    clover knows)."""
    layout = detect(Path(path))
    if layout == "clover":
        return _config(Path(path)).get("architecture")
    return FAMILIES.get(layout)


def _first(path: Path, names) -> Path | None:
    return next((path / n for n in names if (path / n).is_file()), None)


def _read(file: Path, what: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors or pickled file, tensors only. Raises CloverError in one line."""
    if file.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(file))
        except (SafetensorError, OSError) as e:
            raise CloverError(f"{what} {file}: unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    from ..torchload import load

    state = load(file, what)
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CloverError(f"{what} {file} holds something other than named tensors")
    return state


def load(path: Path, target_model, dtype=None) -> torch.nn.Module:
    """Heads from directory `path` in any layout above, built for `target_model`, on its device. CloverError (one
    line) for an unknown layout, a damaged file, or heads made for another model."""
    from ..heads import load_heads

    path = Path(path)
    if not path.is_dir():
        raise CloverError(f"heads directory not found: {path}")
    layout = detect(path)
    if layout == "clover":
        return load_heads(path, target_model, dtype)
    if layout == "clover2-authors":
        return _load_clover_authors(path, target_model, dtype)
    if layout == "medusa-authors":
        return _load_medusa_authors(path, target_model, dtype)
    if layout == "eagle":
        from .eagle import load as load_eagle

        return load_eagle(path, target_model, dtype)
    if layout == "eagle3":
        from .eagle3 import load as load_eagle3

        return load_eagle3(path, target_model, dtype)
    raise CloverError(f"{path} is not a heads directory in a layout clover reads (clover's own, the Clover-2 "
                      f"authors', Medusa's, EAGLE's)")


def _finish(heads, state: dict, path: Path, target_model, dtype) -> torch.nn.Module:
    from ..heads import _compute_dtype

    try:
        missing, unexpected = heads.load_state_dict(state, strict=False)
    except RuntimeError as e:
        shape = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e)[:200])
        raise CloverError(f"heads {path} do not fit this model ({shape})")
    if missing or unexpected:
        some = ", ".join((list(missing) + list(unexpected))[:3])
        raise CloverError(f"heads {path} do not match their layout ({len(missing)} missing, {len(unexpected)} "
                          f"unexpected tensors: {some})")
    device = target_model.get_input_embeddings().weight.device
    return heads.to(device=device, dtype=dtype or _compute_dtype(target_model)).eval()


def check_size(path: Path, hidden: int, vocab: int, target_model) -> None:
    """A published file's hidden size and vocabulary against the target's: CloverError in one line if they differ."""
    tc = target_model.config.to_dict()
    if (hidden, vocab) != (tc.get("hidden_size"), tc.get("vocab_size")):
        raise CloverError(f"heads {path} were made for hidden size {hidden} and vocabulary {vocab}; this model has "
                          f"{tc.get('hidden_size')} and {tc.get('vocab_size')}")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two weight matrices are one (up to the rounding of a dtype cast), compared in row blocks."""
    if a.shape != b.shape:
        return False
    for i in range(0, a.shape[0], 4096):
        x, y = a[i:i + 4096].detach().float(), b[i:i + 4096].detach().to("cpu").float()
        if not torch.allclose(x, y, rtol=1e-2, atol=1e-3 * max(float(y.abs().max()), 1e-6)):
            return False
    return True


def _strip_prefix(state: dict) -> dict:
    """Keys as the reference module names them: a wrapper's prefix (e.g. 'ea_layer.') taken off."""
    anchor = next((k for k in state if re.search(r"(^|\.)clover_head_mlp\.", k)), None)
    if anchor is None:
        return state
    prefix = anchor[:anchor.index("clover_head_mlp.")]
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)} if prefix else state


CLOVER_AUTHORS_NAMES = [  # (their module, ours), longest first
    ("clover_head_mlp_rnn2.input_layernorm.", "rnn.norm."), ("clover_head_mlp_rnn2.", "rnn."),
    ("clover_head_mlp_rnn.input_layernorm.", "fuse.norm."), ("clover_head_mlp_rnn.", "fuse."),
    ("clover_head_mlp2.", "head_next."), ("clover_head_mlp.", "head0."),
    ("clover_head_norm.", "head_norm."), ("clover_norm.", "norm."), ("layers.", "layers."),
]


def _load_clover_authors(path: Path, target_model, dtype) -> torch.nn.Module:
    raw = _config(path)
    block = raw["clover"]
    try:
        num_heads, num_layers = int(block["num_heads"]), int(block["num_layers"])
        hidden, vocab = int(raw["hidden_size"]), int(raw["vocab_size"])
        gate_heads, eps = int(raw["num_attention_heads"]), float(raw.get("rms_norm_eps", 1e-6))
    except (KeyError, TypeError, ValueError) as e:
        raise CloverError(f"heads {path}: the Clover-2 authors' config.json lacks a valid {e}")
    if not (1 <= num_heads <= 64 and 0 <= num_layers <= 64 and gate_heads >= 1 and hidden % gate_heads == 0):
        raise CloverError(f"heads {path}: the Clover-2 authors' config.json is not valid")
    if raw.get("rope_scaling"):
        raise CloverError(f"heads {path}: augmenting layers with RoPE scaling {raw['rope_scaling']} are not supported")
    check_size(path, hidden, vocab, target_model)
    file = _first(path, CLOVER_AUTHORS_FILES)
    if file is None:
        raise CloverError(f"heads {path} have no weights ({' or '.join(CLOVER_AUTHORS_FILES)})")
    state = _strip_prefix(_read(file, "heads"))

    lm_head = target_model.get_output_embeddings().weight
    theirs = state.pop("lm_head.weight", None)
    if theirs is not None and not _same(theirs, lm_head):
        raise CloverError(f"heads {path} were made for another model: their lm_head is not this model's")
    table = state.pop("clover_embed_tokens.weight", None)
    if table is None:
        raise CloverError(f"heads {path} have no clover_embed_tokens (the Clover-2 authors' layout has it)")
    embed = ("lm_head" if _same(table, lm_head) else
             "input" if _same(table, target_model.get_input_embeddings().weight) else "own")

    mapped = {}
    for key, value in state.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue  # a buffer older transformers saved; recomputed here
        new = next((ours + key[len(theirs_):] for theirs_, ours in CLOVER_AUTHORS_NAMES if key.startswith(theirs_)),
                   None)
        mapped[new or key] = value  # an unknown key stays: reported as unexpected
    if embed == "own":
        mapped["embed_tokens.weight"] = table

    cfg = HeadsConfig(architecture="clover2", num_heads=num_heads, num_layers=num_layers, hidden_size=hidden,
                      vocab_size=vocab, num_gate_heads=gate_heads, rms_norm_eps=eps, embed=embed,
                      rope_theta=AUTHORS_ROPE_THETA, gate_eps=eps, layout="clover2-authors",
                      target={k: raw.get(k) for k in TARGET_KEYS},
                      training={k: block.get(k) for k in ("heads_coefficient", "decay_coefficient") if k in block})
    cfg.target["name_or_path"] = raw.get("_name_or_path") or None
    cfg.check_target(target_model.config, str(path))
    return _finish(build_heads(cfg, target_model), mapped, path, target_model, dtype)


MEDUSA_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
MEDUSA_PROJ = re.compile(r"^(\d+)\.(\d+)\.weight$")


def _load_medusa_authors(path: Path, target_model, dtype) -> torch.nn.Module:
    raw = _config(path)
    file = _first(path, MEDUSA_FILES)
    if file is None:
        raise CloverError(f"heads {path} have no weights ({' or '.join(MEDUSA_FILES)})")
    state = _read(file, "heads")
    state = {k[len("medusa_head."):] if k.startswith("medusa_head.") else k: v for k, v in state.items()}
    blocks: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    projs: dict[int, tuple[int, torch.Tensor]] = {}
    for key, value in state.items():
        m = MEDUSA_BLOCK.match(key)
        if m:
            blocks.setdefault(int(m[1]), {}).setdefault(int(m[2]), {})[m[3]] = value
            continue
        m = MEDUSA_PROJ.match(key)
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
    return _finish(build_heads(cfg, target_model), mapped, path, target_model, dtype)
