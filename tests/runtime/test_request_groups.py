"""What a response item shows of one choice, without a server."""
from __future__ import annotations

import time

from tandem.ipc.messages import FinishReason
from tandem.runtime.request_groups import Call, ChoiceState, RequestError, RequestGroup
from tandem.runtime.value_checks import ValidationError


def _choice(call: Call) -> ChoiceState:
    group = RequestGroup(logical_rid="r", group_id="g", call=call)
    return ChoiceState(rid="g_0", group=group, index=0, prompt_tokens=3, formatter=None, hidden_states=None)


def test_e2e_latency_is_the_choices_own_finish_not_when_the_response_is_built():
    call = Call(is_batch=False, indexed=False, received=time.perf_counter() - 1.0)
    choice = _choice(call)
    assert "e2e_latency" not in choice.result()["meta_info"]  # a stream's chunk before the end
    choice.finish_reason, choice.finished_at = FinishReason(type="length"), call.received + 0.25
    time.sleep(0.01)
    first, again = choice.result()["meta_info"]["e2e_latency"], choice.result()["meta_info"]["e2e_latency"]
    assert first == again == 0.25


def test_a_scheduler_error_that_names_a_field_is_a_validation_error_each_surface_can_rename():
    choice = _choice(Call(is_batch=False, indexed=False, received=time.perf_counter()))
    assert choice.error() is None
    choice.finish_reason = FinishReason.bad_request("sampling_params.regex", "does not compile: x")
    err = choice.error()
    assert isinstance(err, ValidationError) and (err.field, err.message) == ("sampling_params.regex",
                                                                             "does not compile: x")
    assert choice.result()["meta_info"]["finish_reason"]["message"] == str(err)  # native: one message
    choice.finish_reason = FinishReason(type="abort", status_code=503, message="full")
    assert isinstance(choice.error(), RequestError) and choice.error().status_code == 503
    choice.finish_reason = FinishReason(type="abort", status_code=200, message="aborted by the client")
    assert choice.error() is None  # an abort the client asked for is no error


def test_spec_fields_as_sglang_zeros_before_a_first_verify_none_on_a_plain_server():
    choice = _choice(Call(is_batch=False, indexed=False, received=time.perf_counter()))
    assert "spec_verify_ct" not in choice.result()["meta_info"]
    choice.completion_tokens, choice.spec_counts = 1, (0, 0, 0)
    meta = choice.result()["meta_info"]
    assert (meta["spec_verify_ct"], meta["spec_accept_length"], meta["spec_accept_rate"]) == (0, 0, 0.0)
    choice.completion_tokens, choice.spec_counts = 7, (2, 6, 4)
    meta = choice.result()["meta_info"]
    assert (meta["spec_verify_ct"], meta["spec_accept_length"], meta["spec_accept_rate"]) == (2, 3.5, 0.6667)
