"""`tandem serve` / `python -m tandem.launch.server`: start the HTTP server and its child processes."""
from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from tandem.runtime.server.http import create_app
from tandem.runtime.server_args import ServerArgs


def run_server(args: ServerArgs) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(message)s")
    died: list[str] = []
    server: uvicorn.Server | None = None

    def on_child_death(reason: str) -> None:
        died.append(reason)
        if server is not None:
            server.should_exit = True  # in-flight requests already got their error responses

    app = create_app(args, on_child_death)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            loop="uvloop", timeout_graceful_shutdown=5, access_log=False)
    server = uvicorn.Server(config)
    server.run()
    if died:
        logging.error("tandem server stopped: %s", died[0])
        return 1
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem serve", description="Serve a model over SGLang's native HTTP API")
    ServerArgs.add_cli_args(parser)
    return run_server(ServerArgs.from_cli_args(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
