"""What a response item shows of one choice, without a server."""
from __future__ import annotations

import time

from tandem.ipc.messages import FinishReason
from tandem.runtime.request_groups import Call, ChoiceState, RequestGroup


def test_e2e_latency_is_the_choices_own_finish_not_when_the_response_is_built():
    call = Call(is_batch=False, indexed=False, received=time.perf_counter() - 1.0)
    group = RequestGroup(logical_rid="r", group_id="g", call=call)
    choice = ChoiceState(rid="g_0", group=group, index=0, prompt_tokens=3, formatter=None, hidden_states=None)
    assert "e2e_latency" not in choice.result()["meta_info"]  # a stream's chunk before the end
    choice.finish_reason, choice.finished_at = FinishReason(type="length"), call.received + 0.25
    time.sleep(0.01)
    first, again = choice.result()["meta_info"]["e2e_latency"], choice.result()["meta_info"]["e2e_latency"]
    assert first == again == 0.25
