"""What a response item shows of one choice, without a server."""
from __future__ import annotations

import time

import numpy as np

from tandem.ipc.messages import FinishReason, LogprobArrays, ReqCounters, SpecCounts
from tandem.runtime.frontend.request_groups import INCREMENTAL_META_KEYS, Call, ChoiceState, RequestError, RequestGroup
from tandem.runtime.sampling.logprob_format import LogprobFormatOptions, LogprobFormatter
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


def test_spec_fields_are_sglangs_and_only_on_a_finished_answer_with_a_verify():
    """SGLang's fill_spec_decoding_meta runs on the finished answer only, and only after a verify;
    num_retractions and reasoning_tokens are on every answer; a plain server sends no spec field."""
    choice = _choice(Call(is_batch=False, indexed=False, received=time.perf_counter()))
    choice.finish_reason = FinishReason(type="length", length=8)
    assert not any(k.startswith("spec_") for k in choice.result()["meta_info"])  # plain server
    choice.finish_reason = None
    spec = SpecCounts(verify_ct=4, proposed=12, accepted=3, accept_histogram=[2, 1, 1])
    choice.counters = ReqCounters(completion_tokens=8, cached_tokens=0, spec=spec)
    meta = choice.result()["meta_info"]
    assert not any(k.startswith("spec_") for k in meta)  # a stream's earlier chunk
    assert (meta["num_retractions"], meta["reasoning_tokens"]) == (0, 0)
    choice.finish_reason = FinishReason(type="length", length=8)
    meta = choice.result()["meta_info"]
    assert {k: v for k, v in meta.items() if k.startswith("spec_")} == {
        "spec_accept_rate": 0.25, "spec_accept_length": 2.0, "spec_verify_ct": 4, "spec_accept_token_num": 3,
        "spec_draft_token_num": 12, "spec_num_correct_drafts": 3, "spec_num_proposed_drafts": 12,
        "spec_accept_histogram": [2, 1, 1]}
    # finished in its prefill: no verify, no spec fields
    choice.counters.spec = SpecCounts(verify_ct=0, proposed=0, accepted=0, accept_histogram=[])
    assert not any(k.startswith("spec_") for k in choice.result()["meta_info"])


def _positions(ids: list[int], null_prefix: int = 0) -> LogprobArrays:
    n = len(ids)
    return LogprobArrays(token_logprobs=-np.arange(1, n + 1, dtype=np.float32), token_ids=np.asarray(ids, np.int32),
                         top_vals=np.full((n, 2), -0.5, np.float32),
                         top_idx=np.tile(np.asarray([3, 4], np.int32), (n, 1)),
                         ids_logprobs=np.full((n, 1), -2.0, np.float32), null_prefix=null_prefix)


def _logprob_choice() -> ChoiceState:
    choice = _choice(Call(is_batch=False, indexed=False, received=time.perf_counter()))
    choice.formatter = LogprobFormatter(LogprobFormatOptions(top_logprobs_num=2, token_ids_logprob=(7,)))
    choice.hidden_states = []
    return choice


def _receive(choice: ChoiceState, text: str, ids: list[int], finished: bool = False) -> None:
    """What TokenizerManager._apply does with one detokenizer output of this choice."""
    choice.text += text
    choice.output_ids.extend(ids)
    choice.formatter.extend_output(_positions(ids))
    choice.hidden_states.extend([[float(i)] for i in ids])
    choice.counters = ReqCounters(completion_tokens=len(choice.output_ids), cached_tokens=0)
    if finished:
        choice.finish_reason, choice.finished_at = FinishReason(type="length"), time.perf_counter()


def test_incremental_chunks_join_into_the_whole_answer_as_sglangs():
    """--incremental-streaming-output, as SGLang's slice_streaming_output_meta_info: a chunk has
    the text, output_ids and output logprob lists new since the previous chunk (outputs that
    arrived while the consumer was busy join into one); the prompt's logprobs, the logprob count
    and hidden_states stay whole in every chunk; the joined chunks are the non-streamed answer."""
    choice = _logprob_choice()
    choice.formatter.extend_input(_positions([1, 2, 3], null_prefix=1))
    _receive(choice, "He", [10])
    chunks = [choice.incremental_result()]
    _receive(choice, "llo", [11, 12])
    _receive(choice, "", [13])  # a stop string held back: ids without text yet
    chunks.append(choice.incremental_result())
    chunks.append(choice.incremental_result())  # nothing new: an empty delta
    _receive(choice, " w", [14], finished=True)
    chunks.append(choice.incremental_result())
    whole = choice.result()
    assert [c["output_ids"] for c in chunks] == [[10], [11, 12, 13], [], [14]]
    assert "".join(c["text"] for c in chunks) == whole["text"] == "Hello w"
    assert [i for c in chunks for i in c["output_ids"]] == whole["output_ids"]
    for key in INCREMENTAL_META_KEYS:
        assert [row for c in chunks for row in c["meta_info"][key]] == whole["meta_info"][key], key
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert meta["input_token_logprobs"] == whole["meta_info"]["input_token_logprobs"]
        assert meta["input_top_logprobs"] == whole["meta_info"]["input_top_logprobs"]
        assert meta["output_token_logprobs_length"] == len(meta["hidden_states"])  # both cumulative
    assert chunks[-1]["meta_info"]["hidden_states"] == whole["meta_info"]["hidden_states"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_incremental_chunks_leave_the_cumulative_ones_unchanged():
    """result() (non-streamed answers, cumulative streams, the OpenAI streams' source) is the
    whole answer however many incremental chunks were taken before it."""
    choice = _logprob_choice()
    _receive(choice, "a", [5])
    choice.incremental_result()
    _receive(choice, "b", [6])
    assert (choice.result()["text"], choice.result()["output_ids"]) == ("ab", [5, 6])
    assert len(choice.result()["meta_info"]["output_token_logprobs"]) == 2
    assert choice.incremental_result()["output_ids"] == [6]
