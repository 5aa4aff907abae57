"""The SGLang-compatible native HTTP API (FastAPI on uvicorn/uvloop)."""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import orjson
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from tandem.runtime.frontend.tokenize import detokenize, tokenize
from tandem.runtime.frontend.validation import ValidationError, check_dp_rank
from tandem.runtime.server_args import ServerArgs
from tandem.runtime.frontend.request_groups import CallStream, ClientDisconnected, RequestError
from tandem.runtime.server import openai, openai_format, responses_api
from tandem.runtime.reasoning import separate_reasoning, with_stream_reasoning
from tandem.runtime.tools.parse_route import parse_function_call
from tandem.runtime.frontend.info import VERSION, current_loads, health_generate, model_info, served_model_name, server_info
from tandem.runtime.server.auth import ApiKeyMiddleware
from tandem.runtime.server.http_common import control_request, error_response, json_response, read_json
from tandem.runtime.server.openai_request import OpenAIRequest
from tandem.runtime.server.embedding_routes import add_embedding_routes
from tandem.runtime.server.rl_routes import add_rl_routes
from tandem.runtime.frontend.tokenizer_manager import ChildStartError, TokenizerManager

METRICS_SCHEDULER_WAIT_S = 2.0  # a scrape waits this long for the scheduler's gauges
DP_RANK_HEADER = "X-Data-Parallel-Rank"  # SGLang's: pins a request to a DP rank, over the body's

logger = logging.getLogger("tandem.http")


