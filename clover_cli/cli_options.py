"""The options the `clover` commands share (Common, MODEL_ARG) and their shell completion (choices), apart from the
commands themselves (cli.py)."""

from __future__ import annotations

import typer

from .drafter_names import DRAFTS
from .options import EARLY_STOPS, MODES, QUANTIZE, TREES
from .templates import BUILTIN

MODEL_ARG = typer.Argument(None, help="Alias (see `clover models`), Hub repo id, local directory, GGUF file, or a "
                                       "GGUF on the Hub as REPO:FILE.gguf or REPO:QUANT (hf.co/ prefix allowed). "
                                       "Default: smollm2 (CLOVER_MODEL overrides it).", show_default=False)


def choices(*values: str):
    """Shell completion for an option whose values are checked by options.py (with its own one-line errors)."""
    return lambda incomplete: [v for v in values if v.startswith(incomplete)]


# Options shared by the commands that load a model.
class Common:
    revision = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit) of the model.")
    heads = typer.Option(None, "--heads", help="Draft heads: a local directory or a Hub repo id.")
    draft = typer.Option("auto", "--draft", help=f"Drafter: {', '.join(DRAFTS[:-1])} "
                                                 f"or {DRAFTS[-1]}. auto = the model's heads merged with n-gram lookup when "
                                                 "it has heads, else ngram. model = a smaller draft model "
                                                 "(--draft-model) drafting a multi-candidate (MCSD) tree. self = the "
                                                 "model itself with some middle layers skipped (chosen on the first "
                                                 "prompt, cached).",
                        autocompletion=choices(*DRAFTS))
    draft_model = typer.Option(None, "--draft-model", help="The draft model of --draft model: an alias, a local "
                               "directory, a GGUF file or a Hub repo id, with the target's tokenizer and fewer "
                               "parameters (default: the one the model's alias names).", show_default=False)
    tree = typer.Option("dynamic", "--tree", help="Draft tree of the heads: dynamic (grown by probability) "
                        "or static (a fixed shape of 24 nodes, cut to --tree-budget when given); with --draft model "
                        "or self, dynamic = the MCSD tree, static = the draft's plain top-1 chain. With --draft auto "
                        "the n-gram matches are merged in either way.",
                        autocompletion=choices(*TREES))
    early_stop = typer.Option("fixed", "--early-stop", help="Where a branch of --draft model's or self's tree "
                              "ends, greedy: fixed = where the draft gives its next token under 0.3; learned = where "
                              "a logistic model of acceptance, fitted as the session runs (and for --draft model kept "
                              "on disk for the next run), gives it under 0.3. Sampled candidates (a temperature) "
                              "always end by the fixed rule.",
                        autocompletion=choices(*EARLY_STOPS))
    tree_budget = typer.Option("auto", "--tree-budget", help="Most draft nodes verified per step, or auto: "
                                                             "sized each step from the measured cost on this device.")
    load_in_8bit = typer.Option(False, "--load-in-8bit", help="Load the target in 8 bits (bitsandbytes).")
    load_in_4bit = typer.Option(False, "--load-in-4bit", help="Load the target in 4 bits (NF4, bitsandbytes).")
    device = typer.Option("auto", "--device", autocompletion=choices("auto", "cpu", "cuda"),
                          help="auto, cpu, cuda or cuda:N.")
    device_map = typer.Option(None, "--device-map", help="Spread the target's layers with accelerate: auto (GPUs, "
                              "then CPU, then disk), balanced (evenly over the GPUs), or a JSON object or file "
                              "mapping module names to a GPU index, cpu or disk. Runs eager.", show_default=False)
    max_memory = typer.Option(None, "--max-memory", help="With --device-map: most memory per device, e.g. "
                              "0=20GiB,cpu=64GiB (or a JSON object); the rest goes to disk.", show_default=False)
    dtype = typer.Option("auto", "--dtype", autocompletion=choices("auto", "float32", "float16", "bfloat16"),
                         help="auto (bf16/fp16 on GPU; on CPU a GGUF's own quantized blocks, else fp32), float32, "
                         "float16, bfloat16 (a GGUF dequantized to it).")
    quantize = typer.Option(None, "--quantize", autocompletion=choices(*QUANTIZE), help="CPU: run the linears "
                            "quantized in groups of 32, int8 or int4 (the output embedding int8), on clover's own "
                            "kernels; the activations are quantized to int8 as llama.cpp does.", show_default=False)
    trust_remote_code = typer.Option(False, "--trust-remote-code", help="Run model code from its repository.")
    allow_pickle = typer.Option(False, "--allow-pickle", help="Allow pickled .bin weights (unsafe from strangers).")
    max_new_tokens = typer.Option(256, "--max-new-tokens", "-n", help="Most tokens to generate.")
    temperature = typer.Option(0.0, "--temperature", "--temp", help="0 = greedy; above 0 samples.")
    top_p = typer.Option(1.0, "--top-p", help="Nucleus sampling mass, in (0, 1].")
    top_k = typer.Option(0, "--top-k", help="Sample only from the k most likely tokens (0 = all).")
    min_p = typer.Option(0.0, "--min-p", help="Sample only tokens at least this share as likely as the most likely "
                                              "one, in [0, 1) (0 = all).")
    threads = typer.Option(None, "--threads", "-t", help="CPU threads for the model's arithmetic (torch's intra-op "
                           "threads; default: torch's own, one per core).", show_default=False)
    chat_template = typer.Option(None, "--chat-template", help="The chat template: vicuna_v1.1, llama3, chatml or a "
                                 "Jinja file (default: the model's own, else its alias's, else vicuna_v1.1).",
                                 autocompletion=choices(*BUILTIN), show_default=False)
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
                        autocompletion=choices(*MODES))
