"""The compiled target step: the target's own forward, exported once with symbolic sizes and compiled ahead of time.

One program serves every step of a model: n new tokens (1 up to the KV capacity) after any number of committed ones,
a tree mask, and the rows whose logits are wanted. It is the stock transformers forward with our attention function
and cache (`Target.run`), traced by torch.export and compiled by AOTInductor with the weights frozen into it (on a
CPU: prepacked for oneDNN, the q/k/v and gate/up projections each concatenated into one product). It reads and writes
the live cache's own buffers, so eager and compiled steps can follow each other in one conversation. Per step there
is no Python between the operators, no guard to evaluate and one call into the compiled library.

    inputs   tokens [n] long, positions [n] long, tree [n, n] bool (which new tokens each one sees),
             rows [r] long (the tokens whose logits are wanted), past [past, 0] (only its length counts: the
             committed tokens), then every layer's key buffer and every layer's value buffer [1, Hkv, capacity, D]
    outputs  pre-norm hidden [n, H], logits [r, V]; the new keys and values are written at past..past+n-1

Building takes 15-30 s on two cores, so it runs in a child process (`python -m clover_cli.compiled`), never in
front of a reply; the package lands in the user cache keyed by everything it depends on (model files, dtype,
capacity, torch/transformers/clover versions, CPU instruction set) and loads in tens of milliseconds afterwards.
Before a package is written, the builder checks it against the eager forward (same logits, hidden states and
cache writes on a random tree) and times it per tree size: the engine sizes its trees from those timings instead
of measuring its own forwards on every start.

CPU only for now: on a GPU the eager path (with the Triton kernels) runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CloverError

PROGRAM_VERSION = 1  # bump when the program's inputs, outputs or semantics change: old packages are not reused
MAX_CAPACITY = 8192  # KV buffers of the compiled program (tokens); longer contexts run eager past this point
MAX_LINEAR_BYTES = 4 << 30  # the package holds a frozen copy of the weights: larger models stay eager
MODES = ("auto", "on", "off")
COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 65)  # tree sizes timed after building
PACKAGE = "step.pt2"
META = "meta.json"


def compile_mode(flag: str | None) -> str:
    """The --compile value, else CLOVER_COMPILE, else auto; a one-line error for anything else."""
    mode = flag or os.environ.get("CLOVER_COMPILE") or "auto"
    if mode not in MODES:
        where = "--compile" if flag else "CLOVER_COMPILE"
        raise CloverError(f"{where} must be auto, on or off, not {mode!r}")
    return mode


def unsupported(model, device: torch.device, dtype: torch.dtype, load_in_8bit: bool) -> str | None:
    """Why the compiled step cannot serve this model here (one short phrase), or None when it can."""
    if device.type != "cpu":
        return "the compiled step runs on a CPU only (the GPU path uses the Triton kernels)"
    if load_in_8bit:
        return "8-bit weights are not compiled"
    if dtype != torch.float32:
        return "the compiled step is built for float32 weights"
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if size > MAX_LINEAR_BYTES:
        return f"the model's weights ({size / 2**30:.1f} GiB) are too large to freeze into a compiled package"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
        return "no C++ compiler found (inductor needs one)"
    return None


def capacity_for(max_context: int) -> int:
    return min(max_context, MAX_CAPACITY)


# ---------------------------------------------------------------------------------------------------------------
# Where packages live

def cache_root() -> Path:
    from .stats import cache_dir

    return Path(os.environ.get("CLOVER_COMPILE_CACHE") or cache_dir() / "compiled")


def _fingerprint_files(model_path: Path) -> list:
    """(name, size, mtime) of the files that make the model: its config and weights."""
    out = []
    for f in sorted(model_path.iterdir()) if model_path.is_dir() else []:
        if f.suffix in (".json", ".safetensors", ".bin", ".pt", ".py") and f.is_file():
            st = f.stat()
            out.append((f.name, st.st_size, st.st_mtime_ns))
    return out


def package_key(model_path: Path, dtype: torch.dtype, capacity: int) -> str:
    """A name for the package of this model, dtype and capacity, built by these versions on this kind of CPU."""
    import transformers

    from . import __version__

    parts = {
        "program": PROGRAM_VERSION, "clover": __version__, "torch": torch.__version__,
        "transformers": transformers.__version__, "python": sys.version.split()[0],
        "cpu": torch.backends.cpu.get_cpu_capability(), "model": str(Path(model_path).resolve()),
        "files": _fingerprint_files(Path(model_path)), "dtype": str(dtype), "capacity": capacity,
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]
    return f"{Path(model_path).name[:40]}-{digest}"


def package_dir(model_path: Path, dtype: torch.dtype, capacity: int) -> Path:
    return cache_root() / package_key(model_path, dtype, capacity)


# ---------------------------------------------------------------------------------------------------------------
# The program and its build

class StepProgram(torch.nn.Module):
    """What gets exported: Target.run over the given buffers, with the tree mask after the committed tokens."""

    def __init__(self, target):
        super().__init__()
        self.model = target.model  # a submodule, so export sees its weights as parameters (frozen when compiled)
        self.target = target

    def forward(self, tokens, positions, tree, rows, past, *buffers):
        from .target import TreeKVCache

        n, committed = tokens.shape[0], past.shape[0]
        layers = len(buffers) // 2
        cache = TreeKVCache.over(list(buffers[:layers]), list(buffers[layers:]), committed)
        mask = torch.cat([tree.new_ones(n, committed), tree], 1)[None, None]
        return self.target.run(tokens, positions, mask, cache, rows)


def _example(target, n: int, past: int, seed: int = 0):
    """Program inputs for random tokens in a random tree (parents before children) after `past` committed ones."""
    from .tree import DraftTree

    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    tree = DraftTree(torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist(), parents)
    return (torch.tensor(tree.tokens), past + torch.tensor(tree.depths()), torch.from_numpy(tree.ancestor_mask()),
            torch.arange(n), torch.empty(past, 0))


def build(model_path: Path, out: Path, capacity: int, trust_remote_code: bool = False, allow_pickle: bool = False,
          log=print) -> dict:
    """Load the model at `model_path` (CPU, float32) and build its package into `out` (see build_for)."""
    from .loading import load
    from .target import Target

    t0 = time.perf_counter()
    loaded = load(Path(model_path), "cpu", "float32", False, trust_remote_code, allow_pickle)
    model = loaded.model.eval()
    why = unsupported(model, torch.device("cpu"), torch.float32, False)
    if why:
        raise CloverError(f"cannot compile {model_path}: {why}")
    target = Target(model, max_context=capacity, initial_capacity=capacity, pack=False)
    log(f"exporting the step of {model_path} ...")
    meta = build_for(target, out, log)
    log(f"compiled step ready in {time.perf_counter() - t0:.0f} s: {out}")
    return meta


def build_for(target, out: Path, log=print) -> dict:
    """Export, compile, check and time the step program of `target` (a Target whose cache capacity is the program's);
    write it to directory `out` atomically (built beside it, renamed into place). Returns the metadata written."""
    t0 = time.perf_counter()
    capacity = target.cache.capacity
    with torch.inference_mode():  # allocates the cache buffers at full capacity
        target.cache.truncate(0)
        target.forward(torch.tensor([0], device=target.device))
    keys, values = target.cache.buffers()
    program = StepProgram(target).eval()
    Dim = torch.export.Dim
    # n < capacity: with n == capacity a few sizes coincide and the program would have to tell them apart
    n, past = Dim("n", min=1, max=capacity - 1), Dim("past", min=0, max=capacity - 1)
    rows = Dim("rows", min=1, max=capacity - 1)
    shapes = ({0: n}, {0: n}, {0: n, 1: n}, {0: rows}, {0: past}, tuple(None for _ in keys + values))
    example = _example(target, 5, min(37, capacity - 6))
    # sizes 0 and 1 are not special-cased: one program for a single token and for a tree
    from torch.fx.experimental import _config as fx_config

    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        exported = torch.export.export(program, (*example, *keys, *values), dynamic_shapes=shapes, strict=False)
    log(f"compiling (AOTInductor, weights frozen) ... {time.perf_counter() - t0:.0f} s")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with torch.no_grad(), torch._inductor.config.patch({"freezing": True, "cpp.enable_concat_linear": True}):
            torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp / PACKAGE))
        step = CompiledStep(tmp, capacity)
        check(step, target)
        meta = {"program": PROGRAM_VERSION, "capacity": capacity, "torch": torch.__version__,
                "threads": torch.get_num_threads(), "verify_s": measure(step, target),
                "build_s": round(time.perf_counter() - t0, 1)}
        (tmp / META).write_text(json.dumps(meta, indent=1))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        target.cache.truncate(0)
    return meta


@torch.inference_mode()
def check(step: "CompiledStep", target, tolerance: float = 1e-3):
    """The package must compute what the eager forward computes: logits, hidden states and the keys and values it
    writes, on random trees of a few sizes after random cached keys and values."""
    keys, values = target.cache.buffers()
    g = torch.Generator().manual_seed(1)
    attached, target.program = target.program, None  # the reference is the eager forward
    try:
        _compare(step, target, keys, values, g, tolerance)
    finally:
        target.program = attached
        target.cache.truncate(0)


def _compare(step, target, keys, values, g, tolerance):
    from .target import TreeKVCache

    for n, past in ((1, 0), (1, 9), (7, 23), (16, 40)):
        past = min(past, step.capacity - n)
        for buf in keys + values:
            buf.copy_(torch.randn(buf.shape, generator=g) * 0.5)
        tokens, positions, tree, rows, _ = _example(target, n, past, seed=n)
        mine = TreeKVCache.over([k.clone() for k in keys], [v.clone() for v in values], past)
        pre_c, logits_c = step(mine, tokens, positions, tree, None)
        target.cache.length = past
        pre_e, logits_e = target.forward(tokens, positions, tree)
        scale = max(1.0, float(logits_e.abs().max()))
        worst = max(float((logits_c - logits_e).abs().max()) / scale,
                    float((pre_c - pre_e).abs().max()) / max(1.0, float(pre_e.abs().max())),
                    max(float((a[:, :, past:past + n] - b[:, :, past:past + n]).abs().max())
                        for a, b in zip(mine.buffers()[0], keys)))
        if not worst <= tolerance:  # also catches NaN
            raise CloverError(f"the compiled step disagrees with the eager one (relative error {worst:.2g} "
                              f"with {n} new tokens after {past})")


@torch.inference_mode()
def measure(step: "CompiledStep", target, repeats: int = 7) -> dict[str, float]:
    """Seconds per compiled forward by number of new tokens (the best of `repeats`)."""
    from .target import TreeKVCache

    keys, values = target.cache.buffers()
    cache = TreeKVCache.over(keys, values, 0)
    out = {}
    for n in COST_SIZES:
        past = min(200, step.capacity - n)
        tokens, positions, tree, _, _ = _example(target, n, past, seed=n)
        cache.length = past
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            step(cache, tokens, positions, tree, None)
            best = min(best, time.perf_counter() - t)
        out[str(n)] = best
    return out


# ---------------------------------------------------------------------------------------------------------------
# Running a package

class CompiledStep:
    """A loaded package: call it like Target.forward, with the cache whose buffers it writes."""

    def __init__(self, path: Path, capacity: int):
        self.path = Path(path)
        self.capacity = capacity
        self.package = torch._inductor.aoti_load_package(str(self.path / PACKAGE))
        self.loader = self.package.loader
        self._causal: dict[int, torch.Tensor] = {}
        self._rows: dict[int, torch.Tensor] = {}
        self._past: dict[int, torch.Tensor] = {}

    def fits(self, cache, n: int) -> bool:
        return (cache.capacity == self.capacity and n < self.capacity and cache.length + n <= self.capacity
                and cache.buffers() is not None)

    @torch.inference_mode()
    def __call__(self, cache, tokens, positions, tree_mask, logits_for):
        n, past = tokens.numel(), cache.length
        if tree_mask is None:
            tree_mask = self._causal.get(n)
            if tree_mask is None:
                tree_mask = self._causal[n] = torch.ones(n, n, dtype=torch.bool).tril()
        rows = self._rows.get(n)
        if rows is None:
            rows = self._rows[n] = torch.arange(n)
        if logits_for is not None:
            rows = rows[logits_for]
        marker = self._past.get(past)
        if marker is None:
            marker = torch.empty(past, 0)
            if len(self._past) < 4096:
                self._past[past] = marker
        keys, values = cache.buffers()
        pre, logits = self.loader.boxed_run([tokens, positions, tree_mask, rows, marker, *keys, *values])
        return pre, logits


@dataclass
class Package:
    path: Path
    capacity: int
    verify_s: dict[int, float]

    @staticmethod
    def find(d: Path) -> "Package | None":
        """The package built into directory `d`, if there is a complete one."""
        try:
            meta = json.loads((d / META).read_text())
        except (OSError, ValueError):
            return None
        if meta.get("program") != PROGRAM_VERSION or not (d / PACKAGE).is_file():
            return None
        return Package(d, int(meta["capacity"]), {int(k): float(v) for k, v in meta.get("verify_s", {}).items()})

    def load(self) -> CompiledStep:
        return CompiledStep(self.path, self.capacity)


# ---------------------------------------------------------------------------------------------------------------
# In a session

class StepCompiler:
    """The compiled step's life in a session. mode auto: a package already in the cache is used at once; otherwise
    one is built in the background (`start(background=True)`, chat) while replies run eager, and swapped in by
    `poll()` between steps when ready. mode on: built now if needed (start waits). mode off: always eager.
    A model or machine it cannot serve, or a build that fails, leaves the session eager with one warning line."""

    def __init__(self, mode: str, target, model_path: Path, dtype: torch.dtype, device: torch.device,
                 load_in_8bit: bool = False, trust_remote_code: bool = False, allow_pickle: bool = False,
                 warn=None):
        self.mode, self.target, self.model_path = mode, target, Path(model_path)
        self.trust_remote_code, self.allow_pickle = trust_remote_code, allow_pickle
        self.warn = warn or (lambda text: print(f"clover: {text}", file=sys.stderr))
        self.capacity = capacity_for(target.max_context)
        self.builder: Builder | None = None
        self.verify_s: dict[int, float] | None = None  # the package's measured costs, once active
        self.listeners: list = []  # called with verify_s when the compiled step becomes active
        self.just_activated = False  # set when poll() swapped the step in; the chat notes it and clears it
        self.out = package_dir(self.model_path, dtype, self.capacity)
        why = None if mode == "off" else unsupported(target.model, device, dtype, load_in_8bit)
        self.state, self.reason = "off", "--compile off"
        if why:
            self.state, self.reason = "eager", why
            if mode == "on":
                self.warn(f"no compiled step: {why}; running eager")
        elif mode != "off" and not self._activate():
            self.state, self.reason = "missing", "not built yet"

    @property
    def active(self) -> bool:
        return self.state == "active"

    def describe(self) -> str:
        return {"active": "compiled step active", "building": "compiled step building in the background "
                "(eager until it is ready)"}.get(self.state, f"eager ({self.reason})")

    def start(self, background: bool) -> None:
        """Build the package when none is cached: wait for it (mode on), or go on while it builds (background)."""
        if self.state != "missing" or (self.mode == "auto" and not background):
            return
        self.builder = Builder(self.model_path, self.out, self.capacity, self.trust_remote_code, self.allow_pickle)
        self.state, self.reason = "building", "building"
        if self.mode == "on":
            print(f"clover: compiling the step of {self.model_path.name} (once per model and machine; "
                  f"`clover compile` does it ahead) …", file=sys.stderr)
            self.builder.wait()
            self.poll()
            self.just_activated = False

    def poll(self) -> bool:
        """Swap the compiled step in if its build has finished; True when it just became active."""
        if self.state != "building" or not self.builder.done():
            return False
        if self._activate():
            self.just_activated = True
            return True
        self.state, self.reason = "failed", self.builder.error()
        self.warn(f"no compiled step ({self.reason}); running eager")
        return False

    def _activate(self) -> bool:
        pkg = Package.find(self.out)
        if pkg is None:
            return False
        try:
            step = pkg.load()
        except Exception as e:  # a package this torch cannot load: eager, and say why
            self.state, self.reason = "failed", f"cannot load {pkg.path}: {type(e).__name__}"
            self.warn(f"no compiled step ({self.reason}); running eager")
            return False
        self.target.attach_program(step)
        self.verify_s = pkg.verify_s
        self.state, self.reason = "active", "active"
        for listener in self.listeners:
            listener(dict(pkg.verify_s))
        return True


class StepCosts:
    """What verifying n tokens costs, measured once and kept on disk per model, device, dtype, thread count and
    step (eager or compiled), so a new process sizes its trees without timing its own forwards again. The engine
    refreshes the table from the forwards it runs and saves it back after each reply."""

    def __init__(self, model_path: Path, device: torch.device, dtype: torch.dtype, compiler: StepCompiler | None):
        self.model_path, self.device, self.dtype, self.compiler = Path(model_path), device, dtype, compiler
        self.threads = torch.get_num_threads()

    def _path(self) -> Path:
        step = "compiled" if self.compiler is not None and self.compiler.active else "eager"
        name = package_key(self.model_path, self.dtype, 0)
        dev = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        from .packed import supported

        tag = hashlib.sha256(f"{dev}|{self.threads}|{step}|{supported()}".encode()).hexdigest()[:10]
        return cache_root() / "costs" / f"{name}-{step}-{tag}.json"

    def load(self) -> dict[int, float] | None:
        try:
            table = {int(k): float(v) for k, v in json.loads(self._path().read_text()).items()}
        except (OSError, ValueError, AttributeError):
            table = None
        if not table and self.compiler is not None and self.compiler.active:
            table = dict(self.compiler.verify_s or {})  # measured by the builder
        return table or None

    def save(self, table: dict[int, float]) -> None:
        from .atomic import write_text

        try:
            write_text(self._path(), json.dumps({str(k): v for k, v in sorted(table.items())}))
        except OSError:
            pass  # a cache that cannot be written only costs the next process a measurement


# ---------------------------------------------------------------------------------------------------------------
# Building in a child process

def _lock_holder(out: Path) -> int | None:
    """The pid of a live process building `out`, if any (a stale lock is ignored)."""
    try:
        pid = int(Path(str(out) + ".lock").read_text().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


class Builder:
    """A `python -m clover_cli.compiled` child building a package while the caller goes on (eager). When another
    process is already building the same package, it waits for that one instead of starting a second build."""

    def __init__(self, model_path: Path, out: Path, capacity: int, trust_remote_code: bool = False,
                 allow_pickle: bool = False):
        out.parent.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.log_path = Path(str(out) + ".log")
        self.proc = None
        if _lock_holder(out) is not None:
            return
        cmd = [sys.executable, "-m", "clover_cli.compiled", str(model_path), "--capacity", str(capacity),
               "--out", str(out)]
        cmd += ["--trust-remote-code"] * trust_remote_code + ["--allow-pickle"] * allow_pickle
        with open(self.log_path, "w") as log:
            # its own session: Ctrl-C in the chat does not reach it, and a build under way finishes (into the
            # cache) even when the chat ends first
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def done(self) -> bool:
        if self.proc is None:  # another process's build: done when its lock is gone
            return _lock_holder(self.out) is None
        return self.proc.poll() is not None

    def wait(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.done() and time.monotonic() < deadline:
            time.sleep(0.2)

    def error(self) -> str:
        """The child's last line (its one-line reason) when it failed."""
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        last = lines[-1].removeprefix("clover: ") if lines else ""
        return last[:300] or "the build stopped without a package"


def build_locked(model_path: Path, out: Path, capacity: int, trust_remote_code: bool, allow_pickle: bool,
                 log=print) -> dict | None:
    """build() under a lock file beside `out`; None when another live process holds it."""
    lock = Path(str(out) + ".lock")
    out.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            if _lock_holder(out) is not None:
                return None
            lock.unlink(missing_ok=True)  # stale: its process is gone
    else:
        return None
    try:
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return build(model_path, out, capacity, trust_remote_code, allow_pickle, log)
    finally:
        lock.unlink(missing_ok=True)


def failure_line(e: Exception) -> str:
    """One line for an export or compiler failure: its first line is the reason we can give."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"compiling failed: {type(e).__name__}" + (f": {first[:240]}" if first else "")


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m clover_cli.compiled",
                                description="Build the compiled step package of a model (what `clover compile` runs).")
    p.add_argument("model", help="local model directory")
    p.add_argument("--capacity", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--allow-pickle", action="store_true")
    args = p.parse_args(argv)
    try:
        meta = build_locked(Path(args.model), Path(args.out), args.capacity, args.trust_remote_code,
                            args.allow_pickle, log=lambda s: print(s, flush=True))
    except CloverError as e:
        print(f"clover: {e}", flush=True)
        return 2
    except Exception as e:
        print(f"clover: {failure_line(e)}", flush=True)
        return 1
    if meta is None:
        print("another process is building this package", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