def create_app(args: ServerArgs, on_child_death: Callable[[str], None] | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tm = TokenizerManager(args, on_child_death)
        app.state.startup = asyncio.current_task()  # a signal cancels it (launch.server)
        grpc_server = None
        try:
            if args.grpc_port is not None:  # bound before the children start: a taken port fails now
                from tandem.runtime.server.grpc_server import GrpcAuth, GrpcPortInUse, bind_grpc_server  # lazy

                try:
                    grpc_server = bind_grpc_server(tm, args.host, args.grpc_port,
                                                   GrpcAuth(args.api_key, args.admin_api_key))
                except GrpcPortInUse as exc:  # one line, as a child that refused to start
                    raise ChildStartError(str(exc)) from None
            await tm.start()
            if grpc_server is not None:
                await grpc_server.start()
                logger.info("gRPC (sglang.runtime.v1.SglangService, sglang.grpc.scheduler.SglangScheduler) on %s:%d",
                            args.host, args.grpc_port)
        except ChildStartError as exc:  # launch.server reports it in one line, without uvicorn's traceback
            app.state.start_error = str(exc)
            tm.close()
            raise
        except BaseException:
            tm.close()
            raise
        finally:
            app.state.startup = None
        app.state.tm = tm  # the one reference the routes and launch.server use
        logger.info("tandem is ready on http://%s:%d (OpenAI API: http://%s:%d/v1)", args.host, args.port,
                    args.host, args.port)
        try:
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grace=1.0)
            tm.close()

    docs = {} if args.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(lifespan=lifespan, title="tandem", version=VERSION, **docs)
    app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, admin_api_key=args.admin_api_key)

    @app.exception_handler(ValidationError)
    async def _bad_request(request: Request, exc: ValidationError) -> Response:
        if request.url.path.startswith("/v1/"):
            return json_response(openai_format.error_body(400, str(exc), exc.field), 400)
        return error_response(400, str(exc))

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> Response:
        if request.url.path.startswith("/v1/"):
            return json_response(openai_format.error_body(exc.status_code, exc.message), exc.status_code)
        return error_response(exc.status_code, exc.message)

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; the request was aborted

    @app.api_route("/generate", methods=["POST", "PUT"])  # SGLang serves both
    async def generate(request: Request) -> Response:
        tm = app.state.tm
        body = with_header_dp_rank(await read_json(request, args), header_dp_rank(request))
        if isinstance(body, dict) and body.get("stream"):
            # --incremental-streaming-output: native chunks carry only what is new (SGLang's);
            # the OpenAI and gRPC streams below stay on cumulative chunks, their deltas their own
            return _CallResponse(await tm.generate_stream(body, incremental=args.incremental_streaming_output))
        result = await tm.generate(body, request.is_disconnected)
        if isinstance(body, dict) and (body.get("return_logprob") or body.get("return_hidden_states")):
            # encoding a large logprob / hidden-state answer must not stall the event loop
            return await asyncio.get_running_loop().run_in_executor(None, json_response, result)
        return json_response(result)

    async def openai_call(request: Request, req: OpenAIRequest) -> Response:
        tm = app.state.tm
        req.generate = req.generate.with_dp_rank(header_dp_rank(request))
        n = req.sampling.get("n") or 1
        try:
            if req.stream:
                stream = await tm.generate_stream(req.generate, req.add_special_tokens, typed=True)
                openai.decode_echo(req, tm.tokenizer)  # the ids passed validation: they are token ids
                if req.kind == "response":  # named events, no [DONE], as SGLang's responses stream
                    return _CallResponse(stream, responses_api.responses_events(req, stream), named=True)
                return _CallResponse(stream, openai_format.stream_chunks(req, stream, n))
            choices = await tm.generate_choices(req.generate, request.is_disconnected, req.add_special_tokens)
        except ValidationError as exc:
            raise req.rename(exc) from None
        openai.decode_echo(req, tm.tokenizer)
        if req.kind == "response":
            return json_response(responses_api.responses_response(req, choices[0]))
        if req.logprobs:  # a large logprob answer is built and encoded off the event loop
            return await asyncio.get_running_loop().run_in_executor(
                None, lambda: json_response(openai_format.response(req, choices, n)))
        return json_response(openai_format.response(req, choices, n))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = openai.completion_request(await read_json(request, args), served_name())
        req.include_usage |= args.stream_response_default_include_usage
        return await openai_call(request, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        tm = app.state.tm
        body = await read_json(request, args)
        req = openai.chat_request(body, served_name(), tm.render_chat, args.reasoning_parser,
                                  tm.chat_sampling_defaults, tm.chat_content_format, args.tool_call_parser,
                                  args.chat_template_defaults)
        req.reasoning = with_stream_reasoning(req.reasoning, body)
        req.include_usage |= args.stream_response_default_include_usage
        return await openai_call(request, req)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        tm = app.state.tm
        req = responses_api.responses_request(await read_json(request, args), served_name(), tm.render_chat,
                                              args.reasoning_parser, tm.chat_sampling_defaults, tm.chat_content_format,
                                              args.tool_call_parser, args.chat_template_defaults)
        return await openai_call(request, req)

    async def tokenize_route(request: Request) -> Response:
        return json_response(await tokenize(app.state.tm, await read_json(request, args)))

    async def detokenize_route(request: Request) -> Response:
        return json_response(await detokenize(app.state.tm, await read_json(request, args)))

    @app.post("/separate_reasoning")
    async def separate_reasoning_route(request: Request) -> Response:
        return json_response(separate_reasoning(await read_json(request, args)))

    @app.post("/parse_function_call")
    async def parse_function_call_route(request: Request) -> Response:
        return json_response(parse_function_call(await read_json(request, args)))

    for path in ("/tokenize", "/v1/tokenize"):  # SGLang answers both
        app.add_api_route(path, tokenize_route, methods=["POST"])
    for path in ("/detokenize", "/v1/detokenize"):
        app.add_api_route(path, detokenize_route, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        tm = getattr(app.state, "tm", None)
        if tm is None or (reason := tm.not_serving()) is not None:
            return error_response(503, "starting" if tm is None else reason)
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness probe: 200 when a request sent now is served at once; 503 with the reason while
        starting, draining after SIGTERM, after a child died, or while generation is paused."""
        tm = getattr(app.state, "tm", None)
        if tm is None:
            return error_response(503, "starting")
        if (reason := tm.not_serving()) is not None:
            return error_response(503, reason)
        if tm.paused:  # pause_generation; continue_generation clears it
            return error_response(503, "generation is paused (pause_generation); continue_generation resumes it")
        return json_response({"status": "ready"})

    @app.get("/health_generate")
    async def health_generate_route() -> Response:
        """A one-token generation through every process; 503 when it does not finish in time, or
        at once while generation is paused (pause_generation: it would wait for continue)."""
        if app.state.tm.paused:
            return error_response(503, "generation is paused (pause_generation); continue_generation resumes it")
        try:
            await health_generate(app.state.tm, args.health_generate_timeout)
        except asyncio.TimeoutError:
            return error_response(503, f"a 1-token generation did not finish within {args.health_generate_timeout:g} s")
        return Response(status_code=200)

    def served_name() -> str:
        return served_model_name(args)

    async def get_model_info() -> dict[str, Any]:
        return model_info(app.state.tm)

    async def get_server_info() -> dict[str, Any]:
        return await server_info(app.state.tm)

    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, get_model_info, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, get_server_info, methods=["GET"])

    def model_card() -> dict[str, Any]:
        return {"id": served_name(), "object": "model", "created": 0,
                "owned_by": "sglang",  # the gateway treats the worker as SGLang's
                "root": served_name(), "max_model_len": app.state.tm.model_info["context_len"]}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> Response:
        if model != served_name():
            return json_response(openai_format.error_body(404, f"the model {model!r} does not exist", "model"), 404)
        return json_response(model_card())

    @app.get("/v1/loads")
    async def v1_loads(request: Request) -> dict[str, Any]:
        include = request.query_params.get("include")
        sections = None if include is None else {s.strip() for s in include.split(",") if s.strip()}
        return await current_loads(app.state.tm, sections or None)

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        """SGLang's legacy load route (deprecated there for /v1/loads, which it is a view of):
        one entry per DP rank in its old field names, which older routers still poll."""
        loads = (await current_loads(app.state.tm, {"core"}))["loads"]
        return [{"dp_rank": x["dp_rank"], "num_reqs": x["num_total_reqs"], "num_waiting_reqs": x["num_waiting_reqs"],
                 "num_tokens": x["num_used_tokens"], "ts_tic": time.perf_counter()} for x in loads]

    @app.api_route("/flush_cache", methods=["GET", "POST"])  # SGLang's; its gateway POSTs no body
    async def flush_cache(request: Request) -> Response:
        control_request(request, args, needs_admin=True, json_body=False)
        reply = await app.state.tm.flush_cache()
        if reply.success:
            return PlainTextResponse("Cache flushed.\n")
        return error_response(400, f"cache not flushed: {reply.message}")

    add_rl_routes(app, args)
    add_embedding_routes(app, args)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        control_request(request, args, needs_admin=False)
        body = await read_json(request, args)
        if not isinstance(body, dict):
            raise ValidationError("body", "must be a JSON object")
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str):
            raise ValidationError("rid", "must be a string")
        if not isinstance(abort_all, bool):
            raise ValidationError("abort_all", "must be a boolean")
        if abort_all:
            control_request(request, args, needs_admin=True)
        if rid or abort_all:  # exact rid; an unknown or empty rid aborts nothing
            app.state.tm.abort(rid, abort_all)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        """The request metrics are this process's own; the scheduler's gauges are asked for, and
        keep their last values when it is busy in a long step (a scrape never fails for it,
        as SGLang's never waits on its scheduler)."""
        tm = getattr(app.state, "tm", None)
        if tm is None:  # a scraper may come before the model has loaded
            return error_response(503, "starting")
        try:
            tm.metrics.update_from_scheduler(await tm.server_info(timeout=METRICS_SCHEDULER_WAIT_S))
        except RequestError:
            pass
        return Response(tm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def header_dp_rank(request: Request) -> int | None:
    """SGLang's X-Data-Parallel-Rank header, read on every generation route so a DP-aware gateway
    pins a request without touching its body: not an integer, or not this server's one rank, is a
    400 naming the header (a pin never falls back to another rank)."""
    value = request.headers.get(DP_RANK_HEADER)
    if value is None:
        return None
    try:
        rank = int(value)
    except ValueError:
        raise ValidationError(DP_RANK_HEADER, f"must be an integer, got {value[:50]!r}") from None
    check_dp_rank(DP_RANK_HEADER, rank)
    return rank


def with_header_dp_rank(body: Any, rank: int | None) -> Any:
    """The header's rank wins over the body's routed_dp_rank and its deprecated data_parallel_rank,
    as SGLang's; a body that is not an object is left for validation to refuse."""
    if rank is None or not isinstance(body, dict):
        return body
    return {**{k: v for k, v in body.items() if k != "data_parallel_rank"}, "routed_dp_rank": rank}


class _CallResponse(StreamingResponse):
    """Server-sent events of a streamed call, which it ends however the response ends: finished,
    failed, the client gone mid-stream, or cancelled before the first chunk was asked for."""

    def __init__(self, stream: CallStream, events: AsyncIterator[dict] | None = None, named: bool = False) -> None:
        """`events`: what is sent, built from `stream` (default: the stream's own chunks); `named`:
        Responses API events, each under its type's name."""
        super().__init__(_sse(stream if events is None else events, named), media_type="text/event-stream")
        self._stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stream.aclose()


async def _sse(events: AsyncIterator[dict], named: bool = False) -> AsyncIterator[bytes]:
    async for event in events:
        head = b"event: " + event["type"].encode() + b"\n" if named else b""
        yield head + b"data: " + orjson.dumps(event, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n"
    if not named:
        yield b"data: [DONE]\n\n"
