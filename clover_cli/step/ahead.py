"""`clover compile`: the compiled target step of a model, its heads' programs and a draft model's step, built ahead
of time (the cache and its keys: store.py; the build itself: aot_build.py). `echo(text, err=False)` prints."""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import CloverError, one_line


def compile_model(resolved, heads: str | None, no_heads: bool, draft_model: str | None, with_draft: bool,
                  trust_remote_code: bool, allow_pickle: bool, force: bool, echo, dtype: str = "auto",
                  quantize: str | None = None):
    """Build what `resolved` lacks (its step with the weights a chat would run: --dtype and --quantize as there, its
    heads' programs, with --draft-model/--with-draft a draft model's step) and say what was built and what a verify
    forward costs."""
    import torch
    from transformers import AutoConfig

    from . import capacity_for
    from ..drafters import registry
    from ..families import by_architecture
    from ..quantized import heads_int8, weights_for
    from ..store import heads_dir, package_dir
    from ..target import context_limit
    from .aot import Package, find_heads
    from .aot_build import Job

    try:
        config = AutoConfig.from_pretrained(resolved.path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise CloverError(f"cannot read the model config in {resolved.path}: {one_line(e)}")
    heads_path = None if no_heads else registry.resolve_heads(heads, resolved)
    family = by_architecture(registry.family(heads_path)) if heads_path is not None else None
    if family is not None and registry.drafter_class(family.architecture).programs_kind is None:
        echo(f"{family.name} heads run eager (they have no compiled programs): compiling the target's step only",
             err=True)
        heads_path = None
    if heads_path is not None and registry.detect(heads_path) == "clover":  # before the target's step is built (a minute)
        _check_heads(heads_path, config)
    capacity = capacity_for(context_limit(config))
    weights = weights_for(quantize, dtype, torch.device("cpu"), resolved.path)
    out = package_dir(resolved.path, torch.float32, capacity, weights)
    # the programs a session's drafter asks for: made for its tree rule's children per node (config.json's `tree`)
    topk = heads_topk(heads_path) if heads_path is not None else 8
    job = Job(resolved.path, out, capacity, trust_remote_code, allow_pickle, heads_path,
              heads_dir(out, heads_path, topk, heads_int8(weights)) if heads_path else None, topk=topk, force=force,
              weights=weights)
    built_s = _build(job, resolved.name, echo)
    if built_s is None:
        echo(f"{resolved.name} is already compiled (--force builds it again)")
    else:
        echo(f"compiled {resolved.name} in {built_s:.0f} s")
    pkg = Package.find(out)
    costs = " · ".join(f"{n} token{'s' * (n > 1)} {1000 * pkg.verify_s[n]:.2f} ms" for n in (1, 16, 32)
                       if n in pkg.verify_s)
    echo(f"package: {pkg.path}")
    echo(f"verify forward: {costs}")
    if heads_path is not None:
        echo(f"heads ({find_heads(job.heads_out)['kind']}): {job.heads_out}")
    if draft_model or with_draft:
        _compile_draft(draft_model, resolved, context_limit(config), trust_remote_code, force, echo)


def _build(job, shown: str, echo) -> float | None:
    """Build what `job` lacks (seconds it took), or None when nothing was missing; one line when it fails."""
    from . import aot, aot_build

    for d, damage, what in ((job.out, aot.damage, "compiled step"), (job.heads_out, aot.heads_damage, "heads")):
        seen = aot._fingerprint(d) if d is not None else None
        why = damage(d) if d is not None else None
        if why:  # every file checked against its checksum: a damaged package is built again, not "already compiled"
            echo(f"clover: the {what}'s package {d} is damaged ({why}); building it again", err=True)
            aot.discard(d, seen)
    if not any(job.missing()):
        return None
    t0 = time.perf_counter()
    try:  # another process building it: waited for (one line), then what it did not build is built
        built = aot_build.build_locked(job, log=lambda text: echo(text, err=True), wait=True, name=shown)
    except CloverError:
        raise
    except Exception as e:  # export or compiler failure
        raise CloverError(aot_build.failure_line(e))
    return time.perf_counter() - t0 if built else None


def _compile_draft(name: str | None, resolved, target_context: int, trust_remote_code: bool, force: bool, echo):
    """The draft model's package, keyed as the session's draft compiler keys it (its context: the shorter of the
    draft's and the target's)."""
    import torch
    from transformers import AutoConfig

    from . import capacity_for
    from ..drafters.draft_model import resolve_draft_model
    from ..store import package_dir
    from ..target import context_limit
    from .aot import Package
    from .aot_build import Job

    shown, path = resolve_draft_model(name, resolved)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise CloverError(f"cannot read the draft model's config in {path}: {one_line(e)}")
    capacity = capacity_for(context_limit(config, target_context))
    out = package_dir(path, torch.float32, capacity)
    job = Job(path, out, capacity, trust_remote_code, False, force=force)
    built_s = _build(job, shown, echo)
    if built_s is None:
        echo(f"the draft model {shown} is already compiled (--force builds it again)")
    else:
        echo(f"compiled the draft model {shown} in {built_s:.0f} s")
    echo(f"draft package: {Package.find(out).path}")


def heads_topk(path: Path) -> int:
    """The children per expanded node the drafter of the heads in `path` grows (registry.drafter_for: their
    config's tree rule over TreeGrower's default), which their compiled levels are made for."""
    from ..drafters.common import TreeGrower
    from ..drafters.registry import detect, load_heads_config

    default = TreeGrower().topk
    if detect(path) != "clover":
        return default
    tree = load_heads_config(path).tree or {}
    return int(tree.get("topk", default))


def _check_heads(path: Path, config):
    """Refuse heads whose config is bad, that do not fit the target or whose weights are damaged, in one line."""
    from safetensors import safe_open

    from ..drafters.registry import check_target, load_heads_config

    check_target(load_heads_config(path), config, str(path))
    try:
        with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
            f.keys()
    except Exception as e:  # SafetensorError, OSError
        why = getattr(e, "strerror", None) or one_line(e)
        raise CloverError(f"heads {path}: unreadable model.safetensors ({why})") from None
