"""Building the compiled step in a child process (`python -I` running this module's main(), started isolated from
the working directory: child_command), never in front of a reply, one process at a time per package (build_lock).
The packages land in the user cache keyed by everything they depend on (model and heads files, dtype, capacity,
torch/transformers/clover versions, CPU instruction set: clover_cli/store.py) and load in tens of milliseconds
afterwards. `clover compile` builds in the foreground, under the same lock (build_locked).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import atomic
from ..errors import CloverError, one_line
from ..quantized import WEIGHTS
from . import unsupported
from .aot import Package, find_heads
from .aot_export import build_for, build_heads_for

@dataclass
class Job:
    """What a build makes: the step package `out` of the model, and the heads' programs `heads_out` when `heads`
    (a heads directory) is given. Parts already in the cache are not built again unless `force`."""

    model: Path
    out: Path
    capacity: int
    trust_remote_code: bool = False
    allow_pickle: bool = False
    heads: Path | None = None
    heads_out: Path | None = None
    topk: int = 8
    force: bool = False
    weights: str = "float"  # the linears' weights (clover_cli/quantized.py WEIGHTS): float, gguf, int8, int4, bf16

    def argv(self) -> list[str]:
        """The child's arguments: every path absolute (it runs from another directory)."""
        path = os.path.abspath
        args = [path(self.model), "--capacity", str(self.capacity), "--out", path(self.out), "--topk", str(self.topk)]
        if self.heads is not None:
            args += ["--heads", path(self.heads), "--heads-out", path(self.heads_out)]
        return args + ["--trust-remote-code"] * self.trust_remote_code + ["--allow-pickle"] * self.allow_pickle \
            + ["--force"] * self.force + ["--weights", self.weights]

    def missing(self) -> tuple[bool, bool]:
        """(the step, the heads' programs) still to build."""
        step = self.force or Package.find(self.out) is None
        heads = self.heads is not None and (self.force or find_heads(self.heads_out) is None)
        return step, heads


def build(job: Job, log=print) -> dict:
    """Load the model (CPU, float32) once and build what `job` still lacks. Returns {"step": meta, "heads": meta}
    for the parts built."""
    from ..drafters.registry import drafter_class, load as load_heads
    from ..loading import load
    from ..quantized import apply
    from ..target import Target

    need_step, need_heads = job.missing()
    if not (need_step or need_heads):
        return {}
    t0 = time.perf_counter()
    loaded = load(Path(job.model), "cpu", "float32", False, job.trust_remote_code, job.allow_pickle)
    model = loaded.model.eval()
    if job.weights != "float" and apply(model, Path(job.model), job.weights, warn=log) is None:
        raise CloverError(f"cannot compile {job.model} with {job.weights} weights: the quantized kernels are missing")
    why = unsupported(model, torch.device("cpu"), torch.float32, False)
    if why:
        raise CloverError(f"cannot compile {job.model}: {why}")
    target = Target(model, max_context=job.capacity, initial_capacity=job.capacity, pack=False)
    built = {}
    if need_step:
        log(f"exporting the step of {job.model} ...")
        built["step"] = build_for(target, job.out, log)
        log(f"compiled step ready in {time.perf_counter() - t0:.0f} s: {job.out}")
    if need_heads:
        heads = load_heads(Path(job.heads), model)
        cls = drafter_class(heads.cfg.architecture)
        if cls.programs_kind is None:  # EAGLE heads have no compiled programs
            raise CloverError(f"{heads.cfg.architecture} heads run eager: they have no compiled programs")
        built["heads"] = build_heads_for(cls(heads, target, topk=job.topk), target.cache.capacity, job.heads_out,
                                         log)
        log(f"compiled heads ready in {time.perf_counter() - t0:.0f} s: {job.heads_out}")
    return built


# ---------------------------------------------------------------------------------------------------------------
# Building in a child process

def _lowest_priority():
    try:
        os.nice(19)
    except OSError:
        pass


BUSY = 3  # the builder child's exit status when another process holds the package's build lock
LOCK_WAIT_S = 1.0  # a child waits this long for the lock: a probe (building_elsewhere) holds it for microseconds


def build_lock(out: Path):
    """The lock a build of package `out` holds (filelock: an OS lock on `out`.lock, released by the system when its
    process dies, so no lock is ever stale, and the file's content means nothing)."""
    from filelock import FileLock

    return FileLock(f"{out}.lock")


def _locked_elsewhere(out: Path) -> bool:
    """Whether another process (or another lock object of this one) holds the build lock of `out`. Raises OSError
    when the lock file cannot be made (a cache that cannot be written)."""
    from filelock import Timeout

    lock = build_lock(out)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    lock.release()
    return False


def building_elsewhere(out: Path) -> bool:
    """Whether another process is building package `out` now (False when the lock cannot even be made)."""
    try:
        return _locked_elsewhere(out)
    except OSError:
        return False


