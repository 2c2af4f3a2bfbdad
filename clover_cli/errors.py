"""Errors the user can act on. The CLI prints them as one line on stderr and exits with their code (2 unless said)."""


class CloverError(Exception):
    """A problem with the user's input or environment, explained in one line."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def one_line(e: BaseException, limit: int = 300, kind: bool = False) -> str:
    """An exception as one line for a message: its first non-blank line, or its first lines joined where that line
    ends in a colon (a sentence going on below it), cut at `limit` characters; its type's name where it says
    nothing, or before what it says with `kind`."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    if line.endswith(":") and len(lines) > 1:
        line = " ".join(lines)
    if len(line) > limit:
        line = line[:limit - 1].rstrip(" ,") + "…"  # e.g. every parameter a device map missed
    name = type(e).__name__
    if not line:
        return name
    return f"{name}: {line}" if kind else line
