"""Which drafter family a heads directory holds, and everything done with heads by family: build, load, save, draft.

The families are families.FAMILIES (one line each); what is specific to one is its file's SPEC (families.Spec), read
here through families.spec (the file is imported then). Every layout clover reads, told apart by its files:

    clover            what `clover train` writes: config.json with an "architecture" (a family's: "clover2",
                      "medusa", "eagle", "eagle3"), model.safetensors (clover's own format: save_heads / load_own)
    a family's own    its SPEC.layout: clover2-authors (the Clover-2 authors', drafters/clover2.py), medusa-authors
                      (Medusa-1's, drafters/medusa.py), eagle (EAGLE-1's, drafters/eagle.py), eagle3 (EAGLE-3's,
                      drafters/eagle3.py)

A published layout loads into the same module as clover's own format, with the config switches that make it compute
the authors' function exactly. Pickled files are read tensors-only (torch.load with weights_only=True); a pickle that
needs anything else is refused. safetensors is preferred where both exist. Finding and fetching a directory (a local
path, the model's own `heads/`, a Hub repo) is hub.py's; what it holds is decided here.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict
from pathlib import Path

import torch
import torch.nn as nn

from .. import families
from ..errors import CloverError
from ..families import Layout, Spec, by_architecture, spec
from .common import DRAFT_VOCAB_KEY, HeadsConfig, compute_dtype, read_config, tree_rule_problem


def layouts() -> list[tuple[str, Layout]]:
    """(architecture, published layout) of every family that has one, in the order they are tried: FAMILIES' order,
    but a layout marked `before` another family's just before that one (EAGLE-3's before EAGLE-1's)."""
    found = [(f.architecture, spec(f.architecture).layout) for f in families.FAMILIES]
    found = [(arch, layout) for arch, layout in found if layout is not None]
    for pair in [pair for pair in found if pair[1].before is not None]:
        found.remove(pair)
        later = next((i for i, (arch, _) in enumerate(found) if arch == pair[1].before), len(found))
        found.insert(later, pair)
    return found


def known() -> str:
    """The layouts clover reads, in words."""
    published = [spec(f.architecture).layout for f in families.FAMILIES]
    return ", ".join(["clover's own"] + [layout.text for layout in published if layout is not None])


def family_spec(architecture: str) -> Spec:
    """A known architecture's SPEC; CloverError (one line) for one clover does not know."""
    if by_architecture(architecture) is None:
        raise CloverError(f"unknown heads architecture {architecture!r}")
    return spec(architecture)


def detect(path: Path) -> str | None:
    """The layout of heads directory `path` ("clover" or a family's published LAYOUT), or None when it is not a heads
    directory clover knows."""
    path = Path(path)
    raw = read_config(path)
    if raw is None:
        return None
    if "architecture" in raw:
        return "clover"
    for _, layout in layouts():
        if layout.is_layout(path, raw):
            return layout.name
    return None


def family(path: Path) -> str | None:
    """The drafter family of heads directory `path`: its architecture, "clover2", "medusa", "eagle", "eagle3", ...
    (None: not a heads directory clover knows)."""
    layout = detect(Path(path))
    if layout == "clover":
        return read_config(Path(path)).get("architecture")
    return next((arch for arch, published in layouts() if published.name == layout), None)


def is_heads_dir(path: Path) -> bool:
    return detect(Path(path)) is not None


def check_heads_dir(path: Path, name: str) -> Path:
    """`path`, when it holds heads clover reads; else a one-line error naming `name` (what the user gave)."""
    if not is_heads_dir(path):
        raise CloverError(f"{name} is not a heads directory in a layout clover reads ({known()})")
    return Path(path)