def child_command(module: str, args: list[str]) -> list[str]:
    """The command running `module`'s main() with `args` in a child Python, isolated: `-I` (no working directory,
    script directory, PYTHON* variables or user site on its path), its path the one this process imports from
    (clover's own directory first, then this process's entries, made absolute; the working directory's '' left out).
    The child imports clover from where this process did, an editable install or a normal one, never from the
    directory it is started in. Start it from a fixed directory (cwd=) too."""
    here = str(Path(__file__).resolve().parent.parent.parent)
    paths = list(dict.fromkeys([here] + [os.path.abspath(p) for p in sys.path if p]))
    code = (f"import sys; sys.path[:0] = [p for p in {paths!r} if p not in sys.path]; "
            f"sys.argv[0] = {module!r}; from {module} import main; sys.exit(main())")
    return [sys.executable, "-I", "-c", code, *args]


class Builder:
    """A child process (child_command: `clover_cli.step.aot_build` isolated, started from the cache directory)
    building a package while the caller goes on (eager). When another process is already building the same package
    (its build lock is held: found here, or by the child, which then exits BUSY), it waits for that one instead
    (`other`).
    Raises OSError when the cache cannot be written (its directory, the lock, the log): the caller runs eager."""

    def __init__(self, job: Job, watch: bool = False):
        out = Path(job.out)
        self.out = out
        self.log_path = Path(str(out) + ".log")
        self.proc = None
        self.other = watch  # another process's build, which this one waits for
        self._checked = (0.0, False)  # (when, done) of the last look at the other build's lock: poll() runs per step
        if watch:
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        if _locked_elsewhere(out):
            self.other = True
            return
        # appended to, never truncated here: the child that takes the lock empties it, one that finds the lock taken
        # writes nothing (two builders never interleave their lines)
        log_fd = atomic.open_append(self.log_path, 0o644)
        with os.fdopen(log_fd, "a") as log:
            # its own session: Ctrl-C in the chat does not reach it, and a build under way finishes (into the
            # cache) even when the chat ends first. At the lowest priority: the replies meanwhile run eager on the
            # same cores, and must not wait on it.
            self.proc = subprocess.Popen(child_command("clover_cli.step.aot_build",
                                                       [*job.argv(), "--log", str(self.log_path)]),
                                         cwd=out.parent, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_lowest_priority)

    def done(self) -> bool:
        if self.proc is not None:
            if self.proc.poll() is None:
                return False
            if self.proc.returncode != BUSY:
                return True
            self.proc, self.other = None, True  # another process took the lock first: wait for its build
        when, done = self._checked
        if not done and time.monotonic() - when >= 0.2:
            self._checked = (time.monotonic(), not building_elsewhere(self.out))
        return self._checked[1]

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
        return last[:300] or ("the other process's build made no package" if self.other
                              else "the build stopped without a package")


def build_locked(job: Job, log=print, wait: bool = False, on_lock=None, name: str | None = None) -> dict | None:
    """build() under the package's build lock. When another process holds it: None at once, or with `wait` (one
    line said, naming the model as `name`) once that build has ended, building then what it did not (usually
    nothing). `on_lock` is called when the lock is taken, before anything is built."""
    from filelock import Timeout

    out = Path(job.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = build_lock(out)
    try:
        lock.acquire(timeout=LOCK_WAIT_S)
    except Timeout:
        if not wait:
            return None
        log(f"another clover process is compiling {name or job.model.name} right now; waiting for it ...")
        lock.acquire()
    try:
        if on_lock is not None:
            on_lock()
        built = build(job, log)
        if built:
            prune(job, log)
        return built
    finally:
        lock.release()


def prune(job: Job, log=print) -> None:
    """After a build: the compile cache's packages unused for long, or beyond its size cap, removed (cache_files.py);
    never the ones just built. Pruning that fails costs only disk space."""
    from ..cache_files import prune_compiled

    try:
        prune_compiled(keep=(job.out, job.heads_out), log=log)
    except Exception as e:  # noqa: BLE001 - a build never fails for what pruning met
        log(f"clover: pruning the compile cache failed: {one_line(e, 200, kind=True)}")


def failure_line(e: Exception) -> str:
    """One line for an export or compiler failure: its first line is the reason we can give."""
    return f"compiling failed: {one_line(e, 240, kind=True)}"


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m clover_cli.step.aot_build",
                                description="Build the compiled step of a model and its heads' programs (what "
                                            "`clover compile` runs; chat runs it in the background).")
    p.add_argument("model", help="local model directory")
    p.add_argument("--capacity", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--heads")
    p.add_argument("--heads-out")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--allow-pickle", action="store_true")
    p.add_argument("--force", action="store_true")
    p.add_argument("--weights", default="float", choices=WEIGHTS)
    p.add_argument("--log", help="the file standard output goes to: emptied once the build lock is taken")
    a = p.parse_args(argv)
    from ..signals import exit_on_signals

    exit_on_signals()
    job = Job(Path(a.model), Path(a.out), a.capacity, a.trust_remote_code, a.allow_pickle,
              Path(a.heads) if a.heads else None, Path(a.heads_out) if a.heads_out else None, a.topk, a.force,
              a.weights)

    def empty_log():
        if a.log:
            try:
                os.truncate(a.log, 0)  # not atomic: the log this build streams to (opened to append)
            except OSError:
                pass

    try:
        built = build_locked(job, log=lambda text: print(text, flush=True), on_lock=empty_log)
    except CloverError as e:
        print(f"clover: {e}", flush=True)
        return 2
    except Exception as e:
        print(f"clover: {failure_line(e)}", flush=True)
        return 1
    return BUSY if built is None else 0


if __name__ == "__main__":
    sys.exit(main())

