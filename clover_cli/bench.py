"""`clover bench`: every decoding method on the same prompts, interleaved, with speed, τ and output identity.

Methods: hf (transformers greedy generate), hf-lookup (its prompt-lookup assisted generation), hf-assisted (a
smaller assistant model: --assistant, else the --draft-model), our engine with plain / ngram / medusa / eagle /
clover drafting or a draft model's top-1 chain (model-chain) and MCSD tree (model), the same with the target's own
layers skipped as the draft (self-chain, self: --draft self; only when asked for with --methods), and
llama.cpp (plain, with prompt lookup, and drafted by a GGUF of the same draft model as the model rows) on a GGUF
of the same weights (clover_cli/llamacpp.py). One model load
serves every method. Each prompt is run by every method in turn (so drift on the machine hits all alike), the
order balanced over the prompts (each method in each place, and after each other one, equally often), after one untimed warm-up run of each method. Our engine starts every run from an empty cache (no reuse of a
previous run's prefix) with a fresh drafter, so no method sees another run's output.
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import torch

from . import atomic, families
from .bench_report import plot, plot_format, print_table
from .errors import CloverError
from .families import by_architecture, spec as family_spec
from .target import EXACT_ROWS, generate_cache

LLAMA_METHODS = ("llama.cpp", "llama.cpp-lookup", "llama.cpp-draft")  # -draft: the model rows' draft model's chain
MODEL_METHODS = ("model-chain", "model")  # a draft model's top-1 chain, and its MCSD tree (--draft model)
SELF_METHODS = ("self-chain", "self")  # the same with the target itself, layers skipped, as the draft (--draft self)
HEADS_OPTIONS = {"medusa": "--medusa-heads", "eagle": "--eagle-heads"}  # rows' own options (else --heads), any family's
BUILTIN_PROMPTS = Path(__file__).parent / "bench_prompts.jsonl"
LOOKUP_TOKENS = 10  # tokens proposed per prompt-lookup match, for hf-lookup and llama.cpp-lookup alike


def heads_row(architecture: str) -> str:
    """The row that runs heads of this architecture: its family's SPEC.bench_row, else its --draft name."""
    return family_spec(architecture).bench_row or by_architecture(architecture).draft


def heads_rows() -> list[str]:
    """The heads rows, one per name (EAGLE-1 and EAGLE-3 heads share eagle), in FAMILIES' order but the first family's
    last, then the default drafter's (--draft auto: its heads merged with n-gram lookup): medusa, eagle, clover,
    clover+ngram."""
    first = heads_row(families.FAMILIES[0].architecture)
    return [*dict.fromkeys([heads_row(f.architecture) for f in families.FAMILIES[1:]] + [first]), first + "+ngram"]


def row_heads(method: str) -> str:
    """The heads row whose heads `method` runs (clover+ngram: clover's; a heads row: its own)."""
    return method.removesuffix("+ngram") if method == heads_rows()[-1] else method


def all_methods() -> tuple[str, ...]:
    return ("hf", "hf-lookup", "hf-assisted", "plain", "ngram", *heads_rows(), *MODEL_METHODS, *LLAMA_METHODS,
            *SELF_METHODS)


@dataclass
class BenchConfig:
    model: str | None = None
    prompts: str | None = None
    methods: str | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0  # with a temperature: nucleus sampling in every row (hf's too)
    repetition_penalty: float = 1.0  # every row, hf's too (transformers' repetition_penalty); llama.cpp's: none
    repeats: int = 1
    limit: int | None = None
    heads: str | None = None
    medusa_heads: str | None = None
    eagle_heads: str | None = None
    assistant: str | None = None
    draft_model: str | None = None  # the model rows' draft model, and hf-assisted's assistant unless --assistant
    tree_budget: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    quantize: str | None = None  # --quantize int8 | int4 (CPU)
    load_in_8bit: bool = False
    json_out: bool = False
    plot: Path | None = None
    compile: str | None = None  # auto/on: clover's rows run the compiled step (built first if needed); off: eager
    threads: int | None = None  # every row's CPU threads, llama.cpp's too (None: torch's default)