def resolve_heads(heads: str | None, model, revision: str | None = None, quiet: bool = False,
               draft: str = "auto") -> Path | None:
    """The heads directory to use: --heads (directory or Hub repo), else the model's own `heads/`, else those its
    alias publishes for `draft` (auto: the first; "bundled": those this package carries for it), else None."""
    from .. import aliases, hub

    if heads:
        return check_heads_dir(hub.fetch_heads(heads, revision, quiet), heads)
    own = model.path / aliases.HEADS_SUBDIR
    if is_heads_dir(own):
        return own
    repo = model.spec.heads_for(draft) if model.spec is not None else None
    if repo == "bundled":
        carried = aliases.bundled_heads(model.spec.alias)
        return carried if is_heads_dir(carried) else None
    if repo is not None:
        return hub.fetch_heads(repo, quiet=quiet)
    return None


def build_heads(cfg: HeadsConfig, target_model) -> nn.Module:
    return family_spec(cfg.architecture).build(cfg, target_model)


def load(path: Path, target_model, dtype=None) -> nn.Module:
    """Heads from directory `path` in any layout above, built for `target_model`, on its device. CloverError (one
    line) for an unknown layout, a damaged file, or heads made for another model."""
    path = Path(path)
    if not path.is_dir():
        raise CloverError(f"heads directory not found: {path}")
    layout = detect(path)
    if layout == "clover":
        return load_own(path, target_model, dtype)
    for _, published in layouts():
        if published.name == layout:
            return published.load(path, target_model, dtype)
    raise CloverError(f"{path} is not a heads directory in a layout clover reads ({known()})")


def drafter_class(architecture: str) -> type:
    """The Drafter class that runs heads of this architecture."""
    return family_spec(architecture).drafter


def drafter_for(heads, target, **grow):
    """The drafter that runs these heads, by their architecture, growing their config's tree rule (`tree`) where
    `grow` does not say otherwise."""
    return drafter_class(heads.cfg.architecture)(heads, target, **{**heads.cfg.tree, **grow})


# ---------------------------------------------------------------------------------------------- clover's own format

def save_heads(heads: nn.Module, out: Path, card: str):
    """Weights, config.json and model card, each written atomically and readable by all (0644)."""
    from safetensors.torch import save_file

    from .. import atomic

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    vocab = getattr(heads, "draft_vocab", None)
    if vocab is not None:
        state[DRAFT_VOCAB_KEY] = vocab.to("cpu", torch.long).contiguous()
    atomic.write_with(out / "model.safetensors", lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    atomic.write_text(out / "config.json", json.dumps(asdict(heads.cfg), indent=2) + "\n")
    atomic.write_text(out / "README.md", card)


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


def check_target(cfg: HeadsConfig, target_config, where: str):
    """CloverError (one line) when heads of config `cfg` do not fit the target of `target_config`: its sizes, and the
    shape of its decoder layer for a family whose heads copy it."""
    cfg.check_target(target_config, where, layer=spec(cfg.architecture).copies_layer)


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
    if by_architecture(cfg.architecture) is None:
        return f"unknown architecture {cfg.architecture!r}"
    if cfg.embed not in ("input", "lm_head", "own"):
        return f"embed must be input, lm_head or own, not {cfg.embed!r}"
    for name, lo, hi in (("num_heads", 1, 64), ("num_layers", 0, 64), ("hidden_size", 1, 1 << 20),
                         ("vocab_size", 1, 1 << 24), ("draft_vocab_size", 0, cfg.vocab_size)):
        if not lo <= getattr(cfg, name) <= hi:
            return f"{name} must be between {lo} and {hi}, not {getattr(cfg, name)}"
    problem = spec(cfg.architecture).config_problem  # the family's own checks (Clover-2: its gates split the state)
    if problem is not None and (why := problem(cfg)):
        return why
    if not (math.isfinite(cfg.rms_norm_eps) and 0 < cfg.rms_norm_eps < 1):
        return f"rms_norm_eps must be in (0, 1), not {cfg.rms_norm_eps}"
    return tree_rule_problem(cfg.tree)


def load_own(path: Path, target_model, dtype=None) -> nn.Module:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg = load_heads_config(path)
    check_target(cfg, target_model.config, str(path))
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
    return heads.to(device=device, dtype=dtype or compute_dtype(target_model)).eval()
