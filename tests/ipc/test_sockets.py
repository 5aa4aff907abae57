"""Sockets: fresh ipc addresses, PUSH/PULL round trips, sync and asyncio receive."""
from __future__ import annotations

import asyncio
import os
import pickle
from collections.abc import Iterator

import numpy as np
import pytest
import zmq
import zmq.asyncio

from tandem.ipc.messages import AbortReq, BatchTokenIDOutput, DetokenizeParams, FlushCacheReply, ReqCounters
from tandem.ipc.sockets import (
    IPCAddresses,
    async_recv,
    async_send,
    bind_pull,
    connect_push,
    recv,
    recv_all_nowait,
    send,
)

RECV_TIMEOUT_MS = 5000


@pytest.fixture
def addrs() -> Iterator[IPCAddresses]:
    a = IPCAddresses.fresh()
    yield a
    a.cleanup()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _endpoints(a: IPCAddresses) -> list[str]:
    return [
        a.tokenizer_to_scheduler,
        a.scheduler_to_detokenizer,
        a.detokenizer_to_tokenizer,
        a.scheduler_to_tokenizer,
    ]


def test_fresh_addresses_are_private_and_distinct(addrs: IPCAddresses) -> None:
    other = IPCAddresses.fresh()
    try:
        assert os.path.isdir(addrs.root) and addrs.root != other.root
        assert os.path.basename(addrs.root).startswith(f"tandem-{os.getpid()}-")
        eps = _endpoints(addrs)
        assert len(set(eps)) == 4
        for ep in eps:
            assert ep.startswith("ipc://" + addrs.root + os.sep) and len(ep) < 107
    finally:
        other.cleanup()


def test_addresses_are_frozen_and_picklable(addrs: IPCAddresses) -> None:
    assert pickle.loads(pickle.dumps(addrs)) == addrs
    with pytest.raises(AttributeError):
        addrs.root = "/elsewhere"  # type: ignore[misc]


def test_cleanup_removes_dir_with_live_socket_files(ctx: zmq.Context) -> None:
    a = IPCAddresses.fresh()
    sock = bind_pull(ctx, a.tokenizer_to_scheduler)
    assert os.listdir(a.root)  # the bound socket file exists
    sock.close()
    a.cleanup()
    assert not os.path.exists(a.root)
    a.cleanup()  # idempotent


def test_push_pull_round_trip(addrs: IPCAddresses, ctx: zmq.Context) -> None:
    pull = bind_pull(ctx, addrs.scheduler_to_detokenizer)
    push = connect_push(ctx, addrs.scheduler_to_detokenizer)
    ids = np.array([4, 5, 6], dtype="<i4")
    out = BatchTokenIDOutput(
        rids=["r"], finished_reasons=[None], new_token_ids=[ids], counters=[ReqCounters(completion_tokens=3, cached_tokens=0)],
        detokenize_params=[DetokenizeParams()],
    )
    send(push, out)
    assert pull.poll(RECV_TIMEOUT_MS)
    got = recv(pull)
    assert isinstance(got, BatchTokenIDOutput) and got.rids == ["r"]
    assert got.new_token_ids[0].dtype == np.dtype("<i4")
    np.testing.assert_array_equal(got.new_token_ids[0], ids)
    push.close()
    pull.close()


def test_nonblocking_recv_and_drain(addrs: IPCAddresses, ctx: zmq.Context) -> None:
    pull = bind_pull(ctx, addrs.tokenizer_to_scheduler)
    push = connect_push(ctx, addrs.tokenizer_to_scheduler)
    assert recv(pull, block=False) is None
    assert recv_all_nowait(pull) == []
    for i in range(5):
        send(push, AbortReq(group_prefixes=[f"r{i}"]))
    assert pull.poll(RECV_TIMEOUT_MS)
    got: list = []
    # all five are in flight; drain until they have arrived
    while len(got) < 5 and pull.poll(RECV_TIMEOUT_MS):
        got.extend(recv_all_nowait(pull))
    assert [g.group_prefixes for g in got] == [[f"r{i}"] for i in range(5)]
    push.close()
    pull.close()


def test_send_before_receiver_binds_is_delivered(addrs: IPCAddresses, ctx: zmq.Context) -> None:
    # children may start pushing before the main process has bound; nothing may be lost
    push = connect_push(ctx, addrs.scheduler_to_tokenizer)
    send(push, FlushCacheReply(req_id=1, success=True, message="early"))
    pull = bind_pull(ctx, addrs.scheduler_to_tokenizer)
    assert pull.poll(RECV_TIMEOUT_MS)
    assert recv(pull) == FlushCacheReply(req_id=1, success=True, message="early")
    push.close()
    pull.close()


def test_asyncio_round_trip(addrs: IPCAddresses) -> None:
    async def main() -> list:
        actx = zmq.asyncio.Context()
        try:
            pull = bind_pull(actx, addrs.detokenizer_to_tokenizer)
            push = connect_push(actx, addrs.detokenizer_to_tokenizer)
            await async_send(push, AbortReq(group_prefixes=["a"]))
            send_sync_ctx = zmq.Context()
            sync_push = connect_push(send_sync_ctx, addrs.detokenizer_to_tokenizer)
            send(sync_push, AbortReq(group_prefixes=["b"]))
            got = [await asyncio.wait_for(async_recv(pull), 5) for _ in range(2)]
            sync_push.close()
            send_sync_ctx.term()
            push.close()
            pull.close()
            return got
        finally:
            actx.term()

    got = asyncio.run(main())
    assert sorted(g.group_prefixes[0] for g in got) == ["a", "b"]
