"""Streaming text: incremental detokenisation and the colours of accepted draft tokens."""

from __future__ import annotations

import os
import sys

# One colour per draft depth (1, 2, 3, ...); the target's own tokens stay plain. ANSI 256-colour codes.
DEPTH_COLOURS = [39, 42, 214, 170, 203, 117, 227, 141]
RESET = "\x1b[0m"


def colour_code(depth: int) -> str:
    return f"\x1b[38;5;{DEPTH_COLOURS[(depth - 1) % len(DEPTH_COLOURS)]}m"


def use_colour(no_colour_flag: bool, stream=sys.stdout) -> bool:
    if no_colour_flag or os.environ.get("NO_COLOR"):
        return False
    return hasattr(stream, "isatty") and stream.isatty()


# Control characters as text: ^X for C0 and DEL (an escape sequence, a bell, a carriage return), U+FFFD for C1 (a
# single-byte CSI); newlines and tabs stay.
_CONTROL = {c: f"^{chr(c + 64)}" for c in range(32) if chr(c) not in "\n\t"}
_CONTROL.update({0x7F: "^?", **{c: "\ufffd" for c in range(0x80, 0xA0)}})


def visible(text: str) -> str:
    """Text made safe for a terminal: control characters (escape sequences, carriage returns, bells) are shown as
    ^X instead of acting on the terminal. Everything clover shows that a model, a user or a file wrote goes through
    here: replies in a terminal, and every note and error (a system message, a file name, a file's content)."""
    return text.translate(_CONTROL)


def legend(max_depth: int = 5) -> str:
    parts = [f"{colour_code(d)}depth {d}{RESET}" for d in range(1, max_depth + 1)]
    return "accepted draft tokens: " + " ".join(parts) + "  · plain: the target's own token"


class Detokenizer:
    """Turns a growing list of token ids into text pieces, one per token, holding back incomplete characters.

    Decoding only a short window (from `prefix` on) keeps each step cheap, and comparing it with the window
    decoded without the newest tokens gives exactly the text those tokens add, spaces included.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens already turned into text

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            piece = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            return piece
        return ""

    def text(self) -> str:
        return self._decode(self.ids)


def paint(piece: str, depth: int, colour: bool) -> str:
    if not colour or depth == 0 or not piece:
        return piece
    return f"{colour_code(depth)}{piece}{RESET}"


def download_progress(label: str):
    """A transient rich progress bar on stderr for a download's bytes (the Hub's and the package index's alike)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    return Progress(TextColumn(f"[bold]{label}[/]"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    console=Console(stderr=True), transient=True)
