"""OpenAI's /v1/embeddings and SGLang's /encode, on a server started with --is-embedding."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tandem.runtime.frontend.embeddings import Pooling, embeddings, encode
from tandem.runtime.frontend.info import served_model_name
from tandem.runtime.model_files import resolve_model_path
from tandem.runtime.server.http_common import json_response, read_json
from tandem.runtime.server_args import ServerArgs


def add_embedding_routes(app: FastAPI, args: ServerArgs) -> None:
    pooling = Pooling.of_model(resolve_model_path(args.model_path)) if args.is_embedding else Pooling()

    @app.post("/v1/embeddings")
    async def v1_embeddings(request: Request) -> Response:
        body = await read_json(request, args)
        return json_response(await embeddings(app.state.tm, body, pooling, served_model_name(args)))

    @app.post("/encode")
    async def encode_route(request: Request) -> Response:
        return json_response(await encode(app.state.tm, await read_json(request, args), pooling))
