"""Ollama's API on `clover serve`, so that Ollama's clients (its Python and JavaScript packages, Open WebUI) connect:

    POST /api/chat       messages -> the chat template -> a reply
    POST /api/generate   a prompt, through the chat template (with `system`), or as it is with "raw": true
    GET  /api/tags       the one model served (/api/ps: loaded);  POST /api/show: its details;  GET /api/version

Replies stream as NDJSON (one JSON object a line, the last with "done": true and the counts and durations) unless
the request says "stream": false, as Ollama does. A request is translated into the OpenAI API's fields and served by
the same checks, queue and worker (serve.Server.submit): `options` temperature, top_p, top_k, min_p, seed,
repeat_penalty, stop and num_predict (-1, -2 or none: until the reply ends or fills the context) are applied, with
Ollama's defaults (temperature 0.8, top_k 40, top_p 0.9; the repetition penalty is the model's own unless asked);
the other options (num_ctx, mirostat, num_thread, ...) and keep_alive are ignored and named in X-Clover-Ignored.
`tools` work as on the OpenAI API (tools.py), tool calls coming back in Ollama's shape (arguments as objects). What
clover cannot do (images, `format`, `suffix`, `template`, thinking) is a 400. Errors are Ollama's
{"error": message} (serve._error_response).
"""

from __future__ import annotations

import json
import time

from .api import ApiError, finish_reason
from .tools import parse_calls

OLLAMA_VERSION = "0.6.0"  # what /api/version says: the Ollama API these endpoints follow (clients compare it)
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
           "repeat_penalty": "repetition_penalty", "stop": "stop", "num_predict": "max_tokens"}
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}  # Ollama's, where a request sets none
COMMON = {"model", "stream", "options", "format", "keep_alive", "think", "logprobs", "top_logprobs"}
CHAT_FIELDS = COMMON | {"messages", "tools"}
GENERATE_FIELDS = COMMON | {"prompt", "suffix", "system", "template", "context", "raw", "images"}


def _created() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + "Z"


def translate(body: dict, chat: bool) -> tuple[dict | None, bool, list[str]]:
    """An Ollama request as an OpenAI one: (its body, whether it is a chat, the fields ignored). The body is None
    for a generate request with no prompt (Ollama's way to load a model: answered at once)."""
    for name in body:
        if name not in (CHAT_FIELDS if chat else GENERATE_FIELDS):
            raise ApiError(400, f"unrecognized request field: {name}", name, "unknown_parameter")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", "stream")
    for name, what in (("format", "a JSON reply format"), ("think", "thinking"), ("logprobs", "logprobs here (the "
                       "OpenAI API at /v1 has them)"), ("top_logprobs", "logprobs here"), ("images", "images"), ("suffix", "a suffix"), ("template", "a template per request")):
        if body.get(name) not in (None, False, "", [], 0):
            raise ApiError(400, f"'{name}': clover does not support {what} yet", name, "unsupported_parameter")
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'options' must be an object", "options")
    out = {"model": body.get("model"), "stream": stream, **{OPTIONS[k]: v for k, v in DEFAULTS.items()}}
    ignored = [name for name in ("keep_alive", "context") if body.get(name) not in (None, [])]
    for name, value in options.items():
        if value is None:
            continue
        if name not in OPTIONS:
            ignored.append(f"options.{name}")
        elif name == "num_predict":
            if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -2:
                raise ApiError(400, f"'options.num_predict' must be a number of tokens, or -1 or -2 (until the end),"
                                    f" not {json.dumps(value)[:80]}", "options.num_predict")
            if value > 0:
                out["max_tokens"] = value
        else:
            out[OPTIONS[name]] = value
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
        if body.get("tools"):
            out["tools"] = body["tools"]  # OpenAI's shape; checked and handed to the template as theirs (tools.py)
        out["messages"] = [_message(m, i) for i, m in enumerate(messages)]
        return out, True, ignored
    prompt, system, raw = body.get("prompt"), body.get("system"), body.get("raw", False)
    if prompt is not None and not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a string", "prompt")
    if system is not None and not isinstance(system, str):
        raise ApiError(400, "'system' must be a string", "system")
    if not isinstance(raw, bool):
        raise ApiError(400, "'raw' must be true or false", "raw")
    if not prompt:
        return None, False, ignored
    if raw:
        out["prompt"] = prompt
        return out, False, ignored
    out["messages"] = ([{"role": "system", "content": system}] if system else []) + [{"role": "user",
                                                                                       "content": prompt}]
    return out, True, ignored


def _message(m, i: int):
    """An Ollama message in OpenAI's shape: role and content, a tool call's arguments (an object) as a JSON string."""
    if not isinstance(m, dict):
        return m  # api.parse_messages says what is wrong with it
    if m.get("images"):
        raise ApiError(400, f"messages[{i}]: clover does not support images yet", "messages")
    out = {"role": m.get("role"), "content": m.get("content", "")}
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                  for c in calls):
            raise ApiError(400, f"messages[{i}].tool_calls must be a list of {{\"function\": {{name, arguments}}}}",
                           "messages")
        out["tool_calls"] = [{"type": "function", "function": {
            "name": c["function"].get("name"), "arguments": json.dumps(c["function"].get("arguments", {}))}}
            for c in calls]
    return out


