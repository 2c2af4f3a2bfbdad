"""Everything between a command line and the engine: model, tokenizer, template, drafter, stop rules."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from .cores import Threads
from .decode.budget import mode_key, mode_parts
from .decode.engine import Engine
from .decode.verify import Sampling, StopCheck
from .drafters.factory import make_drafter
from .drafters.ngram import load_prior
from .drafters.registry import resolve_heads
from .errors import CloverError
from .families import heads_drafts
from .hub import looks_like_repo, resolve_model
from .loading import keep_loaded, load, pick_device
from .options import Options, check_draft, check_options, compile_mode, parse_budget  # noqa: F401 - importable here too
from .packed import finish_packing
from .quantized import apply, load_dtype, weights_for
from .step.costs import StepCosts
from .step.manager import StepCompiler
from .target import EXACT_ROWS, Target, check_exact
from .templates import STOP_STRINGS, chat_template, render


class Session:
    def __init__(self, opts: Options, quiet: bool = False):
        check_options(opts)
        budget, auto = parse_budget(opts.tree_budget)
        if opts.tree == "static" and opts.draft not in ("model", "self"):  # a draft model's static tree: its chain
            from .drafters.common import STATIC_TREE

            # the fixed shape, cut to --tree-budget when one is given (auto sizing would reshape it)
            budget, auto = (len(STATIC_TREE) if auto else min(budget, len(STATIC_TREE))), False
        self.opts = opts
        self.quiet = quiet
        self.threads = Threads(opts.threads)  # --threads, or one per core other programs leave free (cores.py)
        self.resolved = resolve_model(opts.model, opts.revision, opts.allow_pickle, quiet=quiet, dtype=opts.dtype)
        self.heads_path = None
        if opts.draft == "auto" or opts.draft in heads_drafts():
            self.heads_path = resolve_heads(opts.heads, self.resolved, quiet=quiet, draft=opts.draft)
        self.draft_model = self.draft_model_name = None  # --draft model's model, loaded once
        self.draft_model_path = None
        if opts.draft == "model":  # found (or fetched) before the target loads: a bad name fails fast
            from .drafters.draft_model import resolve_draft_model

            self.draft_model_name, self.draft_model_path = resolve_draft_model(opts.draft_model, self.resolved, quiet)
        weights = weights_for(opts.quantize, opts.dtype, pick_device(opts.device), self.resolved.path)
        loaded = load(self.resolved.path, opts.device, load_dtype(weights, opts.dtype), opts.load_in_8bit,
                      opts.trust_remote_code, opts.allow_pickle, opts.load_in_4bit, opts.device_map, opts.max_memory)
        self.model, self.tokenizer, self.offload = loaded.model, loaded.tokenizer, loaded.offload
        self.device, self.dtype, self.load_in_8bit = loaded.device, loaded.dtype, loaded.load_in_8bit
        self.load_in_4bit = loaded.load_in_4bit
        self.weights = weights
        self.weights_note = apply(self.model, self.resolved.path, self.weights, warn=self._warn)
        if self.weights_note is None:  # float weights, or no kernels to run quantized ones here (said)
            self.weights = "float"
        spec = self.resolved.spec
        self.template_name, self.template = chat_template(self.tokenizer, spec.template if spec else None,
                                                          opts.chat_template)
        self.template_notice = None  # said where the template is used (chat, generate without --raw)
        if self.template_name != "tokenizer" and not (spec and spec.template) and not opts.chat_template:
            self.template_notice = (f"{self.resolved.name} has no chat template of its own: using the "
                                    f"{self.template_name} template")
        self._check_template_tokens()
        # its linears packed for the eager step only if one is going to run (_pack_if_eager): with the compiled step
        # active from the start, packing (0.5-2 s of loading) would buy nothing
        self.target = Target(self.model, max_context=opts.max_context, pack="lazy")
        check_exact(self.target)  # a model clover would not run exactly is refused here, in one line
        self.compiler = StepCompiler(compile_mode(opts.compile), self.target, self.resolved.path, self.dtype,
                                     self.device, self.load_in_8bit, opts.trust_remote_code, opts.allow_pickle,
                                     warn=self._warn, weights=self.weights)
        self.drafter = self._drafter(opts)
        self._choices_from = None  # (the ChoiceStats, the file) the default drafter's choice was last restored from
        self.engine = Engine(self.target, self.drafter, budget=budget, auto_budget=auto,
                             cost_store=StepCosts(self.resolved.path, self.device, self.dtype, self.compiler))
        self.compiler.listeners.append(self.engine.policy.use_verify_costs)
        self.compiler.use_drafter(self.drafter, self.heads_path, self._draft_path())
        self._pack_if_eager()
        self.eos_ids = self._eos_ids()
        # the tokenizer's own template has no known stop strings; an alias names the template it follows
        self.stop_strings = STOP_STRINGS.get(self.template_name) or STOP_STRINGS.get(spec.template if spec else "", [])
        keep_loaded()  # what was loaded lives as long as the session: out of the cyclic collector's passes
        self.threads.settle()  # what other programs did with the cores while this one loaded

    def _warn(self, text: str):
        if not self.quiet:
            print(f"clover: {text}", file=sys.stderr)

    @property
    def weights_text(self) -> str:
        """What the linears run on, in words: "float", or e.g. "gguf (Q4_1 x210, Q8_0 x1: 92 MiB of linear weights)"."""
        return self.weights + (f" ({self.weights_note})" if self.weights_note else "")

    @property
    def draft_name(self) -> str:
        return self.drafter.name

    @property
    def default_penalty(self) -> float:
        """The repetition penalty a reply gets unless one is asked for: its alias's (measured), else none."""
        spec = self.resolved.spec
        return spec.repetition_penalty if spec is not None else 1.0

    @property
    def max_context(self) -> int:
        return self.target.max_context

    @functools.cached_property
    def ngram_prior(self) -> dict | None:
        """Tri-gram counts of the model's own replies when its directory has them (the n-gram drafter's prior), read
        when a drafter first needs it: a damaged file stops only the drafters that use it (one line), not
        `--draft none` or the heads alone."""
        return load_prior(self.resolved.path, self.model.config.vocab_size)

    def _drafter(self, opts: Options):
        """The drafter --draft asks for, with what it runs on found or loaded here (drafters/factory.py makes it)."""
        made = functools.partial(make_drafter, opts.draft, self.target, static=opts.tree == "static")
        if opts.draft in ("none", "ngram"):
            return made(prior=self.ngram_prior if opts.draft == "ngram" else None)
        if opts.draft == "model":
            from .drafters.draft_model import load_draft_model, resolve_draft_model

            if self.draft_model_path is None:
                self.draft_model_name, self.draft_model_path = resolve_draft_model(opts.draft_model, self.resolved,
                                                                                   self.quiet)
            if self.draft_model is None:
                self.draft_model = load_draft_model(self.draft_model_name, self.draft_model_path, self.resolved.name,
                                                    self.model, self.tokenizer, opts.trust_remote_code)
            stop_file = None
            if opts.early_stop == "learned" and opts.tree != "static":
                from .store import early_stop_path

                stop_file = early_stop_path(self.resolved.path, self.draft_model_path, self.dtype)
            return made(draft_model=self.draft_model, learned_stop=stop_file is not None, stop_file=stop_file)
        if opts.draft == "self":  # the target with layers skipped (chosen on the first prompt, then cached on disk)
            from .store import self_draft_path

            return made(self_cache=self_draft_path(self.resolved.path, self.device, self.dtype),
                        log=None if self.quiet else self._warn, learned_stop=opts.early_stop == "learned")
        if self.heads_path is None:
            if opts.draft == "auto":
                return made(prior=self.ngram_prior)
            raise CloverError(f"no {opts.draft} heads for {self.resolved.name}: pass --heads DIR|REPO, "
                              f"or make them with `clover train`")
        if any(m.weight.device.type == "meta" for m in (self.model.get_input_embeddings(),
                                                        self.model.get_output_embeddings())):
            why = "draft heads use the model's embedding and lm_head, which --device-map offloaded"
            if opts.draft != "auto":
                raise CloverError(f"{why}: keep them on a device in the map, or use --draft ngram")
            self._warn(f"{why}: drafting by n-gram lookup only")
            return made(prior=self.ngram_prior)
        from .drafters import registry

        heads = registry.load(self.heads_path, self.model)
        made_for = heads_target_mismatch(heads.cfg.target.get("name_or_path"), self.resolved.repo)
        if made_for and not self.quiet:
            print(f"clover: warning: heads {self.heads_path} were trained for {made_for}, not {self.resolved.name}: "
                  f"the output stays exact, but fewer drafted tokens may be accepted", file=sys.stderr)
        arch = heads.cfg.architecture
        want = heads_drafts().get(opts.draft, arch)
        if arch != want:
            raise CloverError(f"--draft {opts.draft} needs {want} heads, but {self.heads_path} holds {arch} heads")
        return made(heads=heads, prior=self.ngram_prior if opts.draft == "auto" else None)

    def _draft_path(self):
        """The draft model's directory while --draft model is in use (its step is compiled too), else None."""
        return self.draft_model_path if self.opts.draft == "model" else None

    def switch_draft(self, name: str):
        """Use another drafter from now on (the next reply re-reads the conversation into it)."""
        from dataclasses import replace

        check_draft(name)
        opts = replace(self.opts, draft=name)
        if name == "auto" or name in heads_drafts():
            published = self.resolved.spec.heads_for(name) if self.resolved.spec and not opts.heads else None
            if self.heads_path is None or published not in (None, "bundled"):
                # an alias may publish heads of several drafters: /draft medusa takes its Medusa heads
                self.heads_path = resolve_heads(opts.heads, self.resolved, quiet=True, draft=name)
        self.drafter = self._drafter(opts)
        self.opts = opts
        self.engine.drafter = self.drafter
        self.engine.policy.forget_drafter()  # what the last drafter's calls were worth says nothing of this one's
        self.engine.reset()
        self.compiler.use_drafter(self.drafter, self.heads_path, self._draft_path())
        self._pack_if_eager()

    def _pack_if_eager(self) -> None:
        """Pack the target's linears now (at load, behind chat's prompt; not in a reply, nor in the forwards whose
        times size the trees) unless the compiled step runs every forward that uses them: not when it is inactive,
        when the context can outgrow its programs, or when heads run eager (those without a draft vocabulary
        project through the target's lm_head). --draft self packs them for its own layers."""
        heads = self.drafter.primary
        eager_heads = heads.heads is not None and heads.programs is None
        if not self.compiler.active or self.target.max_context > self.compiler.capacity or eager_heads:
            finish_packing(self.model)

    def _eos_ids(self) -> set[int]:
        ids = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(i) for i in source)
        for text in STOP_STRINGS.get(self.template_name, []):
            tid = self.tokenizer.convert_tokens_to_ids(text) if text in self.tokenizer.get_vocab() else None
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return ids

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        text = render(self.tokenizer, messages, self.template, add_generation_prompt=True, tools=tools)
        return self._checked(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_raw(self, text: str) -> list[int]:
        return self._checked(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def _checked(self, ids: list[int], what: str = "the prompt holds") -> list[int]:
        from .loading import check_token_ids

        return check_token_ids(ids, self.tokenizer, self.model.get_input_embeddings().weight.shape[0], what)

    def _check_template_tokens(self) -> None:
        """Refuse at load a chat template that writes a token the model has no embedding for (every conversation
        would hold it)."""
        try:
            text = render(self.tokenizer, [{"role": "user", "content": "Hello"}], self.template,
                          add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that wants more than one message: its own error comes later
            return
        self._checked(self.tokenizer(text, add_special_tokens=False)["input_ids"], "its chat template writes")

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def check_fits(self, prompt: list[int], max_new_tokens: int) -> int:
        """How many new tokens fit after `prompt`; a one-line error when the prompt leaves no room."""
        if len(prompt) >= self.max_context:
            raise CloverError(f"the prompt is {len(prompt)} tokens, longer than the model's context "
                              f"({self.max_context})")
        room = min(max_new_tokens, self.max_context - len(prompt))  # the engine shrinks trees near the end
        if room < 1:
            raise CloverError(f"the prompt is {len(prompt)} tokens: no room left in the model's context "
                              f"({self.max_context}) for a reply")
        return room

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling, stop_strings=None):
        """Yield StepEvents; the budget of new tokens is cut to what fits the context. `stop_strings`: what ends the
        reply besides EOS (default: the chat template's)."""
        room = self.check_fits(prompt, max_new_tokens)
        stop = StopCheck(room, self.eos_ids, self.stop_strings if stop_strings is None else stop_strings,
                         self.decode)
        if not self.compiler.building_beside() and self.threads.settle():
            self.engine.policy.cost_model = None  # the step costs of the new count: stored, or measured again
        # a compiled step built in the background comes in between two steps; with activations rounded to int8 only
        # between replies: the eager and the compiled step are each exact, but not the same bits as each other
        between_steps = not getattr(self.model, EXACT_ROWS, False)
        if not between_steps:
            self.compiler.poll()
        stored = self._stored_choices(sampling.temperature, sampling.repetition_penalty)
        try:
            for ev in self.engine.generate(prompt, stop, sampling):
                yield ev
                if between_steps:
                    self.compiler.poll()
        except torch.cuda.OutOfMemoryError:
            raise CloverError("out of GPU memory while generating; try a smaller --tree-budget, --load-in-8bit "
                              "or a shorter conversation")
        finally:
            if stored is not None:
                self.engine.policy.cost_store.save_choices(*stored)
            self.engine.drafter.save_learning()  # the learned early stop of --draft model
            self.threads.idle()

    def _stored_choices(self, temperature: float = 0.0, repetition_penalty: float = 1.0):
        """(the default drafter's learned choice, its file), restored from the store when the drafter is new or the
        step changed kind (the compiled one came in), so that a new process does not pay to learn it again: a
        one-shot reply is too short to (docs/BENCHMARKS.md); None for other drafters. One choice per temperature
        and repetition penalty, as the engine keeps its cost model: the heads pay far less often against a
        penalised or sampled target, and a sampled chat must not teach a greedy `clover generate` otherwise."""
        store = self.engine.policy.cost_store
        if self.drafter.choices is None or self.heads_path is None or store is None:
            return None
        mode = mode_key(temperature, repetition_penalty)  # the engine's key for its costs, curves and values too
        choices = self.drafter.choices_for(mode)
        temperature, repetition_penalty = mode_parts(mode)
        path = store.choices_path(self.heads_path, repetition_penalty, temperature,
                                  getattr(self.drafter.primary, "int8", False))
        if self._choices_from != (choices, path):  # ChoiceStats compares by identity
            store.load_choices(choices, path)
            self._choices_from = (choices, path)
        return choices, path


def heads_target_mismatch(made_for: str | None, repo: str | None) -> str | None:
    """The Hub repo the heads were trained for, when the model also comes from the Hub (`repo`) and it is another
    one (a local path says nothing: the same model lives under many)."""
    if (made_for and repo and looks_like_repo(made_for) and not Path(made_for).exists()
            and made_for.lower() != repo.lower()):
        return made_for
    return None
