"""Tool calls on `clover serve`'s chat API: a request's `tools` checked and handed to the chat template, the messages
of a tool conversation (an assistant's `tool_calls`, a `tool` role's result) in the shape templates read, and a
reply in a known tool-call format parsed into OpenAI's `tool_calls`.

The one known format is Hermes' (Qwen 2.5 and 3, Hermes, many others): each call written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; a template that writes `<tool_call>` is taken to use it.
A template that renders tools otherwise has its replies returned as text; one that does not render them at all is
refused (400). The model cannot be forced to call a tool: `tool_choice` may be "auto" or "none" (tools not shown).
"""

from __future__ import annotations

import json
import re
import uuid

from .api import ApiError

HERMES = "hermes"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def request_tools(body: dict) -> list[dict] | None:
    """The request's tools as the template gets them, or None (no tools, or tool_choice "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        raise ApiError(400, f"'tool_choice' {json.dumps(choice)[:80]} is not supported yet: the model cannot be "
                            f"made to call a tool (use \"auto\" or \"none\")", "tool_choice", "unsupported_parameter")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]
                and isinstance(fn.get("parameters", {}), dict)):
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                                f"\"description\", \"parameters\"}}}}", "tools")
    return None if choice == "none" else tools


def tool_format(template: str) -> str | None:
    """The tool-call format a chat template's replies use, when it is a known one."""
    return HERMES if "<tool_call>" in template else None


def template_message(m: dict, where: str) -> dict | None:
    """A tool conversation's message in the shape templates read, or None when it is not one (an ordinary message,
    api.parse_messages' to check): an assistant's `tool_calls` (their arguments as objects), a `tool` role's
    result."""
    role, calls = m.get("role"), m.get("tool_calls")
    if role == "tool":
        content = m.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be the tool's result as a string", where)
        out = {"role": "tool", "content": content}
        if isinstance(m.get("tool_call_id"), str):
            out["tool_call_id"] = m["tool_call_id"]
        return out
    if role != "assistant" or not calls:
        return None
    if not isinstance(calls, list):
        raise ApiError(400, f"{where}.tool_calls must be a list", where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)):
            raise ApiError(400, f"{where}.tool_calls[{j}] must have a function with a name and arguments (a JSON "
                                f"string)", where)
        try:
            arguments = json.loads(fn["arguments"])
        except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than Python's stack
            raise ApiError(400, f"{where}.tool_calls[{j}].function.arguments is not JSON", where)
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    content = m.get("content")
    return {"role": "assistant", "content": content if isinstance(content, str) else "", "tool_calls": out}


def parse_calls(text: str, fmt: str | None) -> tuple[str | None, list[dict]]:
    """A reply's text without its tool calls (None when nothing else is left), and the calls in OpenAI's shape
    (none when the format is unknown or a call is not JSON with a name: the reply stays text)."""
    if fmt != HERMES or "<tool_call>" not in text:
        return text, []
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except (ValueError, RecursionError):
            return text, []
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": call["name"], "arguments": arguments if isinstance(arguments, str)
                                   else json.dumps(arguments, ensure_ascii=False)}})
    if not calls:
        return text, []
    rest = _CALL.sub("", text).strip()
    return rest or None, calls