@dataclass
class Row:
    method: str
    runs: int = 0
    new_tokens: int = 0
    decode_s: float = 0.0
    total_s: float = 0.0
    steps: int = 0
    depth_hits: list = field(default_factory=list)
    depth_tries: list = field(default_factory=list)
    outputs: dict = field(default_factory=dict)  # prompt index -> token ids (first repeat)

    @property
    def tokens_per_s(self) -> float:
        return (self.new_tokens - self.runs) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tokens_per_s_e2e(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def tau(self) -> float | None:
        return (self.new_tokens - self.runs) / self.steps if self.steps else None

    def add(self, new: list[int], decode_s: float, total_s: float, stats) -> None:
        """One generation's figures (stats: its stats.Stats, None for methods outside clover's engine)."""
        self.new_tokens += len(new)
        self.runs += 1
        self.decode_s += decode_s
        self.total_s += total_s
        if stats is not None:
            self.steps += stats.steps
            for d, (h, t) in enumerate(zip(stats.depth_hits, stats.depth_tries)):
                while len(self.depth_hits) <= d:
                    self.depth_hits.append(0)
                    self.depth_tries.append(0)
                self.depth_hits[d] += h
                self.depth_tries[d] += t


def _prompt_text(obj) -> str | None:
    """A JSONL line's prompt: {"prompt": ...}, or Spec-Bench's / MT-Bench's question.jsonl layout
    ({"question_id", "category", "turns": [...]}: its first turn; later turns would need the model's replies)."""
    if not isinstance(obj, dict):
        return None
    text = obj.get("prompt")
    if text is None and isinstance(obj.get("turns"), list) and obj["turns"]:
        text = obj["turns"][0]
    return text if isinstance(text, str) and text.strip() else None


def load_prompts(spec: str | None, limit: int | None) -> list[dict]:
    """[{'id', 'category', 'messages'}] from a directory of .txt files, a JSONL file (a 'prompt' per line, or
    Spec-Bench's question.jsonl), or the built-in set."""
    rows = []
    if spec is None:
        rows = [json.loads(line) for line in BUILTIN_PROMPTS.read_text().split("\n") if line.strip()]
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            files = sorted(path.glob("*.txt"))
            if not files:
                raise CloverError(f"--prompts {spec}: no .txt files in the directory")
            for f in files:
                text = f.read_text(encoding="utf-8", errors="replace").strip()
                if text:
                    rows.append({"id": f.stem, "category": "file", "messages": [{"role": "user", "content": text}]})
        elif path.is_file():
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise CloverError(f"--prompts {spec}: not UTF-8 text (byte {e.start})") from None
            except OSError as e:
                raise CloverError(f"--prompts {spec}: cannot read it ({e.strerror or e})") from None
            for n, line in enumerate(text.split("\n"), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise CloverError(f"--prompts {spec}:{n}: malformed JSON ({e.msg})")
                text = _prompt_text(obj)
                if text is None:
                    raise CloverError(f"--prompts {spec}:{n}: each line needs a non-empty 'prompt' string (or "
                                      f"Spec-Bench's 'turns' list)")
                rows.append({"id": str(obj.get("id", obj.get("question_id", n))),
                             "category": str(obj.get("category", "file")),
                             "messages": [{"role": "user", "content": text}]})
        else:
            raise CloverError(f"--prompts {spec}: no such file or directory")
    if not rows:
        raise CloverError(f"--prompts {spec}: no prompts in it" if spec else "no prompts to run")
    return rows[:limit] if limit else rows


def choose_methods(spec: str | None, session, cfg: BenchConfig) -> list[str]:
    if spec:
        methods = [m.strip() for m in spec.split(",") if m.strip()]
        unknown = [m for m in methods if m not in all_methods()]
        if unknown:
            raise CloverError(f"unknown method {unknown[0]!r}; choose from {', '.join(all_methods())}")
        if "hf-assisted" in methods and session.assistant is None:
            raise CloverError("hf-assisted needs --assistant MODEL (or --draft-model)")
        if any(m in MODEL_METHODS for m in methods) and session.draft_model is None:
            raise CloverError("the model rows need a draft model: pass --draft-model")
        asked = {row_heads(m) for m in methods}
        for family in families.FAMILIES:
            row = heads_row(family.architecture)
            if row in asked and row not in session.heads:
                raise CloverError(f"the {row} method needs {family.name} heads: pass "
                                  f"{HEADS_OPTIONS.get(row, '--heads')}")
        if cfg.temperature > 0 and any(m.startswith("hf-") or m in LLAMA_METHODS for m in methods):
            raise CloverError("hf-lookup, hf-assisted and llama.cpp run greedy only; use --temperature 0")
        if cfg.repetition_penalty != 1.0 and any(m in LLAMA_METHODS for m in methods):
            raise CloverError("the llama.cpp rows run without a repetition penalty (llama.cpp's counts only the last "
                              "tokens); leave out --repetition-penalty")
        peers = [m for m in methods if m in LLAMA_METHODS]
        why = session.llama_unavailable() if peers else None
        if why:
            raise CloverError(f"{peers[0]} cannot run: {why}")
        if "llama.cpp-draft" in methods and (why := session.llama_unavailable(draft=True)):
            raise CloverError(f"llama.cpp-draft cannot run: {why}")
        return methods
    methods = ["hf", "hf-lookup"]
    if session.assistant is not None:
        methods.append("hf-assisted")
    methods += ["plain", "ngram"]
    if session.draft_model is not None:
        methods += list(MODEL_METHODS)
    for row in heads_rows():  # the heads alone; clover+ngram: the default drafter (clover's heads + lookup)
        if row_heads(row) in session.heads:
            methods.append(row)
    if cfg.temperature > 0:
        methods = [m for m in methods if not m.startswith("hf-")]
    elif cfg.repetition_penalty != 1.0:
        print("clover bench: no llama.cpp rows with a repetition penalty (llama.cpp's counts only the last tokens)",
              file=sys.stderr)
    elif why := session.llama_unavailable():
        print(f"clover bench: no llama.cpp rows: {why}", file=sys.stderr)
    else:
        methods += ["llama.cpp", "llama.cpp-lookup"]
        if session.draft_model is not None:
            if why := session.llama_unavailable(draft=True):
                print(f"clover bench: no llama.cpp-draft row: {why}", file=sys.stderr)
            else:
                methods.append("llama.cpp-draft")
    return methods


class _Timestamps:
    """A transformers streamer that notes when the first generated token arrives (prefill done)."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self):
        pass


class BenchSession:
    """One loaded target with what every method needs."""

    def __init__(self, cfg: BenchConfig):
        from .options import compile_mode
        from .drafters.registry import load as load_heads, resolve_heads
        from .session import Options, Session

        compiled = "off" if compile_mode(cfg.compile) == "off" else "on"  # a benchmark waits for the build
        self.session = Session(Options(model=cfg.model, heads=cfg.heads, draft="none", device=cfg.device,
                                       threads=cfg.threads, quantize=cfg.quantize,
                                       dtype=cfg.dtype, load_in_8bit=cfg.load_in_8bit, tree_budget=cfg.tree_budget,
                                       compile=compiled), quiet=cfg.json_out)
        s = self.session
        s.compiler.start(background=False)
        heads_path = resolve_heads(cfg.heads, s.resolved, quiet=True)
        self.heads = {}  # heads row -> (heads, their directory): each heads directory given runs in its family's row
        for path in filter(None, [heads_path, cfg.medusa_heads, cfg.eagle_heads]):
            heads = load_heads(Path(path), s.model)
            self.heads[heads_row(heads.cfg.architecture)] = heads, str(path)
        self.draft_model = self.draft_model_path = None
        wanted = [m.strip() for m in (cfg.methods or "").split(",")]
        assistant_path = None
        if cfg.draft_model or any(m in (*MODEL_METHODS, "llama.cpp-draft") for m in wanted):
            from .drafters.draft_model import load_draft_model, resolve_draft_model

            name, path = resolve_draft_model(cfg.draft_model, s.resolved, quiet=cfg.json_out)
            self.draft_model = load_draft_model(name, path, s.resolved.name, s.model, s.tokenizer)
            self.draft_model_name, assistant_path = name, path  # hf-assisted's assistant: the same draft model
            self.draft_model_path = path
        self.assistant = None
        if cfg.assistant or (assistant_path is not None and (not cfg.methods or "hf-assisted" in wanted)):
            from .hub import resolve_model
            from .loading import load

            if cfg.assistant:
                assistant_path = resolve_model(cfg.assistant, quiet=cfg.json_out).path
            # its own copy: transformers runs it with its own attention, clover's rows with clover's
            self.assistant = load(assistant_path, device=str(s.device),
                                  dtype=str(s.dtype).replace("torch.", "")).model
            self.assistant.set_attn_implementation("sdpa")
        from types import SimpleNamespace

        from .running import register

        # in `clover ps`, and what it runs safe from `clover rm` while it runs
        register("bench", SimpleNamespace(resolved=s.resolved, heads_path=heads_path,
                                          draft_model_path=self.draft_model_path), None, None)
        from .decode.budget import mode_key, mode_parts
        from .session import parse_budget

        self.budget, self.auto = parse_budget(cfg.tree_budget)
        self.engines = {}
        self.choices = {}  # method -> (ChoiceStats of its merged drafters, the file it is kept in)
        # the learned choice is kept per sampling mode (temperature and penalty), as a session keeps it
        self.temperature, self.repetition_penalty = mode_parts(mode_key(cfg.temperature, cfg.repetition_penalty))
        self.quiet = cfg.json_out
        self.llama_runners, self.llama_ctx, self.llama_gguf, self.llama_draft_gguf = {}, s.max_context, None, None
        self.llama_threads = torch.get_num_threads()

    def llama_unavailable(self, draft: bool = False) -> str | None:
        """Why the llama.cpp rows cannot run (with `draft`: the llama.cpp-draft row too), or None."""
        from .llamacpp import unsupported_model, why_unavailable

        s = self.session
        why = why_unavailable(s.model, s.tokenizer, s.device, s.dtype, s.load_in_8bit, s.weights)
        if why is None and draft and (why := unsupported_model(self.draft_model.config)):
            why = f"the draft model: {why}"
        return why

    def llama(self, method: str):
        """The llama.cpp runner of a method, made on first use (the GGUF is written once per model, then cached)."""
        if method not in self.llama_runners:
            from .llamacpp import LlamaCppRunner, gguf_for
            from .stats import cache_dir

            s = self.session
            if self.llama_gguf is None:
                self.llama_gguf = gguf_for(s.resolved, s.model, s.tokenizer, cache_dir(), quiet=self.quiet)
            drafting = {}
            if method == "llama.cpp-lookup":
                drafting = {"lookup_tokens": LOOKUP_TOKENS}
            elif method == "llama.cpp-draft":
                from dataclasses import replace

                from .drafters.draft_model import MAX_DEPTH  # as deep as model-chain's chain

                source = replace(s.resolved, name=self.draft_model_name, path=Path(self.draft_model_path),
                                 repo=None, revision=None)
                self.llama_draft_gguf = gguf_for(source, self.draft_model, s.tokenizer, cache_dir(), quiet=self.quiet)
                drafting = {"draft_gguf": self.llama_draft_gguf, "draft_tokens": MAX_DEPTH}
            self.llama_runners[method] = LlamaCppRunner(self.llama_gguf, self.llama_ctx, self.llama_threads,
                                                        **drafting)
        return self.llama_runners[method]

    def engine(self, method: str):
        """A fresh drafter every run; the engine (and its measured cost model) is kept per method."""
        from .decode.engine import Engine
        from .drafters.factory import make_drafter
        from .drafters.merged import ChoiceStats

        s = self.session
        heads, heads_path = self.heads.get(row_heads(method), (None, None))
        if method in MODEL_METHODS:
            drafter = make_drafter("model", s.target, draft_model=self.draft_model, static=method == "model-chain")
            s.compiler.ready_draft(drafter, self.draft_model_path)  # the draft's own compiled step
        elif method in SELF_METHODS:  # calibrated in the first (untimed warm-up) run, or read from the cache
            from .store import self_draft_path

            log = None if self.quiet else (lambda text: print(f"clover bench: {text}", file=sys.stderr))
            drafter = make_drafter("self", s.target, static=method == "self-chain", log=log,
                                   self_cache=self_draft_path(s.resolved.path, s.device, s.dtype))
        elif method == heads_rows()[-1]:  # clover+ngram
            # exactly what --draft auto runs; what it learns about when the heads pay carries over between runs,
            # as in a chat session, and starts from what earlier processes stored, as a session's does
            first = method not in self.choices
            choices = ChoiceStats() if first else self.choices[method][0]
            drafter = make_drafter("auto", s.target, heads=heads, prior=s.ngram_prior, choices=choices)
            if first:  # kept apart for heads run as 8-bit integers, as the session keeps them (drafter.primary.int8)
                self.choices[method] = choices, s.engine.policy.cost_store.choices_path(
                    heads_path, self.repetition_penalty, self.temperature, drafter.primary.int8)
                s.engine.policy.cost_store.load_choices(*self.choices[method])
        else:  # plain, ngram, and the heads alone: medusa, eagle (eager: EAGLE heads have no compiled programs), clover
            drafter = make_drafter({"plain": "none"}.get(method, method), s.target, heads=heads,
                                   prior=s.ngram_prior if method == "ngram" else None)
        if heads is not None:  # the heads' compiled programs, when the step is and the family has them
            s.compiler.ready_heads(drafter.primary, heads_path)
        if method not in self.engines:
            self.engines[method] = Engine(s.target, drafter, budget=self.budget, auto_budget=self.auto,
                                          cost_store=s.engine.policy.cost_store)
        eng = self.engines[method]
        eng.drafter = drafter
        eng.reset()
        return eng

    def run(self, method: str, ids: list[int], cfg: BenchConfig, seed: int):
        """(token ids, decode seconds, total seconds, stats.Stats or None)."""
        from .decode.verify import Sampling, StopCheck
        from .stats import Stats

        s = self.session
        n = min(cfg.max_new_tokens, s.max_context - len(ids))
        if method in LLAMA_METHODS:
            new, decode_s, total_s = self.llama(method).generate(ids, n, s.eos_ids)
            return new, decode_s, total_s, None
        if method.startswith("hf"):
            model = s.model
            # transformers' own attention, except for a model whose activations are rounded to int8: with it, the
            # attention that runs is clover's (rows independent of the batch), and float32 noise would change tokens
            stock = not getattr(model, EXACT_ROWS, False)
            if stock:
                model.set_attn_implementation("sdpa")
            kwargs = dict(max_new_tokens=n, eos_token_id=sorted(s.eos_ids) or None,
                          pad_token_id=s.tokenizer.pad_token_id or (sorted(s.eos_ids) or [0])[0],
                          **generate_cache(model))  # a float16 KV cache where clover's is
            if cfg.temperature > 0:
                kwargs.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=0)
                torch.manual_seed(seed)
            else:
                kwargs.update(do_sample=False)
            if cfg.repetition_penalty != 1.0:
                kwargs["repetition_penalty"] = cfg.repetition_penalty
            if method == "hf-lookup":
                kwargs["prompt_lookup_num_tokens"] = LOOKUP_TOKENS
            if method == "hf-assisted":
                kwargs["assistant_model"] = self.assistant
            x = torch.tensor([ids], device=s.device)
            stamps = _Timestamps()
            try:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    out = model.generate(x, attention_mask=torch.ones_like(x), streamer=stamps, **kwargs)
                _sync(s.device)
                t1 = time.perf_counter()
            finally:
                if stock:
                    model.set_attn_implementation("clover_tree")
            new = out[0, len(ids):].tolist()
            return new, t1 - (stamps.first or t0), t1 - t0, None
        eng = self.engine(method)
        stats = Stats()
        new = []
        t0 = time.perf_counter()
        stop = StopCheck(n, s.eos_ids)
        for ev in eng.generate(ids, stop, Sampling(cfg.temperature, cfg.top_p, seed, cfg.repetition_penalty)):
            stats.add(ev)
            new += ev.tokens
        t1 = time.perf_counter()
        if method in self.choices:
            s.engine.policy.cost_store.save_choices(*self.choices[method])
        return new, stats.decode_s, t1 - t0, stats


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_bench(cfg: BenchConfig):
    if not 1 <= cfg.max_new_tokens <= 100_000:
        raise CloverError(f"--max-new-tokens must be between 1 and 100000, not {cfg.max_new_tokens}")
    if not (math.isfinite(cfg.temperature) and 0 <= cfg.temperature <= 10):
        raise CloverError(f"--temperature must be between 0 and 10, not {cfg.temperature}")
    if not (math.isfinite(cfg.repetition_penalty) and 0 < cfg.repetition_penalty <= 10):
        raise CloverError(f"--repetition-penalty must be above 0 and at most 10, not {cfg.repetition_penalty}")
    if not (math.isfinite(cfg.top_p) and 0.0 < cfg.top_p <= 1.0):
        raise CloverError(f"--top-p must be in (0, 1], not {cfg.top_p}")
    if not 1 <= cfg.repeats <= 100:
        raise CloverError(f"--repeats must be between 1 and 100, not {cfg.repeats}")
    if cfg.limit is not None and cfg.limit < 1:
        raise CloverError(f"--limit must be at least 1, not {cfg.limit}")
    if cfg.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CloverError("--plot needs matplotlib: pip install 'clover-cli[plot]'")
        plot_format(cfg.plot)  # before the runs, not after them
        try:
            atomic.check_replace(cfg.plot)  # a FIFO, a device or a symbolic link is not replaced by the plot
        except OSError as e:
            raise CloverError(f"cannot write the plot {cfg.plot}: {e.strerror or e}")
    prompts = load_prompts(cfg.prompts, cfg.limit)
    bs = BenchSession(cfg)
    methods = choose_methods(cfg.methods, bs, cfg)
    s = bs.session
    encoded = []
    for p in prompts:
        ids = s.encode_chat(p["messages"])
        if len(ids) >= s.max_context - 1:
            raise CloverError(f"prompt {p['id']} is {len(ids)} tokens, longer than the model's context")
        encoded.append(ids)
    # llama.cpp sizes its context (and its KV cache) up front: room for the longest prompt, reply and draft
    bs.llama_ctx = min(s.max_context, max(map(len, encoded)) + cfg.max_new_tokens + LOOKUP_TOKENS + 1)

    rows = {m: Row(m) for m in methods}
    by_category = {m: {} for m in methods}  # method -> category -> Row
    progress = _progress(cfg, len(prompts) * cfg.repeats * len(methods) + len(methods))
    with torch.inference_mode():
        for m in methods:  # warm-up: first-call costs (and the engine's cost measurement) stay out of the timings
            bs.run(m, encoded[0][:64], BenchConfig(max_new_tokens=8, temperature=cfg.temperature, top_p=cfg.top_p,
                                                   repetition_penalty=cfg.repetition_penalty), seed=0)
            progress.advance(f"warm-up {m}")
        for r in range(cfg.repeats):
            for i, ids in enumerate(encoded):
                # each method runs in each place of the order, and right after each other method, as often as the
                # others: the first run after a prompt switch measured a few percent slower, and so did a run right
                # after one that drafted with the heads at every step (docs/BENCHMARKS.md, 2026-11-25 afternoon
                # and 2026-11-27); a rotation kept every method's predecessor the same
                for m in (methods[j] for j in balanced_order(len(methods), r * len(encoded) + i)):
                    new, decode_s, total_s, stats = bs.run(m, ids, cfg, seed=1000 * r + i)
                    category = by_category[m].setdefault(prompts[i]["category"], Row(m))
                    for row in (rows[m], category):
                        row.add(new, decode_s, total_s, stats)
                        if r == 0:
                            row.outputs[i] = new
                    progress.advance(f"{m} · prompt {i + 1}/{len(encoded)}")
    progress.close()
    report = make_report(cfg, bs, methods, rows, prompts)
    report["by_category"] = {
        cat: {m: {"tokens_per_s": round(by_category[m][cat].tokens_per_s, 2),
                  "tau": None if by_category[m][cat].tau is None else round(by_category[m][cat].tau, 3),
                  "prompts": len(by_category[m][cat].outputs)} for m in methods}
        for cat in dict.fromkeys(p["category"] for p in prompts)}
    if cfg.json_out:
        sys.stdout.write(json.dumps(report, ensure_ascii=False) + "\n")
    else:
        print_table(report)
    if cfg.plot is not None:
        plot(report, cfg.plot)
    return report


def balanced_order(n: int, k: int) -> list[int]:
    """The k-th order of n methods in a Williams design: over any n consecutive k (2n when n is odd), each method
    runs in each place equally often, and right after each other method equally often."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    k %= n if n % 2 == 0 else 2 * n
    row = [(x + k) % n for x in first]
    return row if k < n else row[::-1]


def make_report(cfg, bs, methods, rows, prompts) -> dict:
    s = bs.session
    hf, plain = rows.get("hf"), rows.get("plain")
    greedy = cfg.temperature == 0
    out = []
    for m in methods:
        row = rows[m]
        mismatches, unlike_plain = [], []
        if greedy and hf is not None and m != "hf":
            mismatches = [prompts[i]["id"] for i in row.outputs if row.outputs[i] != hf.outputs.get(i)]
        # the speculative promise itself: the same tokens as clover's own plain decoding on the same step
        speculative = m not in ("hf", "plain") and m not in LLAMA_METHODS and not m.startswith("hf")
        if greedy and plain is not None and speculative:
            unlike_plain = [prompts[i]["id"] for i in row.outputs if row.outputs[i] != plain.outputs.get(i)]
        out.append({
            "method": m,
            "tokens_per_s": round(row.tokens_per_s, 2),
            "tokens_per_s_e2e": round(row.tokens_per_s_e2e, 2),
            "tau": None if row.tau is None else round(row.tau, 3),
            "accept_by_depth": [round(h / t, 3) if t else 0.0 for h, t in zip(row.depth_hits, row.depth_tries)],
            "speedup_vs_hf": round(row.tokens_per_s / hf.tokens_per_s, 3) if hf and hf.tokens_per_s else None,
            "speedup_vs_plain": (round(row.tokens_per_s / plain.tokens_per_s, 3)
                                 if plain and plain.tokens_per_s else None),
            "identical": (not mismatches) if (greedy and hf is not None) else None,
            "mismatches": mismatches,
            "same_as_plain": (not unlike_plain) if (greedy and plain is not None and speculative) else None,
            "unlike_plain": unlike_plain,
            "new_tokens": row.new_tokens,
        })
    report = {
        "model": s.resolved.name, "device": str(s.device), "dtype": str(s.dtype).replace("torch.", ""),
        "weights": s.weights_text,
        "prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
        "top_p": cfg.top_p, "repetition_penalty": cfg.repetition_penalty,
        "repeats": cfg.repeats, "tree_budget": cfg.tree_budget, "compiled": s.compiler.active,
        "step": s.compiler.describe(),
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads".strip(),
        "torch": torch.__version__, "date": date.today().isoformat(), "methods": out,
    }
    if bs.draft_model is not None:
        from .drafters.draft_model import parameter_count

        report["draft_model"] = {"name": bs.draft_model_name, "parameters": parameter_count(bs.draft_model)}
    if any(m in SELF_METHODS for m in methods):  # the self rows' skipped layers, as calibrated (and cached)
        from .drafters.self_draft import layer_count, load_choice
        from .store import self_draft_path

        report["self_draft"] = load_choice(self_draft_path(s.resolved.path, s.device, s.dtype), layer_count(s.model))
    if any(m in LLAMA_METHODS for m in methods):
        import llama_cpp

        report["llama_cpp"] = {"version": llama_cpp.__version__, "threads": bs.llama_threads, "weights": "float32",
                               "kv_cache": "float32", "lookup_tokens": LOOKUP_TOKENS, "gguf": str(bs.llama_gguf)}
        if "llama.cpp-draft" in methods:
            from .drafters.draft_model import MAX_DEPTH

            report["llama_cpp"].update(draft_tokens=MAX_DEPTH, draft_gguf=str(bs.llama_draft_gguf))
    return report


class _progress:
    def __init__(self, cfg, total):
        self.bar = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.bar = Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.description}"), console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task("", total=total)
            self.bar.start()

    def advance(self, what: str):
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=what)

    def close(self):
        if self.bar is not None:
            self.bar.stop()
