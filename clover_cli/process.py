"""The `clover` process: its entry point (`main`), the error boundary every command runs inside (whatever escapes
it ends as one line on stderr and an exit code) and the fast exit that skips the interpreter's teardown."""

from __future__ import annotations

import os
import sys
import traceback

import click
import typer

from .errors import CloverError, one_line
from .options import env
from .render import visible

state = {"debug": False}  # --debug, the root command's option (cli.py), as parsed by _run


def _fail(message: str, code: int = 2):
    message = " ".join(line.strip() for line in str(message).splitlines() if line.strip()) or "failed"
    if state["debug"] or env("CLOVER_DEBUG", "") not in ("", "0"):
        traceback.print_exc()
    sys.stderr.write(f"clover: error: {visible(message)}\n")  # a path or a file's content in it stays inert
    sys.stderr.flush()
    raise SystemExit(code)


# Typer >= 0.20 vendors click (typer._click): its exceptions derive from typer.TyperException, not from click's.
_USAGE_ERRORS = (click.exceptions.ClickException, getattr(typer, "TyperException", click.exceptions.ClickException))
_ABORTS = (KeyboardInterrupt, EOFError, click.exceptions.Abort, getattr(typer, "Abort", click.exceptions.Abort))
_EXITS = (click.exceptions.Exit, getattr(typer, "Exit", click.exceptions.Exit))


def _usage_message(e) -> str:
    message = " ".join(e.format_message().split())
    ctx = getattr(e, "ctx", None)  # usage errors carry their command's context
    if ctx is not None:
        message += f" (see {ctx.command_path} --help)"
    return message


def _stdout_ok() -> bool:
    """Flush standard output; when it can no longer be written (its reader left, its device is full), point it at
    /dev/null so that what Python still holds for it is not tried again at exit ("Exception ignored ...")."""
    if sys.stdout is None:  # started with its standard output closed
        return False
    try:
        sys.stdout.flush()
        return True
    except (OSError, ValueError):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        return False


def _run(argv) -> int:
    """Parse and run one command. Click is called directly, not through typer's main: that one turns a closed
    output pipe into a silent exit 1 before any of this module's handling could run."""
    from .cli import app

    command = typer.main.get_command(app)
    complete = os.environ.get("_CLOVER_COMPLETE") if argv is None else None
    if complete:  # the shell asking for completions (clover --install-completion wires it up), in typer's format
        from typer.completion import completion_init, shell_complete

        completion_init()
        return shell_complete(command, {}, "clover", "_CLOVER_COMPLETE", complete)
    try:
        with command.make_context("clover", sys.argv[1:] if argv is None else list(argv)) as ctx:
            state["debug"] = bool(ctx.params.get("debug"))
            command.invoke(ctx)
        code = 0
    except _EXITS as e:  # --help, --version, typer.Exit(n)
        code = e.exit_code
    sys.stdout.flush()  # here, inside the error boundary, rather than at interpreter exit
    return code


def main(argv=None):
    """The `clover` command. Run as a program (argv None), the process ends as soon as the command has: see
    _leave. Called with argv (tests, scripts), it raises SystemExit as a program would exit."""
    if argv is None:  # SIGTERM and SIGHUP leave as Ctrl-C does: through the same cleanup
        from .signals import exit_on_signals

        exit_on_signals()
    try:
        _main(argv)
    except SystemExit as e:
        if argv is None and env("CLOVER_SLOW_EXIT", "") in ("", "0"):
            _leave(e.code)
        raise


def _leave(code) -> None:
    """End the process now, with `code`, as the interpreter would, minus its teardown.

    What a normal exit does after the command, in order: wait for the threads that are not daemons, run the atexit
    functions (a temporary directory's removal, logging's flush, ...), flush the output, then take down every module
    and object one by one. After torch and a model have been loaded, that last part alone takes ~1.3 s (measured:
    docs/BENCHMARKS.md) during which the user's shell waits and nothing is written. This does the first three and
    skips the last (os._exit). CLOVER_SLOW_EXIT=1 keeps the interpreter's own exit."""
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)  # joins the non-daemon threads, as the interpreter does
    exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or exitfuncs is None or os.name == "nt":  # not CPython on a POSIX system: its own exit
        return
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code if 0 <= code <= 255 else 1
    else:  # SystemExit("message"): the message on stderr, status 1, as Python does
        status = 1
    try:
        shutdown()
        exitfuncs()
        if not isinstance(code, (int, type(None))):
            sys.stderr.write(f"{code}\n")
    except KeyboardInterrupt:  # Ctrl-C while threads were joined: leave at once, as interrupted
        status = 130
    except BaseException:  # noqa: BLE001 - whatever else: the command's own status stands
        pass
    _stdout_ok()
    try:
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass
    try:  # what C libraries have buffered in their own stdio
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except Exception:  # noqa: BLE001 - no C library to flush: nothing buffered there
        pass
    os._exit(status)


def _main(argv=None):
    """The error boundary: whatever escapes a command ends as one line on stderr and an exit code: 2 for a problem
    the user can fix (CloverError, a usage error), 1 for anything else, 130 for Ctrl-C. --debug or CLOVER_DEBUG=1
    also print the traceback."""
    state["debug"] = False
    try:
        code = _run(argv)
    except CloverError as e:
        _fail(str(e), e.code)
    except _USAGE_ERRORS as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `clover`: the help (typer has printed it), as click does
            help_text = e.format_message().strip()
            if help_text:
                sys.stderr.write(help_text + "\n")
            raise SystemExit(2)
        _fail(_usage_message(e))
    except _ABORTS:
        sys.stderr.write("\nclover: interrupted\n")
        raise SystemExit(130)
    except BrokenPipeError:  # the reader of the output went away (`clover ... | head -1`): nothing to say
        _stdout_ok()
        raise SystemExit(0)
    except MemoryError:
        # what ran out may be the model or what it was given (a prompt, a file): both are named
        _fail("out of memory: the model with its context, or an input, did not fit; try a shorter input, a smaller "
              "model, --load-in-8bit or a smaller --tree-budget")
    except OSError as e:
        if not _stdout_ok():
            _fail(f"cannot write the output: {e.strerror or one_line(e)}", 1)
        _fail(f"{e.strerror or one_line(e)}" + (f": {e.filename}" if e.filename else ""), 1)
    except Exception as e:  # torch.cuda.OutOfMemoryError included
        if type(e).__name__ == "OutOfMemoryError":
            _fail("out of GPU memory; try --load-in-8bit, a smaller model or a smaller --tree-budget")
        _fail(f"unexpected {one_line(e, kind=True)} (clover --debug or CLOVER_DEBUG=1 shows the "
              f"traceback; please report it)", 1)
    if code == 130:  # a KeyboardInterrupt a command turned into Exit(130)
        sys.stderr.write("\nclover: interrupted\n")
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
