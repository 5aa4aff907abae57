"""ControlReplies without processes: replies reach their askers by req_id, late ones are dropped,
a timeout is a 503 and a dead child fails every asker at once."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from tandem.runtime.frontend.control_replies import ControlReplies
from tandem.runtime.frontend.request_groups import RequestError


@dataclass
class Reply:
    req_id: int
    value: str


def test_replies_reach_their_askers_by_req_id_and_late_ones_are_dropped() -> None:
    async def run() -> list[str]:
        replies, sent = ControlReplies(), []
        first = asyncio.ensure_future(replies.ask(sent.append, lambda req_id: req_id, 5))
        second = asyncio.ensure_future(replies.ask(sent.append, lambda req_id: req_id, 5))
        await asyncio.sleep(0)
        replies.deliver(Reply(sent[1], "b"))
        replies.deliver(Reply(sent[0], "a"))
        answers = [(await first).value, (await second).value]
        replies.deliver(Reply(sent[0], "late"))  # nobody waits for it any more
        return answers

    assert asyncio.run(run()) == ["a", "b"]


def test_no_reply_is_a_503_and_a_dead_child_fails_every_asker() -> None:
    async def run() -> None:
        replies = ControlReplies()
        with pytest.raises(RequestError) as timed_out:
            await replies.ask(lambda msg: None, lambda req_id: req_id, 0.01)
        assert timed_out.value.status_code == 503
        waiting = [asyncio.ensure_future(replies.ask(lambda msg: None, lambda req_id: req_id, 5)) for _ in range(2)]
        await asyncio.sleep(0)
        replies.fail_all("the scheduler died")
        for fut in waiting:
            with pytest.raises(RequestError, match="the scheduler died"):
                await fut

    asyncio.run(run())