def _reply_body(chat: bool, job, text: str):
    """A whole reply as a line gives it: a generate request's text, or a chat's message, its tool calls parsed
    (tools.py) when the request had tools, in Ollama's shape."""
    if not chat:
        return text
    if not job.prompt.tool_format:
        return {"role": "assistant", "content": text}
    rest, calls = parse_calls(text, job.prompt.tool_format)
    message = {"role": "assistant", "content": rest or ""}
    if calls:
        message["tool_calls"] = [{"function": {"name": c["function"]["name"],
                                               "arguments": _object(c["function"]["arguments"])}} for c in calls]
    return message


def _object(arguments: str):
    """A call's arguments as Ollama gives them: the object its JSON holds (a model may write a string instead)."""
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments


class Ollama:
    """The endpoints, on a serve.Server (its checks, queue, worker and model name)."""

    def __init__(self, server):
        self.server = server

    def routes(self) -> list:
        from starlette.routing import Route

        return [Route("/api/chat", self.chat, methods=["POST"]),
                Route("/api/generate", self.generate, methods=["POST"]),
                Route("/api/tags", self.tags, methods=["GET"]),
                Route("/api/ps", self.running, methods=["GET"]),
                Route("/api/show", self.show, methods=["POST"]),
                Route("/api/version", self.version, methods=["GET"])]

    def _details(self) -> dict:
        config = self.server.session.model.config
        return {"parent_model": "", "format": "safetensors", "family": getattr(config, "model_type", ""),
                "families": [getattr(config, "model_type", "")], "parameter_size": "", "quantization_level": ""}

    async def version(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"version": OLLAMA_VERSION})

    async def tags(self, request):
        from starlette.responses import JSONResponse

        name = self.server.model_id
        modified = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.server.created))
        return JSONResponse({"models": [{"name": name, "model": name, "modified_at": modified, "size": 0,
                                         "digest": "", "details": self._details()}]})

    async def running(self, request):
        """/api/ps: the model, loaded for as long as the server runs."""
        from starlette.responses import JSONResponse

        name = self.server.model_id
        return JSONResponse({"models": [{"name": name, "model": name, "size": 0, "digest": "",
                                         "details": self._details(), "expires_at": "2999-12-31T23:59:59Z",
                                         "size_vram": 0, "context_length": self.server.session.max_context}]})

    async def show(self, request):
        from starlette.responses import JSONResponse

        body = await self.server._json(request)
        name = body.get("model", body.get("name"))
        if not isinstance(name, str):
            raise ApiError(400, "'model' must be a string", "model")
        s = self.server.session
        return JSONResponse({"modelfile": "", "parameters": "", "template": "", "details": self._details(),
                             "model_info": {"general.architecture": getattr(s.model.config, "model_type", ""),
                                            "clover.context_length": s.max_context, "clover.draft": s.draft_name},
                             "capabilities": ["completion"]})

    async def chat(self, request):
        return await self._reply(request, chat=True)

    async def generate(self, request):
        return await self._reply(request, chat=False)

    async def _reply(self, request, chat: bool):
        from starlette.responses import JSONResponse

        server = self.server
        body, is_chat, ignored = translate(await server._json(request), chat)
        if body is None:  # generate with no prompt: "load the model", done at once
            return JSONResponse({"model": server.model_id, "created_at": _created(), "response": "", "done": True,
                                 "done_reason": "load"})
        job, headers = await server.submit(body, is_chat, ignored)
        if job.prompt.stream:
            return server.streamed(job, self._lines(job, chat), headers, "application/x-ndjson")
        result = await server.wait(job, request)
        choice = result["choices"][0]
        return JSONResponse(self._final(job, chat, result, _reply_body(chat, job, choice["text"])),
                            headers=headers)

    def _piece(self, chat: bool, text, done: bool = False) -> dict:
        """A line of the reply: `text` a piece of it, or (chat) a whole message."""
        if chat:
            key = {"message": text if isinstance(text, dict) else {"role": "assistant", "content": text}}
        else:
            key = {"response": text}
        return {"model": self.server.model_id, "created_at": _created(), **key, "done": done}

    def _final(self, job, chat: bool, result: dict, text) -> dict:
        stats, ns = result["stats"], lambda s: int((s or 0) * 1e9)  # noqa: E731
        return {**self._piece(chat, text, True), "done_reason": finish_reason(result["choices"][0]["finish"]),
                "total_duration": ns(result["elapsed_s"] + result["queue_s"]), "load_duration": 0,
                "prompt_eval_count": len(job.prompt.ids), "prompt_eval_duration": ns(stats.prefill_s),
                "eval_count": stats.new_tokens, "eval_duration": ns(stats.decode_s)}

    async def _lines(self, job, chat: bool):
        """The NDJSON lines of a streamed reply (with tools, the reply whole at its end: text or tool calls)."""
        tools = chat and job.prompt.tool_format
        while True:
            kind, value = await job.events.get()
            if tools and kind in ("delta", "choice"):
                if kind == "choice":
                    yield json.dumps(self._piece(chat, _reply_body(chat, job, value["text"])),
                                     ensure_ascii=False) + "\n"
            elif kind == "delta" or (kind == "choice" and value["tail"]):
                yield json.dumps(self._piece(chat, value[1] if kind == "delta" else value["tail"]),
                                 ensure_ascii=False) + "\n"
            elif kind == "error":
                yield json.dumps({"error": value.message}) + "\n"
                return
            elif kind == "done":
                yield json.dumps(self._final(job, chat, value, ""), ensure_ascii=False) + "\n"
                return
