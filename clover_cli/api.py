"""The OpenAI API's requests as `clover serve` reads them: the error it answers with (ApiError, error_body), the fields
each endpoint takes, and the checks of numbers, messages, texts and stop strings (each a 400 that names the field)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_body(e: ApiError) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


# ----------------------------------------------------------------------------------------------- requests

@dataclass
class Prompt:
    """One request, checked: what the worker generates and how the reply is shaped."""

    ids: list[int]
    max_tokens: int
    sampling: object  # engine.Sampling
    stops: list[str]  # the request's stop strings (the template's are added)
    chat: bool  # a chat reply (trimmed, role and message fields) or a raw completion
    stream: bool = False
    usage_chunk: bool = False  # stream_options.include_usage


# Fields accepted with their neutral value only (a client may send them; clover has no such feature).
NEUTRAL = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": (False, 0),
           "top_logprobs": 0, "echo": False, "logit_bias": {}, "suffix": "", "tools": [], "tool_choice": ("none", "auto"),
           "response_format": {"type": "text"}, "parallel_tool_calls": (True, False), "user": str,
           "service_tier": str, "store": False, "metadata": dict}
# repetition_penalty, top_k, min_p: not OpenAI's, but what transformers, vLLM, TGI and llama-server clients send
# (clover generate's options; top_k -1 or 0: all tokens, as vLLM takes it)
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
          "repetition_penalty", "top_k", "min_p"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "n", "presence_penalty", "frequency_penalty",
                        "logprobs", "top_logprobs", "logit_bias", "tools", "tool_choice", "response_format",
                        "parallel_tool_calls", "user", "service_tier", "store", "metadata"}
COMPLETION_FIELDS = COMMON | {"prompt", "n", "best_of", "presence_penalty", "frequency_penalty", "logprobs",
                              "echo", "logit_bias", "suffix", "user"}


def number_field(body: dict, name: str, low: float, high: float, default: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (low < value if low_open else low <= value) or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ApiError(400, f"'{name}' must be a number in {interval}, not {json.dumps(value)}", name)
    return float(value)


def integer_field(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(400, f"'{name}' must be a whole number from {low} to {high}, not {json.dumps(value)}", name)
    return value


def check_fields(body: dict, known: set[str]):
    for name, value in body.items():
        if name not in known:
            raise ApiError(400, f"unrecognized request argument supplied: {name}", name, "unknown_parameter")
        neutral = NEUTRAL.get(name)
        if neutral is None or value is None:
            continue
        if isinstance(neutral, type):
            ok = isinstance(value, neutral)
        elif isinstance(neutral, tuple):
            ok = any(value == v and type(value) is type(v) for v in neutral)
        else:
            ok = value == neutral and (isinstance(value, bool) == isinstance(neutral, bool))
        if not ok:
            raise ApiError(400, f"'{name}': {json.dumps(value)[:80]} is not supported by clover (leave it out)", name,
                           "unsupported_parameter")


def _text_content(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (what newer OpenAI clients send)."""
    if isinstance(content, str):
        return check_text(content, f"{where}.content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return check_text("".join(p["text"] for p in content), f"{where}.content")
    raise ApiError(400, f"{where}.content must be a string or a list of text parts", where)


def check_text(text: str, where: str) -> str:
    from .inputs import surrogate_problem

    why = surrogate_problem(text, where)
    if why is not None:
        raise ApiError(400, why, where.partition(".")[0].partition("[")[0])
    return text


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object with 'role' and 'content'", where)
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ("system", "user", "assistant"):
            raise ApiError(400, f"{where}.role must be system, user or assistant, not {json.dumps(m.get('role'))}",
                           f"{where}.role")
        out.append({"role": role, "content": _text_content(m.get("content"), where)})
    return out


def parse_stops(body: dict) -> list[str]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    return stops


# ----------------------------------------------------------------------------------------------- the worker
