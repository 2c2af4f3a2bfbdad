"""The compiled step's life in a session (StepCompiler): which backend serves the target's step (and the heads'
per-step modules, and a draft model's step), when its programs are built, and when they are swapped in.

On a CPU the step is compiled ahead of time (aot.py), its package built in a child process (aot_build.py) in the
background while replies run eager, or in the foreground. On a CUDA device nothing is built ahead: the static step
of graphs.py is captured as CUDA graphs in the session, each (rows, span) on its first use, and the heads' per-step
modules likewise (graphs.heads_graphs).
"""

from __future__ import annotations

import enum
import sys
from pathlib import Path

import torch

from ..loading import keep_loaded
from ..store import heads_dir, package_dir
from . import capacity_for, heads_kind, unsupported
from .aot import HeadsPrograms, _fingerprint, discard, find_heads, inspect_heads, inspect_package
from .aot_build import Builder, Job, building_elsewhere


class State(str, enum.Enum):
    """Where a StepCompiler stands (a str: it compares equal to its value)."""

    OFF = "off"  # --compile off: always eager
    EAGER = "eager"  # the model or machine cannot be served (`reason` says why), or the CUDA graphs failed
    MISSING = "missing"  # no package built yet: eager until one is
    BUILDING = "building"  # a package being built (by this process's child or another process): eager meanwhile
    ACTIVE = "active"  # the compiled step (or the CUDA graphs) runs the target's steps
    FAILED = "failed"  # its build failed, or the cache could not be written: eager for the session


