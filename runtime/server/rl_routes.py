"""SGLang's HTTP routes for training loops: weight updates (from disk, from a safetensors file, over
a trainer's process group), reading a weight, the weight version, pause and continue. All need
the admin key when one is set (they change what every request gets)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tandem.runtime.frontend.weights import pause_mode, weights_request
from tandem.runtime.server.http_common import control_request, error_response, json_response, read_json
from tandem.runtime.server_args import ServerArgs
from tandem.runtime.value_checks import ValidationError, check_fields

# route -> WeightsReq op
_OPS = {"/update_weights_from_disk": "update_from_disk", "/update_weights_from_tensor": "update_from_tensor",
        "/update_weights_from_distributed": "update_from_distributed",
        "/init_weights_update_group": "init_group", "/destroy_weights_update_group": "destroy_group",
        "/release_memory_occupation": "release_memory", "/resume_memory_occupation": "resume_memory"}


def add_rl_routes(app: FastAPI, args: ServerArgs) -> None:
    for path, op in _OPS.items():
        app.add_api_route(path, _weights_route(args, op), methods=["POST"])

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> Response:
        """The weight as the checkpoint names it, its first `truncate_size` rows as lists."""
        control_request(request, args, needs_admin=True)
        fields, _ = weights_request("get_by_name", await read_json(request, args))
        reply = await app.state.tm.weights("get_by_name", fields)
        return json_response(reply.values) if reply.success else error_response(400, reply.message)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Response:
        control_request(request, args, needs_admin=True)
        body = check_fields(await read_json(request, args), ("new_version", "abort_all_requests"), "update_weight_version")
        version = body.get("new_version")
        if not isinstance(version, str) or not version:
            raise ValidationError("new_version", "must be a non-empty string")
        if body.get("abort_all_requests", False) is True:
            app.state.tm.abort("", abort_all=True)
        app.state.tm.weight_version = version
        return json_response({"success": True, "message": f"weight version is {version!r}"})

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        control_request(request, args, needs_admin=True)
        reply = await app.state.tm.pause(pause_mode(await read_json(request, args)))
        return json_response({"message": "Generation paused successfully.",
                              "num_paused_requests": reply.num_paused_requests})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> Response:
        control_request(request, args, needs_admin=True, json_body=False)
        await app.state.tm.pause("continue")
        return json_response({"message": "Generation continued successfully."})


def _weights_route(args: ServerArgs, op: str):
    async def route(request: Request) -> Response:
        control_request(request, args, needs_admin=True)
        fields, version = weights_request(op, await read_json(request, args))
        reply = await request.app.state.tm.weights(op, fields, version)
        body: dict[str, Any] = {"success": reply.success, "message": reply.message}
        if op.startswith("update_"):
            body["num_paused_requests"] = reply.num_paused_requests
        return json_response(body, 200 if reply.success else 400)
    return route
