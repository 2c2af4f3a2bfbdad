"""The OpenAI API's requests as `clover serve` reads them: the error it answers with (ApiError, error_body), the fields
each endpoint takes, and the checks of numbers, messages, texts and stop strings (each a 400 that names the field)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field


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
    ignored: list[str] = field(default_factory=list)  # fields accepted and ignored (the X-Clover-Ignored header)
    n: int = 1  # replies to generate, one after another
    tool_format: str | None = None  # the replies' tool calls are parsed in this format (tools.py)


# Fields accepted with their neutral value only (a client may send them; clover has no such feature, and ignoring
# another value would change what the reply means: a schema, a bias, several sequences at once).
NEUTRAL = {"best_of": 1, "echo": False, "logit_bias": {},
           "suffix": "", "parallel_tool_calls": (True, False),
           "user": str, "service_tier": str, "store": False, "metadata": dict}
NUMBER, WHOLE, FLAG, LIST = "a number", "a whole number", "true or false", "a list"
# Sampling fields of other servers' APIs (llama-server, vLLM, text-generation-webui, what their clients send) that
# clover has no such feature for: accepted when their value is of the right kind, then ignored, and named in the
# response's X-Clover-Ignored header. presence_penalty and frequency_penalty are OpenAI's: 0 is no penalty (not
# named). Fields clover does apply under another name: repeat_penalty (llama-server's repetition_penalty), n_predict
# (its max_tokens, -1: none).
IGNORED = {"presence_penalty": NUMBER, "frequency_penalty": NUMBER, "typical_p": NUMBER, "tfs_z": NUMBER,
           "mirostat": WHOLE, "mirostat_tau": NUMBER, "mirostat_eta": NUMBER, "repeat_last_n": WHOLE,
           "penalize_nl": FLAG, "cache_prompt": FLAG, "n_keep": WHOLE, "id_slot": WHOLE, "slot_id": WHOLE,
           "samplers": LIST, "dynatemp_range": NUMBER, "dynatemp_exponent": NUMBER, "xtc_probability": NUMBER,
           "xtc_threshold": NUMBER, "dry_multiplier": NUMBER, "dry_base": NUMBER, "dry_allowed_length": WHOLE,
           "dry_penalty_last_n": WHOLE, "dry_sequence_breakers": LIST, "top_n_sigma": NUMBER, "min_keep": WHOLE,
           "t_max_predict_ms": WHOLE, "timings_per_token": FLAG, "return_tokens": FLAG, "length_penalty": NUMBER,
           "min_tokens": WHOLE, "skip_special_tokens": FLAG, "spaces_between_special_tokens": FLAG,
           "include_stop_str_in_output": FLAG, "use_beam_search": FLAG, "early_stopping": FLAG, "priority": WHOLE,
           "truncate_prompt_tokens": WHOLE, "add_generation_prompt": FLAG}
_KINDS = {NUMBER: (int, float), WHOLE: int, FLAG: bool, LIST: list}
# repetition_penalty (repeat_penalty), top_k, min_p: not OpenAI's, but what transformers, vLLM, TGI and llama-server
# clients send (clover generate's options; top_k -1 or 0: all tokens, as vLLM takes it)
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
          "repetition_penalty", "repeat_penalty", "top_k", "min_p", "n", "logprobs", "n_predict"} | set(IGNORED)
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "logit_bias", "tools", "tool_choice",
                        "response_format", "parallel_tool_calls", "user", "service_tier", "store", "metadata"}
COMPLETION_FIELDS = COMMON | {"prompt", "best_of", "echo", "logit_bias", "suffix", "user"}


def finite(value) -> bool:
    """A JSON number that is a finite float (an integer too large for a float is not: math.isfinite raises)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def number_field(body: dict, name: str, low: float, high: float, default: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite(value) \
            or not (low < value if low_open else low <= value) or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ApiError(400, f"'{name}' must be a number in {interval}, not {json.dumps(value)[:80]}", name)
    return float(value)


def integer_field(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(400, f"'{name}' must be a whole number from {low} to {high}, not {json.dumps(value)}", name)
    return value


def check_fields(body: dict, known: set[str]) -> list[str]:
    """Refuse an unknown field, or a known one clover cannot honour; returns the fields accepted and ignored
    (IGNORED, with a value of the right kind)."""
    ignored = []
    for name, value in body.items():
        if name not in known:
            raise ApiError(400, f"unrecognized request argument supplied: {name}", name, "unknown_parameter")
        if value is None:
            continue
        kind = IGNORED.get(name)
        if kind is not None:
            if isinstance(value, bool) != (kind == FLAG) or not isinstance(value, _KINDS[kind]) \
                    or (kind == NUMBER and not finite(value)):
                raise ApiError(400, f"'{name}' must be {kind}, not {json.dumps(value)[:80]}", name)
            if name in ("presence_penalty", "frequency_penalty"):
                if not -2 <= value <= 2:
                    raise ApiError(400, f"'{name}' must be a number in [-2, 2], not {json.dumps(value)}", name)
                if value == 0:
                    continue
            ignored.append(name)
            continue
        if name == "response_format" and not (isinstance(value, dict) and isinstance(value.get("type"), str)):
            raise ApiError(400, "'response_format' must be an object with a 'type'", name)
        if name == "response_format" and value["type"] != "text":
            raise ApiError(400, f"'response_format' {json.dumps(value['type'])[:80]} is not supported yet: clover "
                                f"cannot constrain a reply to JSON (leave it out, or ask for JSON in the prompt)",
                           name, "unsupported_parameter")
        neutral = NEUTRAL.get(name)
        if neutral is None:
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
    return ignored


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


def parse_messages(body: dict, special=None) -> list[dict]:
    """The messages as the template gets them; `special(message, where)` may take one first (tools.py's
    template_message: a tool call or result), returning None to leave it to the checks here."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object with 'role' and 'content'", where)
        taken = special(m, where) if special is not None else None
        if taken is not None:
            out.append(taken)
            continue
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

# ----------------------------------------------------------------------------------------------- responses

def finish_reason(engine_finish: str | None) -> str:
    return "length" if engine_finish == "length" else "stop"


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", "surrogatepass"))


def logprobs_body(chat: bool, entries: list[dict] | None) -> dict | None:
    """A choice's "logprobs" from worker.reply_logprobs' entries: chat's {"content": [...]}, or the completions
    API's {"tokens", "token_logprobs", "top_logprobs", "text_offset"}."""
    if entries is None:
        return None
    if chat:
        return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": _bytes(e["token"]),
                             "top_logprobs": [{"token": t, "logprob": lp, "bytes": _bytes(t)} for t, lp in e["top"]]}
                            for e in entries], "refusal": None}
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [dict(e["top"]) for e in entries], "text_offset": offsets}


def choice_body(chat: bool, choice: dict) -> dict:
    """One choice of a (not streamed) response."""
    body = {"index": choice["index"]}
    if chat:
        body["message"] = {"role": "assistant", "content": choice["text"]}
        if choice.get("tool_calls"):
            body["message"]["tool_calls"] = choice["tool_calls"]
    else:
        body["text"] = choice["text"]
    finish = "tool_calls" if choice.get("tool_calls") else finish_reason(choice["finish"])
    return {**body, "logprobs": logprobs_body(chat, choice["logprobs"]), "finish_reason": finish}


def chunk_choice(chat: bool, index: int, delta, finish: str | None = None, logprobs: dict | None = None) -> dict:
    """One choice of a streamed chunk: `delta` a piece of text, a chat's delta object, or None."""
    if chat:
        delta = delta if isinstance(delta, dict) else {} if delta is None else {"content": delta}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}


def usage_body(prompt_tokens: int, stats) -> dict:
    new = stats.new_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": new, "total_tokens": prompt_tokens + new}
