"""A chat's conversation: its messages and system message, the window of them the model is shown, and what /undo,
/regen, /save and /load do to them; `fit_context` fits the newest of them in the model's context."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .. import atomic
from ..errors import CloverError

MAX_LOAD_BYTES = 64 * 1024 * 1024
SAVE_FORMAT = "clover-chat"


class Conversation:
    """The messages (alternating user / assistant, user first) and the system message.

    `window` is the index of the first message still sent to the model: when the conversation outgrows the
    model's context the oldest exchanges are left out (they stay here, and in /save files).
    """

    def __init__(self, system: str | None = None):
        self.system = system
        self.messages: list[dict] = []
        self.window = 0

    def for_model(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": m["role"], "content": m["content"]} for m in self.messages[self.window:]]

    def state(self):
        return [dict(m) for m in self.messages], self.window, self.system

    def restore(self, state):
        messages, self.window, self.system = state
        self.messages = [dict(m) for m in messages]

    def repair(self):
        """Keep the invariant: the conversation ends with a reply (or is empty)."""
        while self.messages and self.messages[-1]["role"] != "assistant":
            self.messages.pop()
        self.window = min(self.window, len(self.messages))
        self.window -= self.window % 2

    def undo(self) -> int:
        n = 0
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
            n += 1
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()
            n += 1
        self.repair()
        return n

    def to_json(self, model: str | None = None) -> dict:
        return {"format": SAVE_FORMAT, "version": 1, "model": model, "saved": round(time.time(), 3),
                "system": self.system, "messages": [dict(m) for m in self.messages]}

    @staticmethod
    def parse(data) -> "Conversation":
        """A conversation from /save's JSON object, or from a plain list of {role, content} messages (an optional
        system message first). ValueError says what is wrong."""
        system = None
        if isinstance(data, dict):
            if "messages" not in data:
                raise ValueError("no 'messages' in it")
            system = data.get("system")
            if system is not None and not isinstance(system, str):
                raise ValueError("'system' must be a string or null")
            items = data["messages"]
        elif isinstance(data, list):
            items = data
        else:
            raise ValueError("expected a JSON object with 'messages', or a list of messages")
        if not isinstance(items, list):
            raise ValueError("'messages' must be a list")
        if items and isinstance(items[0], dict) and items[0].get("role") == "system":
            if system is not None:
                raise ValueError("two system messages")
            system = items[0].get("content")
            if not isinstance(system, str):
                raise ValueError("message 1: 'content' must be a string")
            items = items[1:]
        if system is not None:
            _check_text(system, "the system message")
        conv = Conversation(system or None)
        for i, m in enumerate(items, 1):
            if not isinstance(m, dict):
                raise ValueError(f"message {i} is not an object")
            role, content = m.get("role"), m.get("content")
            want = "user" if i % 2 else "assistant"
            if role not in ("user", "assistant"):
                raise ValueError(f"message {i}: role must be user or assistant, not {role!r}")
            if role != want:
                raise ValueError(f"message {i}: expected a {want} message (turns must alternate, user first)")
            if not isinstance(content, str):
                raise ValueError(f"message {i}: 'content' must be a string")
            _check_text(content, f"message {i}: 'content'")
            msg = {"role": role, "content": content}
            if m.get("interrupted") is True:
                msg["interrupted"] = True
            conv.messages.append(msg)
        if conv.messages and conv.messages[-1]["role"] != "assistant":
            raise ValueError("the last message has no reply (a saved conversation ends with a reply)")
        return conv

    @staticmethod
    def load(path: str) -> "Conversation":
        from ..inputs import read_limited

        p = Path(path).expanduser()
        try:
            if p.is_dir():
                raise CloverError(f"cannot load {path}: it is a directory")
            # in chunks up to the cap: a device or a pipe says it holds 0 bytes (/dev/zero), and Ctrl-C stops it
            raw = read_limited(p, MAX_LOAD_BYTES, f"cannot load {path}: it")
        except FileNotFoundError:
            raise CloverError(f"cannot load {path}: no such file")
        except OSError as e:
            raise CloverError(f"cannot load {path}: {e.strerror or e}")
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise CloverError(f"cannot load {path}: not UTF-8 text")
        except (json.JSONDecodeError, RecursionError) as e:
            raise CloverError(f"cannot load {path}: not valid JSON ({getattr(e, 'msg', 'too deeply nested')}"
                              f"{f' at line {e.lineno}' if hasattr(e, 'lineno') else ''})")
        try:
            return Conversation.parse(data)
        except ValueError as e:
            raise CloverError(f"cannot load {path}: {e}")

    def save(self, path: str, model: str | None = None) -> Path:
        """Write to a temporary file in the same directory, then rename it over `path`: never half a file. Only a
        new name or a regular file is written (a device, a FIFO or a symbolic link is refused: atomic.check_replace);
        a new file is private (0600), an existing one keeps its mode."""
        p = Path(path).expanduser()
        if p.is_dir():
            raise CloverError(f"cannot save to {path}: it is a directory")
        data = (json.dumps(self.to_json(model), ensure_ascii=False, indent=1) + "\n").encode()
        try:
            atomic.write_bytes(p, data, mode=0o600, make_parents=False)  # a conversation is private
        except OSError as e:
            raise CloverError(f"cannot save to {path}: {e.strerror or e}")
        return p


def _check_text(text: str, where: str):
    from ..inputs import surrogate_problem

    why = surrogate_problem(text, where)
    if why is not None:
        raise ValueError(why)


def fit_context(conv: Conversation, encode, limit: int) -> tuple[list[int], int]:
    """Token ids of the conversation for the model, leaving out the fewest oldest exchanges for the rest to fit in
    `limit` tokens. Returns (ids, messages newly left out). The window only moves forward, so the model's cache of
    the kept prefix stays valid from one reply to the next.

    What is tokenized is at most `limit` x inputs.CHARS_PER_TOKEN characters: the exchanges that would take the
    messages past that are left out before any tokenizing (a /load of megabytes costs no more than a full context),
    and a last message past it alone is refused untokenized.

    The window is found by bisection over whole exchanges: each encoding tried is of a suffix at most as long as
    the rest of the interval plus one that fits, so a long conversation (a /load) costs about two encodings of it
    in all, not one per exchange left out."""
    from ..inputs import CHARS_PER_TOKEN, check_text_size

    original = conv.window
    last = original + 2 * ((len(conv.messages) - original) // 2)  # the window that keeps the final message alone
    most = limit * CHARS_PER_TOKEN
    system = len(conv.system or "")
    check_text_size(system + sum(len(m["content"]) for m in conv.messages[last:]), limit, "the message")
    start, chars = last, system + sum(len(m["content"]) for m in conv.messages[last:])
    while start - 2 >= original:  # the most exchanges, from the newest back, within the characters' bound
        more = len(conv.messages[start - 2]["content"]) + len(conv.messages[start - 1]["content"])
        if chars + more > most:
            break
        start, chars = start - 2, chars + more

    def encode_from(window: int) -> list[int]:
        conv.window = window
        return encode(conv.for_model())

    ids = encode_from(start)
    if len(ids) <= limit:
        return ids, start - original
    fits = ids if start == last else encode_from(last)
    if len(fits) > limit:
        conv.window = original
        raise CloverError(f"the message is too long: {len(fits)} tokens with the chat template and system "
                          f"message, and at most {limit} fit (the rest of the context is kept for the reply)")
    lo, hi = start, last  # lo does not fit, hi does
    while hi - lo > 2:
        mid = lo + 2 * ((hi - lo) // 4)
        ids = encode_from(mid)
        if len(ids) <= limit:
            hi, fits = mid, ids
        else:
            lo = mid
    conv.window = hi
    return fits, hi - original