class StepCompiler:
    """The compiled step's life in a session. mode auto: a package already in the cache is used at once; otherwise
    one is built in the background (`start(background=True)`, chat) while replies run eager, and swapped in by
    `poll()` between steps when ready. mode on: built now if needed (start waits). mode off: always eager.
    A model or machine it cannot serve, or a build that fails, leaves the session eager with one warning line."""

    def __init__(self, mode: str, target, model_path: Path, dtype: torch.dtype, device: torch.device,
                 load_in_8bit: bool = False, trust_remote_code: bool = False, allow_pickle: bool = False,
                 warn=None, weights: str = "float"):
        self.mode, self.target, self.model_path = mode, target, Path(model_path)
        self.dtype, self.device, self.weights = dtype, device, weights
        self.trust_remote_code, self.allow_pickle = trust_remote_code, allow_pickle
        # a draft model's own compiled step (use_drafter with a ModelDrafter): a StepCompiler of its own, built after
        # this one; `_started` is what start() was last asked (None: not yet), which a draft set later also gets
        self.draft: StepCompiler | None = None
        self._started: bool | None = None
        self._draft_waits = False  # its build starts when this one's ends
        self.warn = warn or (lambda text: print(f"clover: {text}", file=sys.stderr))
        self.capacity = capacity_for(target.max_context)
        self.builder: Builder | None = None
        self.verify_s: dict[int, float] | None = None  # the package's measured costs, once active
        self.listeners: list = []  # called with verify_s when the compiled step becomes active
        self.just_activated = False  # set when poll() swapped the step in; the chat notes it and clears it
        self.heads = self.heads_path = self.heads_out = None  # the drafter's heads (use_drafter) and their programs
        self.eager_for = None  # a drafter that needs the eager step (EAGLE-3 reads layers the program does not return)
        self._loaded: dict[Path, HeadsPrograms] = {}  # heads' programs loaded so far, by directory
        self._threads = 0  # torch's thread count to restore when a background build ends (0: none changed)
        self._said_other = False  # said that another process is building this package
        self.out = package_dir(self.model_path, dtype, self.capacity, weights)
        why = None if mode == "off" else unsupported(target.model, device, dtype, load_in_8bit)
        self.state, self.reason = State.OFF, "--compile off"
        self.graphs = None  # on CUDA: the static step whose CUDA graphs are captured as each size is first used
        if why:
            self.state, self.reason = State.EAGER, why
            if mode == "on":
                self.warn(f"no compiled step: {why}; running eager")
        elif mode != "off" and device.type == "cuda":
            from .graphs import attach, check

            self.graphs = attach(target, self.capacity)
            why = check(self.graphs)
            if why:
                target.program, self.graphs = None, None
                self.state, self.reason = State.EAGER, why
                self.warn(f"no CUDA graphs: {why}; running eager")
            else:
                self.state, self.reason = State.ACTIVE, "active"
                self.graphs.on_failure = self._graphs_failed
        elif mode != "off" and not self._activate():
            self.state, self.reason = State.MISSING, "not built yet"
            if building_elsewhere(self.out):  # another clover process is building it: use it when it is done
                self._watch(Builder(self.job(), watch=True), step=True)

    @property
    def active(self) -> bool:
        return self.state == State.ACTIVE and self.eager_for is None

    def describe(self) -> str:
        if self.state == State.BUILDING:
            return "compiled step building in the background (eager until it is ready)"
        if self.eager_for is not None and self.state != State.OFF:
            return f"eager ({self.eager_for} reads target layers the compiled step does not return)"
        if self.state != State.ACTIVE:
            return f"eager ({self.reason})"
        if self.graphs is not None:
            heads = "; heads too" if self.heads is not None and self.heads.programs is not None else ""
            return "CUDA graphs active" + heads + ("; draft model " + self.draft._draft_state() if self.draft else "")
        if self.draft is not None:
            return "compiled step active; draft model " + self.draft._draft_state()
        if self.heads is None or self.heads_out is None:
            return "compiled step active"
        if self.heads.programs is not None:
            return "compiled step and heads active"
        return "compiled step active; heads " + ("building in the background" if self.builder else "eager")

    def _draft_state(self) -> str:
        """What describe() says of a draft model's step (this compiler being the draft's)."""
        if self.state == State.ACTIVE:
            return "CUDA graphs" if self.graphs is not None else "compiled"
        if self.state == State.BUILDING:
            return "compiling in the background"
        return "eager" if self.state == State.MISSING else f"eager ({self.reason})"

    def use_drafter(self, drafter, heads_path, draft_path=None) -> None:
        """The session's drafter (again after a switch): its heads' programs are attached when they are built, and a
        draft model (`draft_path`: a ModelDrafter's model directory) gets a compiled step of its own."""
        self._use_draft_model(drafter, draft_path)
        heads = drafter.primary  # the default drafter merges the heads with lookup
        self.eager_for = heads.name if heads.feature_layers else None
        self.heads = heads if heads_kind(heads) else None
        self.heads_path = Path(heads_path) if heads_path is not None and self.heads is not None else None
        self.heads_out = None
        if self.graphs is not None and self.heads is not None:
            self._attach_graphs(self.heads)
        if self.heads_path is not None and self.state not in (State.OFF, State.EAGER) and self.graphs is None:
            self.heads_out = heads_dir(self.out, self.heads_path, self.heads.grower.topk,
                                       getattr(self.heads, "int8", False))
            self._activate_heads()

    def _graphs_failed(self, why: str) -> None:
        self.state, self.reason, self.graphs = State.EAGER, why, None
        self.warn(f"no CUDA graphs: {why}; running eager")

    def _attach_graphs(self, drafter) -> bool:
        """On CUDA: the heads' per-step modules as static calls captured as graphs (graphs.py)."""
        from .graphs import heads_graphs

        programs = heads_graphs(drafter, self.capacity)
        if programs is None:
            return False
        programs.on_failure = lambda why: self.warn(f"no CUDA graphs for the heads: {why}; they run eager")
        drafter.attach_programs(programs)
        return True

    def _use_draft_model(self, drafter, draft_path) -> None:
        runner = drafter.draft  # a ModelDrafter runs its model as a Target
        if runner is None or draft_path is None or self.state in (State.OFF, State.EAGER, State.FAILED):
            self.draft = None
            return
        if self.draft is None or self.draft.target is not runner:
            self.draft = StepCompiler(self.mode, runner, draft_path, self.dtype, self.device,
                                      trust_remote_code=self.trust_remote_code, warn=self.warn)
            if self._started is not None:  # the session already started its builds: this one follows
                self._start_draft(self._started)

    def _start_draft(self, background: bool) -> None:
        if self.builder is None:
            self.draft.start(background)
        else:
            self._draft_waits = background

    def ready_draft(self, drafter, draft_path) -> bool:
        """Compile a draft model's step for a ModelDrafter (clover bench makes one per run), waiting for the build
        when it is not cached. False when the compiled step is not in use or the build failed."""
        if self.state != State.ACTIVE or drafter.draft is None:
            return False
        if self.draft is None or self.draft.target is not drafter.draft:
            self.draft = StepCompiler("on", drafter.draft, draft_path, self.dtype, self.device,
                                      trust_remote_code=self.trust_remote_code, warn=self.warn)
        self.draft.start(background=False)
        return self.draft.active

    def job(self) -> Job:
        return Job(self.model_path, self.out, self.capacity, self.trust_remote_code, self.allow_pickle,
                   self.heads_path if self.heads_out else None, self.heads_out,
                   self.heads.grower.topk if self.heads is not None else 8, weights=self.weights)

    def start(self, background: bool) -> None:
        """Build what is not cached (the step, the heads' programs, then a draft model's step): wait for it (mode on),
        or go on while it builds in the background (mode auto, background)."""
        self._started = background
        self._start_own(background)
        if self.draft is not None:
            self._start_draft(background)

    def _start_own(self, background: bool) -> None:
        if self.graphs is not None:
            return  # nothing to build: the graphs are captured as they are first used
        if self.builder is None:
            step, heads = self.job().missing() if self.state in (State.MISSING, State.ACTIVE) else (False, False)
            step = step and self.state == State.MISSING
            if not (step or heads) or (self.mode == "auto" and not background):
                return
            builder = self._builder(self.job(), step)
            if builder is None:
                return
            self._watch(builder, step)
        else:
            step = self.state == State.BUILDING
        if self.mode == "on":
            if not getattr(self.builder, "other", False):
                print(f"clover: compiling the {'step' if step else 'heads'} of {self.model_path.name} (once per model "
                      f"and machine; `clover compile` does it ahead) …", file=sys.stderr)
            self.builder.wait()
            self.poll()
            self.just_activated = False

    def _builder(self, job: Job, step: bool) -> "Builder | None":
        """A Builder for `job`, or None (with one warning line: eager) when the compile cache cannot be written."""
        try:
            return Builder(job)
        except OSError as e:
            where = e.filename or job.out
            why = f"cannot write the compile cache: {e.strerror or type(e).__name__}: {where}"
            if step:
                self.state, self.reason = State.FAILED, why
                self.warn(f"no compiled step ({why}); running eager")
            else:
                self.warn(f"no compiled heads ({why}); they run eager")
            return None

    def _watch(self, builder: Builder, step: bool) -> None:
        self.builder = builder
        self._say_other()
        if step:
            self.state, self.reason = State.BUILDING, "building"
        if self.mode == "auto" and not self._threads and torch.get_num_threads() > 1:
            # Replies run meanwhile. Several threads of ours would wait on each other at every operator whenever the
            # build takes one of their cores (a reply 20-30x slower on two cores): one thread until it is done.
            self._threads = torch.get_num_threads()
            torch.set_num_threads(1)

    def building_beside(self) -> bool:
        """Whether a build runs beside the replies with this process's threads cut to one for it (_watch): the
        thread count is this compiler's until the build ends."""
        return bool(self._threads)

    def _say_other(self) -> None:
        """One line, once, when the build is another process's (this one runs eager meanwhile and picks its package
        up when it lands)."""
        if getattr(self.builder, "other", False) and not self._said_other:
            self._said_other = True
            self.warn(f"another process is building the compiled step of {self.model_path.name}; "
                      + ("waiting for it" if self.mode == "on" else "running eager meanwhile"))

    def poll(self) -> bool:
        """Swap in what a finished build made; True when the compiled step just became active."""
        if self.draft is not None:
            self.draft.poll()
        if self.builder is None:
            return False
        finished = self.builder.done()
        self._say_other()
        if not finished:
            return False
        builder, self.builder = self.builder, None
        if self._threads:
            torch.set_num_threads(self._threads)
            self._threads = 0
        if self._draft_waits and self.draft is not None:
            self._draft_waits = False
            self.draft.start(background=True)
        became = False
        if self.state == State.BUILDING:
            became = self._activate()
            if not became and self.state == State.BUILDING:
                self.state, self.reason = State.FAILED, builder.error()
                self.warn(f"no compiled step ({self.reason}); running eager")
        if self.heads_out is not None and self.heads.programs is None and not self._activate_heads() \
                and self.state == State.ACTIVE:
            self.warn(f"no compiled heads ({builder.error()}); they run eager")
        self.just_activated = self.just_activated or became
        keep_loaded()  # what the build brought in lives as long as the session, as the model does
        return became

    def _discard(self, d: Path, seen, why: str, what: str = "compiled step") -> None:
        """A damaged package: one line, and removed (a build makes it again: chat's in the background, `clover
        compile`)."""
        gone = discard(d, seen)
        self.warn(f"the {what}'s package {d} is damaged ({why}){': discarded' if gone else ''}; running eager until "
                  f"it is built again")

    def _activate(self) -> bool:
        seen = _fingerprint(self.out)
        pkg, why = inspect_package(self.out)
        if pkg is None:
            if why:
                self._discard(self.out, seen, why)
            return False
        try:
            step = pkg.load(self.target.model)
        except Exception as e:  # noqa: BLE001 - a package that does not load is damaged: built again
            self._discard(self.out, seen, (str(e).splitlines() or [""])[0][:200] if isinstance(e, ValueError)
                          else f"it does not load: {type(e).__name__}")
            return False
        self.target.attach_program(step)
        self.verify_s = pkg.verify_s
        self.state, self.reason = State.ACTIVE, "active"
        for listener in self.listeners:
            listener(dict(pkg.verify_s), padded=True)
        return True

    def _activate_heads(self) -> bool:
        return self._attach_heads(self.heads, self.heads_out)

    def _attach_heads(self, drafter, out: Path) -> bool:
        """Attach the heads' programs built into `out` to `drafter` (loaded once per session, shared)."""
        programs = self._loaded.get(out)
        if programs is None:
            seen = _fingerprint(out)
            meta, why = inspect_heads(out, full=True)
            if why:
                self._discard(out, seen, why, "heads")
            if meta is None or meta.get("kind") != heads_kind(drafter) or meta.get("topk") != drafter.grower.topk:
                return False
            try:
                programs = self._loaded[out] = HeadsPrograms(out, meta["kind"], meta["capacity"],
                                                             meta.get("augment_ranges"), meta["weights_outside"],
                                                             drafter, meta["weight_shapes"])
            except Exception as e:  # noqa: BLE001 - programs that do not load are damaged: built again
                self._discard(out, seen, f"they do not load: {type(e).__name__}", "heads")
                return False
        drafter.attach_programs(programs)
        return True

    def ready_heads(self, drafter, heads_path: Path) -> bool:
        """Attach compiled programs to another heads drafter (clover bench makes one per run), building them first
        (waiting) when they are not cached yet. False when the compiled step is not in use or the build failed."""
        if self.state != State.ACTIVE or heads_kind(drafter) is None:
            return False
        if self.graphs is not None:
            return self._attach_graphs(drafter)
        out = heads_dir(self.out, Path(heads_path), drafter.grower.topk, getattr(drafter, "int8", False))
        if out not in self._loaded and find_heads(out) is None:
            job = Job(self.model_path, self.out, self.capacity, self.trust_remote_code, self.allow_pickle,
                      Path(heads_path), out, drafter.grower.topk, weights=self.weights)
            builder = self._builder(job, step=False)
            if builder is None:
                return False
            builder.wait()
            if find_heads(out) is None:
                self.warn(f"no compiled heads ({builder.error()}); they run eager")
                return False
        return self._attach_heads(drafter, out)
