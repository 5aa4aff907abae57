"""What one client can hold: idle and trickling connections are closed after --http-read-timeout,
a body that never completes is a 408, and --max-connections bounds the rest with 503s."""
from __future__ import annotations

import socket
import time

import pytest

from server_utils import start_server

pytestmark = pytest.mark.timeout(300)  # a server start may take 180 s (server_utils)


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory, tiny_model_dir):
    logs = tmp_path_factory.mktemp("strict")
    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "2000",
                           "--http-read-timeout", "1", "--max-connections", "12"], str(logs / "server.log"))
    yield server
    server.stop()


def _connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(5)
    return sock


def _response(sock: socket.socket) -> bytes:
    """One whole HTTP response: the head, then content-length bytes of body (they may come in
    separate segments)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_idle_and_partial_head_connections_are_closed(strict_server):
    idle = [_connect(strict_server) for _ in range(4)]
    partial = [_connect(strict_server) for _ in range(4)]
    for sock in partial:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-")  # and never finishes the head
    time.sleep(1.6)
    for sock in idle + partial:
        assert sock.recv(65536) == b"", "the server kept a connection without a request head open"
        sock.close()
    assert strict_server.get("/health").status_code == 200


def test_a_body_that_never_completes_is_a_408(strict_server):
    sock = _connect(strict_server)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"text\": ")
    reply = _response(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:100]
    assert b"--http-read-timeout" in reply
    sock.close()


def test_declared_oversized_body_is_refused_before_it_is_read(strict_server):
    sock = _connect(strict_server)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 999999999999\r\n\r\n")
    reply = _response(sock)
    assert reply.startswith(b"HTTP/1.1 400") and b"max-request-bytes" in reply
    sock.close()


def test_connections_beyond_the_limit_get_503_and_recover(strict_server):
    held = [_connect(strict_server) for _ in range(14)]
    try:
        resp = strict_server.get("/health")
        assert resp.status_code == 503
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert strict_server.get("/health").status_code == 200
