"""`clover serve`: the OpenAI chat-completions API over HTTP (Starlette on uvicorn), speculative decoding inside.

    POST /v1/chat/completions   messages -> the chat template -> a reply (streamed as server-sent events or not)
    POST /v1/completions        a raw prompt, continued
    GET  /v1/models             the one model served
    GET  /health                status, the queue, the target step
    GET  /metrics               Prometheus' text format (metrics.py)
    /api/chat, /api/generate, /api/tags, /api/ps, /api/show, /api/version: Ollama's API (ollama_api.py)

One engine serves one request at a time, in the order they arrive: requests wait in a FIFO queue for the single
worker thread that runs the engine (the event loop never waits on the model). Each response says how many requests
were ahead of it (`X-Clover-Queue-Position`); /health shows the queue. A client that goes away, mid-stream or while
it waits, has its request dropped at once (the engine's generator is closed between two steps, which leaves its
cache consistent), and the next request is served normally.

Replies are what `clover chat` and `clover generate` give: the same chat template, drafters, stop strings and
sampling; a chat reply is trimmed of surrounding whitespace as the chat keeps it (`generate --json`'s text,
stripped), a completion is the raw continuation (`generate --raw --json`'s text). Each response carries the usage
fields and clover's own figures under "clover" (tau, acceptance rate, draft/verify time). A request's `n` replies
are generated one after another (worker.py); its logprobs are the target's (the engine hands them out when asked);
its tools go to the chat template, and tool calls in a known format come back as `tool_calls` (tools.py).

Errors are OpenAI-style JSON objects, {"error": {"message", "type", "param", "code"}}, with their HTTP status:
400 a bad request (malformed JSON, an unknown or unsupported field, a prompt over the context), 401 a wrong or
missing API key, 403 a browser's preflight from an origin not allowed (cors.py), 404 an unknown model or path, 405,
408 a body that did not arrive in time, 413 a body over the limit, 503 a full queue (or too many connections).
Under /api/ (Ollama's API) they are Ollama's {"error": message}.

A request body must arrive within BODY_TIMEOUT. A prompt longer than the context could hold (inputs.CHARS_PER_TOKEN
characters a token) is refused before it is tokenized, and at most TOKENIZING requests are tokenized at once. The
connections themselves (slow and many clients, a flood of errors) are guarded in listener.py, which runs the app;
what a request may hold, and its errors, is read in api.py.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid

from .errors import CloverError, one_line
from .api import (CHAT_FIELDS, COMPLETION_FIELDS, ApiError, Prompt, check_fields, check_text, choice_body,
                  chunk_choice, error_body, finish_reason, integer_field, logprobs_body, number_field, parse_messages,
                  parse_stops, usage_body)
from .cors import Cors
from .metrics import CountRequests, Metrics
from .ollama_api import Ollama
from .listener import log_error, log_note
from .tools import parse_calls, request_tools, template_message, tool_format
from .worker import Job, Worker

MAX_BODY = 4 << 20  # bytes of one request body
BODY_TIMEOUT = 60.0  # seconds a request body has to arrive in full
TOKENIZING = 2  # requests whose prompt is tokenized at once (the others wait their turn, holding no tokens)
BIG_BODY = 1 << 20  # after a request body this large, freed memory is handed back to the system
MAX_N = 16  # replies to one request ("n"), generated one after another
MAX_TOP_LOGPROBS = 20  # alternatives per token ("top_logprobs", a completion's "logprobs")


# ----------------------------------------------------------------------------------------------- the app

class Server:
    """The app (`self.app`, ASGI) around one loaded Session."""

    def __init__(self, session, api_key: str | None = None, max_new_tokens: int | None = None, writer=None,
                 max_body: int = MAX_BODY, model_id: str | None = None, cors_origins=()):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        self.session, self.api_key, self.max_new_tokens, self.max_body = session, api_key, max_new_tokens, max_body
        self.model_id = model_id or session.resolved.name  # --served-model-name, else the name it was loaded by
        self.created = int(time.time())
        self.worker = Worker(session, writer)
        self.metrics = self.worker.metrics = Metrics(self.worker.status)
        self._tokenizing: asyncio.Semaphore | None = None  # made in the server's event loop
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics_page, methods=["GET"])] + Ollama(self).routes()
        handlers = {ApiError: self._api_error, HTTPException: self._http_error, Exception: self._crash}
        # CORS outside the key's check: a browser's preflight carries no key, and a 401 must reach the page
        self.app = CountRequests(Cors(Guard(Starlette(routes=routes, exception_handlers=handlers), self),
                                      cors_origins), self.metrics)

    def close(self):
        self.worker.stop()

    # --- endpoints

    async def chat(self, request):
        return await self._complete(request, chat=True)

    async def completions(self, request):
        return await self._complete(request, chat=False)

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        from starlette.responses import JSONResponse

        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def health(self, request):
        from starlette.responses import JSONResponse

        s = self.session
        return JSONResponse({"status": "ok", "model": self.model_id, "draft": s.draft_name,
                             "step": s.compiler.describe(), "device": str(s.device), "context": s.max_context,
                             "queue": {"order": "fifo, one request at a time", **self.worker.status()}})

    async def metrics_page(self, request):
        from starlette.responses import Response

        text, kind = self.metrics.page()
        return Response(text, headers={"Content-Type": kind})

    # --- completions

    async def submit(self, body: dict, chat: bool, ignored=()) -> tuple[Job, dict]:
        """Check and tokenize an OpenAI-style request body (off the event loop) and queue it: (its job, the response
        headers). `ignored`: fields the caller (ollama_api.py) accepted and ignored besides the body's own."""
        from starlette.concurrency import run_in_threadpool

        if self._tokenizing is None:
            self._tokenizing = asyncio.Semaphore(TOKENIZING)
        async with self._tokenizing:  # a few at once: each holds its text's tokens meanwhile
            prompt = await run_in_threadpool(self._prompt, body, chat)  # the template and tokenizer, off the loop
        if ignored:
            prompt.ignored = list(ignored) + prompt.ignored
            log_note(f"ignored request fields (clover has no such feature): {', '.join(ignored)}")
        job = Job(prompt, asyncio.get_running_loop())
        headers = {"X-Clover-Queue-Position": str(self.worker.submit(job))}
        if prompt.ignored:
            headers["X-Clover-Ignored"] = ",".join(prompt.ignored)
        return job, headers

    @staticmethod
    def streamed(job: Job, events, headers: dict, media_type: str = "text/event-stream"):
        """The streamed response of a job's `events` (server-sent events, or Ollama's NDJSON)."""
        return EventStream(job, events, {**headers, "Cache-Control": "no-cache"}, media_type)

    async def _complete(self, request, chat: bool):
        from starlette.responses import JSONResponse

        job, headers = await self.submit(await self._json(request), chat)  # a queued request holds its token ids,
        prompt = job.prompt  # not its text
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if prompt.stream:
            return self.streamed(job, self._events(job, rid), headers)
        result = await self.wait(job, request)
        return JSONResponse(self._response(rid, job, result), headers=headers)

    def _prompt(self, body: dict, chat: bool) -> Prompt:
        from .decode.verify import Sampling

        ignored = check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        if body.get("model") is not None and not isinstance(body["model"], str):
            raise ApiError(400, "'model' must be a string", "model")
        # any name is answered by the one model served (clients send names of their own: "gpt-4o", an Ollama tag);
        # the response says which model it was
        s = self.session
        tools = request_tools(body) if chat else None
        if chat:
            messages = parse_messages(body, template_message)
            self._check_size(sum(len(m["content"]) for m in messages), "messages")
            try:
                ids = s.encode_chat(messages, tools)
                bare = s.encode_chat(messages) if tools else None
            except CloverError as e:  # a token the model has no embedding for
                raise ApiError(400, str(e), "messages")
            except Exception as e:  # a template that refuses the conversation (roles out of order, ...)
                raise ApiError(400, f"the chat template refuses these messages: "
                                    f"{one_line(e)}", "messages")
            if tools and ids == bare:
                raise ApiError(400, "this model's chat template does not use tools: it writes the same prompt with "
                                    "them as without (give the model one that does: clover serve --chat-template "
                                    "FILE)", "tools", "unsupported_parameter")
        else:
            text = body.get("prompt")
            if isinstance(text, list) and len(text) == 1:
                text = text[0]
            if not isinstance(text, str) or not text:
                raise ApiError(400, "'prompt' must be a non-empty string", "prompt")
            self._check_size(len(check_text(text, "prompt")), "prompt")
            try:
                ids = s.encode_raw(text)
            except CloverError as e:  # a token the model has no embedding for
                raise ApiError(400, str(e), "prompt")
        limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        if body.get(limit) is None and body.get("n_predict") != -1:  # llama-server's name for it (-1: no limit)
            limit = "n_predict"
        # without one: --max-new-tokens, else up to the end of the context (as OpenAI's and llama-server's APIs)
        max_tokens = integer_field(body, limit, 1, 1_000_000) or self.max_new_tokens or s.max_context
        min_p = number_field(body, "min_p", 0.0, 1.0, 0.0)
        if min_p >= 1.0:
            raise ApiError(400, "'min_p' must be a number in [0, 1), not 1", "min_p")
        penalty = "repetition_penalty"
        if body.get("repeat_penalty") is not None:  # llama-server's name for it
            if body.get(penalty) is not None and body[penalty] != body["repeat_penalty"]:
                raise ApiError(400, "'repeat_penalty' and 'repetition_penalty' are the same setting: give one",
                               "repeat_penalty")
            penalty = "repeat_penalty"
        # no temperature: 1, OpenAI's default (a sampled reply; 0 is greedy)
        sampling = Sampling(number_field(body, "temperature", 0.0, 2.0, 1.0),
                            number_field(body, "top_p", 0.0, 1.0, 1.0, True),
                            integer_field(body, "seed", 0, 2**63 - 1),
                            number_field(body, penalty, 0.0, 10.0, s.default_penalty, True),
                            max(0, integer_field(body, "top_k", -1, 10_000_000) or 0), min_p, _logprobs(body, chat))
        stream = body.get("stream")
        options = body.get("stream_options")
        if stream is not None and not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be true or false", "stream")
        if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}
                                    or not isinstance(options.get("include_usage", False), bool)):
            raise ApiError(400, "'stream_options' is {\"include_usage\": true|false}, with stream true",
                           "stream_options")
        try:
            s.check_fits(ids, max_tokens)
        except CloverError as e:
            raise ApiError(400, str(e), "messages" if chat else "prompt", "context_length_exceeded")
        if ignored:
            log_note(f"ignored request fields (clover has no such feature): {', '.join(ignored)}")
        return Prompt(ids, max_tokens, sampling, parse_stops(body), chat, bool(stream),
                      bool((options or {}).get("include_usage")), ignored, integer_field(body, "n", 1, MAX_N) or 1,
                      tool_format(s.template) if tools else None)

    def _check_size(self, chars: int, param: str):
        """A prompt longer than the context could hold is refused before it is tokenized (inputs.check_text_size)."""
        from .inputs import check_text_size

        try:
            check_text_size(chars, self.session.max_context, "the prompt")
        except CloverError as e:
            raise ApiError(400, str(e), param, "context_length_exceeded")

    async def wait(self, job: Job, request) -> dict:
        """The job's result; a client that hangs up first has its job cancelled."""
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                got = asyncio.ensure_future(job.events.get())
                await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    raise ApiError(499, "the client closed the connection")
                kind, value = got.result()
                if kind == "error":
                    raise value
                if kind == "done":
                    return value
        finally:
            gone.cancel()
            job.cancelled.set()  # a no-op once it is done

    async def _events(self, job: Job, rid: str):
        """Server-sent events of a streamed reply (EventStream cancels the job if they end early): the `n` replies
        one after another, each chunk naming its reply's index; every reply's last chunk (its finish_reason and
        logprobs) once all are done, the last one with clover's figures."""
        p, called = job.prompt, set()
        if p.chat:
            for index in range(p.n):
                yield _sse(self._chunk(rid, p, [chunk_choice(True, index, {"role": "assistant", "content": ""})]))
        while True:
            kind, value = await job.events.get()
            if kind == "delta":
                if not p.tool_format:
                    yield _sse(self._chunk(rid, p, [chunk_choice(p.chat, *value)]))
            elif kind == "choice" and p.tool_format:  # held back until the reply is whole: text, or tool calls
                c = _calls(p, value)
                delta = {"content": c["text"]} if c["text"] else {}
                if c["tool_calls"]:
                    called.add(c["index"])
                    delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(c["tool_calls"])]
                yield _sse(self._chunk(rid, p, [chunk_choice(True, c["index"], delta)]))
            elif kind == "choice":
                if value["tail"]:
                    yield _sse(self._chunk(rid, p, [chunk_choice(p.chat, value["index"], value["tail"])]))
            elif kind == "error":
                yield _sse(error_body(value))
                break
            else:
                for c in value["choices"]:
                    finish = "tool_calls" if c["index"] in called else finish_reason(c["finish"])
                    last = self._chunk(rid, p, [chunk_choice(p.chat, c["index"], None, finish,
                                                             logprobs_body(p.chat, c["logprobs"]))])
                    if c is value["choices"][-1]:
                        last["clover"] = self._clover(job, value)
                    yield _sse(last)
                if p.usage_chunk:
                    yield _sse({**self._chunk(rid, p, []), "usage": usage_body(len(p.ids), value["stats"])})
                break
        yield "data: [DONE]\n\n"

    # --- response bodies

    def _chunk(self, rid: str, p: Prompt, choices: list) -> dict:
        return {"id": rid, "object": "chat.completion.chunk" if p.chat else "text_completion",
                "created": int(time.time()), "model": self.model_id, "choices": choices}

    def _response(self, rid: str, job: Job, result: dict) -> dict:
        p = job.prompt
        return {"id": rid, "object": "chat.completion" if p.chat else "text_completion", "created": int(time.time()),
                "model": self.model_id, "choices": [choice_body(p.chat, _calls(p, c)) for c in result["choices"]],
                "usage": usage_body(len(p.ids), result["stats"]), "clover": self._clover(job, result)}

    def _clover(self, job: Job, result: dict) -> dict:
        per = result["stats"]

        def r(x, n=4):
            return None if x is None else round(x, n)

        return {"tau": r(per.tau), "acceptance_rate": r(per.acceptance_rate), "steps": per.steps,
                "draft_s": r(per.draft_s, 6), "verify_s": r(per.verify_s, 6), "prefill_s": r(per.prefill_s, 6),
                "decode_s": r(per.decode_s, 6), "tokens_per_s": r(per.tokens_per_s, 3),
                "elapsed_s": r(result["elapsed_s"], 6), "queue_s": r(result["queue_s"], 6),
                "draft": self.session.draft_name, "compiled": self.session.compiler.active}

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "clover"}

    def _check_model(self, name):
        if name != self.model_id:
            raise ApiError(404, f"the model {json.dumps(name)[:200]} is not served here; this server serves "
                                f"{json.dumps(self.model_id)} (GET /v1/models)", "model", "model_not_found")

    # --- request bodies and errors

    async def _json(self, request) -> dict:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body:
            raise _too_large(self.max_body)
        from starlette.requests import ClientDisconnect

        data = bytearray()

        async def read():
            async for chunk in request.stream():
                data.extend(chunk)
                if len(data) > self.max_body:
                    raise _too_large(self.max_body)

        try:
            await asyncio.wait_for(read(), BODY_TIMEOUT)
        except ClientDisconnect:
            raise ApiError(499, "the client closed the connection before sending the whole body")
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT:g} s", code="request_timeout")
        if len(data) >= BIG_BODY:
            request.scope["clover.big_body"] = True  # Guard hands the memory back once the request has ended
        try:
            body = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError:
            raise ApiError(400, "the request body is not UTF-8 text", code="invalid_json")
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({getattr(e, 'msg', 'too deeply nested')})",
                           code="invalid_json")
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    async def _api_error(self, request, exc: ApiError):
        return _error_response(exc, request.url.path)

    async def _http_error(self, request, exc):
        status = exc.status_code
        message = {404: f"no such path: {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(status, exc.detail)
        return _error_response(ApiError(status, message, code={404: "not_found", 405: "method_not_allowed"}.get(
            status)), request.url.path)

    async def _crash(self, request, exc):
        return _error_response(ApiError(500, f"internal error ({type(exc).__name__})", kind="server_error"),
                               request.url.path)


class EventStream:
    """A text/event-stream response of `events` (or another streamed type: Ollama's NDJSON); however it ends
    (finished, the client gone, an error), the job is cancelled, so a request nobody reads any more never runs on."""

    def __init__(self, job: Job, events, headers: dict, media_type: str = "text/event-stream"):
        from starlette.responses import StreamingResponse

        self.job = job
        self.response = StreamingResponse(events, media_type=media_type, headers=headers)

    async def __call__(self, scope, receive, send):
        try:
            await self.response(scope, receive, send)
        finally:
            self.job.cancelled.set()


class Guard:
    """ASGI middleware: the API key on every request (constant-time compare), and an unexpected exception one
    line in the server's log, not a traceback (the client has its JSON error already)."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self._authorize(scope)
        except ApiError as e:
            return await _error_response(e, scope["path"])(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        except Exception as e:  # Starlette has answered with a 500 JSON error (Server._crash), or the stream broke
            log_error(one_line(e, kind=True))
        finally:
            if scope.get("clover.big_body"):  # what its text and tokens took, handed back to the system (off the loop)
                from .reply import release_free_memory

                asyncio.get_running_loop().run_in_executor(None, release_free_memory)

    def _authorize(self, scope):
        key = self.server.api_key
        if key is None:
            return
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
        if not hmac.compare_digest(given, key.encode()):
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' with the key the "
                                "server was started with", code="invalid_api_key")


def _error_response(e: ApiError, path: str = ""):
    """The error as JSON: OpenAI's shape, or Ollama's ({"error": message}) under /api/."""
    from starlette.responses import JSONResponse

    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {"Connection": "close"} if e.status == 408 \
        else None
    body = {"error": e.message} if path.startswith("/api/") else error_body(e)
    return JSONResponse(body, status_code=e.status, headers=headers)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def _calls(p: Prompt, choice: dict) -> dict:
    """A chat choice with its tool calls parsed out of its text (tools.py), when the request had tools."""
    if not p.tool_format:
        return choice
    text, calls = parse_calls(choice["text"], p.tool_format)
    return {**choice, "text": text, "tool_calls": calls}


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's logprobs list (0: the token's own only), or None: no logprobs. Chat:
    "logprobs": true and "top_logprobs": k; completions: "logprobs": k."""
    if not chat:
        return integer_field(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    wanted, top = body.get("logprobs"), integer_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, "'logprobs' must be true or false", "logprobs")
    if top is not None and not wanted:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _disconnected(request):
    """Returns when the client closes the connection (the request body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
