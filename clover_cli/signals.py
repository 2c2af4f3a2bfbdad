"""SIGTERM and SIGHUP end clover as Ctrl-C does: through the same cleanup (finally blocks, the atexit functions that
remove the loaded compiled programs' unpacked libraries from TMPDIR, a half-built package removed), instead of the
default action, which kills the process where it stands and leaves all of that behind (closing the terminal of a
`clover chat`, `kill` on a server)."""

from __future__ import annotations

import signal

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def _leave(signum, frame):
    for sig in SIGNALS:  # a second one while this exit runs (its cleanup) ends the process at once, as usual
        signal.signal(sig, signal.SIG_DFL)
    raise SystemExit(128 + signum)


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP raise SystemExit(128 + the signal) in the main thread (the exit status a shell reports for
    a process those signals ended). A server under uvicorn has its own handler for SIGTERM while it runs, which shuts
    it down and then raises the signal again to this one."""
    for sig in SIGNALS:
        try:
            signal.signal(sig, _leave)
        except (ValueError, OSError):  # not the main thread
            pass
