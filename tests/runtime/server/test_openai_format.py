"""Native /generate results -> OpenAI response, stream chunk and error shapes, without a server."""
from __future__ import annotations

import asyncio

from call_fakes import result, stream_of

from tandem.runtime.frontend.request_groups import RequestError
from tandem.runtime.server import openai as oa
from tandem.runtime.server import openai_format as oar
from tandem.runtime.reasoning import with_stream_reasoning
from tandem.runtime.value_checks import ValidationError


def _completion(body: dict) -> oa.OpenAIRequest:
    return oa.completion_request(body, "served")  # text prompts: their echo needs no decode


def _chat(body: dict) -> oa.OpenAIRequest:
    return oa.chat_request(body, "served", lambda messages, kw: "<prompt>")


def test_response_shapes_and_usage_count_each_prompt_once():
    stop = {"type": "stop", "matched": "\n"}
    results = [result("ab", 0, finish=stop), result("cd", 1, finish=stop), result("ef", 2, prompt=7,
                                                                                       finish={"type": "length"})]
    req = _completion({"prompt": ["p", "q"], "echo": True, "logprobs": 1})
    # two prompts, n = 2 for the first only in this toy; prompts counted at choices 0 and 2
    out = oar.response(req, results, 2)
    assert out["usage"] == {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18, "reasoning_tokens": 0,
                            "completion_tokens_details": {"reasoning_tokens": 0},
                            "prompt_tokens_details": {"cached_tokens": 2}}
    first = out["choices"][0]
    assert first["text"] == "pab" and first["finish_reason"] == "stop" and first["matched_stop"] == "\n"
    # echo + logprobs: the prompt's tokens are scored first (the very first has no logprob)
    assert first["logprobs"] == {"tokens": ["p", "q", "a", "b"], "token_logprobs": [None, -3.0, -0.5, -1.0],
                                 "top_logprobs": [None, {"r": -0.1}, {"a": -0.5, "z": -2.0}, {"b": -1.0}],
                                 "text_offset": [0, 1, 2, 3]}
    assert _completion({"prompt": "p", "echo": True, "logprobs": 0}).native["logprob_start_len"] == 0
    plain = oar.response(_completion({"prompt": ["p", "q"], "logprobs": 1}), results, 2)["choices"][0]["logprobs"]
    assert plain == {"tokens": ["a", "b"], "token_logprobs": [-0.5, -1.0],
                     "top_logprobs": [{"a": -0.5, "z": -2.0}, {"b": -1.0}], "text_offset": [0, 1]}
    assert out["choices"][2]["finish_reason"] == "length" and out["choices"][2]["text"] == "qef"
    chat = oar.response(_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True}), results[:1], 1)
    # SGLang's message always has reasoning_content and tool_calls (null): clients read them unguarded
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "ab", "reasoning_content": None,
                                             "reasoning": None, "tool_calls": None}
    assert chat["choices"][0]["logprobs"]["content"][0] == {"token": "a", "logprob": -0.5, "bytes": [97],
                                                            "top_logprobs": [{"token": "a", "logprob": -0.5,
                                                                              "bytes": [97]},
                                                                             {"token": "z", "logprob": -2.0,
                                                                              "bytes": [122]}]}


def test_streamed_echo_scores_the_prompt_in_the_first_chunk_only():
    def cumulative():
        return stream_of(result("a", 0, completion=1), result("ab", 0, completion=2, finish={"type": "length"}))

    req = _completion({"prompt": "pq", "echo": True, "logprobs": 0, "stream": True})

    async def collect():
        return [c["choices"][0] async for c in oar.stream_chunks(req, cumulative(), 1)]

    first, second = asyncio.run(collect())
    assert first["text"] == "pqa" and first["logprobs"]["tokens"] == ["p", "q", "a"]
    assert first["logprobs"]["text_offset"] == [0, 1, 2] and first["logprobs"]["token_logprobs"][0] is None
    assert second["text"] == "b" and second["logprobs"]["tokens"] == ["b"] and second["logprobs"]["text_offset"] == [3]


def test_a_stream_that_fails_ends_with_an_error_chunk():
    """The native stream's last chunk of a failed request is SGLang's usual shape with an abort
    finish_reason carrying the status; the OpenAI stream turns it into an error chunk."""
    def cumulative(error: RequestError | ValidationError):
        abort = {"type": "abort", "message": str(error), "status_code": 400, "err_type": "BadRequest"}
        return stream_of(result("a", 0, completion=1), result("a", 0, completion=1, finish=abort), error=error)

    req = _chat({"messages": [{"role": "user", "content": "x"}], "stream": True,
                 "response_format": {"type": "json_object"}})

    async def collect(error: RequestError | ValidationError):
        return [c async for c in oar.stream_chunks(req, cumulative(error), 1)]

    *deltas, last = asyncio.run(collect(RequestError(503, "queue full")))
    assert [d["choices"][0]["delta"] for d in deltas] == [{"role": "assistant", "content": ""}, {"content": "a"}]
    assert last["error"] == {"message": "queue full", "type": "ServiceUnavailableError", "param": None, "code": 503}
    # a field the scheduler found bad is named as the client sent it
    *_, last = asyncio.run(collect(ValidationError("sampling_params.json_schema", "does not compile: x")))
    assert last["error"] == {"message": "response_format does not compile: x", "type": "BadRequestError",
                             "param": "response_format", "code": 400}


def test_stream_chunks_are_the_role_then_deltas_then_the_finish_then_usage():
    """SGLang's (and OpenAI's) chat stream: the role's chunk with empty content, the text deltas
    (no finish reason), then a finish chunk with an empty delta; continuous usage rides on the
    text deltas only, as SGLang's."""
    def cumulative():
        return stream_of(result("a", 0, completion=1),
                       result("ab", 0, completion=2, finish={"type": "stop", "matched": 2}))

    req = _chat({"messages": [{"role": "user", "content": "x"}], "stream": True,
                 "stream_options": {"include_usage": True}})

    async def collect():
        return [c async for c in oar.stream_chunks(req, cumulative(), 1)]

    chunks = asyncio.run(collect())
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}, {}]
    assert [(c["choices"][0]["finish_reason"], c["choices"][0]["matched_stop"]) for c in chunks[:-1]] == \
        [(None, None), (None, None), (None, None), ("stop", 2)]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all("usage" not in c for c in chunks[:-1])
    # continuous_usage_stats: every chunk also carries its choice's counts so far
    req.continuous_usage = True
    chunks = asyncio.run(collect())
    assert [c.get("usage", {}).get("completion_tokens") for c in chunks] == [None, 1, 2, None, 2]


def test_a_chat_stream_of_n_choices_sends_every_finish_after_all_text():
    """As SGLang's: with n > 1 the finish chunks come once every choice's text is out, one per
    choice in the order they finished, then the usage (each prompt counted once)."""
    stop, length = {"type": "stop", "matched": "."}, {"type": "length"}
    items = [result("a", 1, completion=1), result("ab", 1, completion=2, finish=stop),
             result("c", 0, completion=1), result("cd", 0, completion=2, finish=length)]
    req = _chat({"messages": [{"role": "user", "content": "x"}], "n": 2, "stream": True,
                 "stream_options": {"include_usage": True}})

    async def collect():
        return [c async for c in oar.stream_chunks(req, stream_of(*items), 2)]

    *chunks, last = asyncio.run(collect())
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
            for c in chunks] == [(1, {"role": "assistant", "content": ""}, None), (1, {"content": "a"}, None),
                                 (1, {"content": "b"}, None), (0, {"role": "assistant", "content": ""}, None),
                                 (0, {"content": "c"}, None), (0, {"content": "d"}, None), (1, {}, "stop"),
                                 (0, {}, "length")]
    assert chunks[-2]["choices"][0]["matched_stop"] == "."
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == 5 and last["usage"]["completion_tokens"] == 4


def test_usage_carries_sglangs_reasoning_tokens_summed_over_choices():
    """SGLang's UsageInfo.reasoning_tokens: every choice's meta_info.reasoning_tokens, summed (the
    prompt counted once); on the final usage chunk and continuous usage too."""
    results = [result("ab", 0), result("cd", 1)]
    results[0]["meta_info"]["reasoning_tokens"], results[1]["meta_info"]["reasoning_tokens"] = 2, 1
    body = {"messages": [{"role": "user", "content": "x"}], "n": 2}
    assert oar.response(_chat(body), results, 2)["usage"]["reasoning_tokens"] == 3
    req = _chat({**body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})

    async def collect():
        return [c async for c in oar.stream_chunks(req, stream_of(*results), 2)]

    chunks = [c for c in asyncio.run(collect()) if "usage" in c]
    assert [c["usage"]["reasoning_tokens"] for c in chunks] == [2, 1, 3]


def test_errors_have_openai_shape():
    fields = {"message": "max_tokens must be >= 0", "type": "BadRequestError", "param": "max_tokens", "code": 400}
    # OpenAI's nested error, and SGLang's top-level shape ({"object": "error", "message", ...}) beside it
    assert oar.error_body(400, "max_tokens must be >= 0", "max_tokens") == {"object": "error", **fields, "error": fields}
    assert oar.error_body(503, "draining")["error"]["type"] == "ServiceUnavailableError"


def test_tokens_that_decode_alike_keep_the_most_likely_in_legacy_top_logprobs():
    meta = {"output_token_logprobs": [[-0.1, 10, "\ufffd"]],
            "output_top_logprobs": [[[-0.1, 10, "\ufffd"], [-5.0, 11, "\ufffd"], [-6.0, 12, "x"]]]}
    assert oar._completion_logprobs(meta, 0)["top_logprobs"] == [{"\ufffd": -0.1, "x": -6.0}]


def test_a_chat_stream_sends_no_empty_delta_while_text_is_held_back():
    """A step whose text is held back (a stop string's or a think tag's start) has nothing to
    send: no chunk, as SGLang's (the finish chunk still comes)."""
    def cumulative():
        return stream_of(result("a", 0, completion=1), result("a", 0, completion=2),
                       result("a", 0, completion=3, finish={"type": "stop", "matched": "\n"}))

    req = _chat({"messages": [{"role": "user", "content": "x"}], "stream": True})

    async def collect():
        return [c["choices"][0] async for c in oar.stream_chunks(req, cumulative(), 1)]

    chunks = asyncio.run(collect())
    assert [(c["delta"], c["finish_reason"]) for c in chunks] == [({"role": "assistant", "content": ""}, None),
                                                                  ({"content": "a"}, None), ({}, "stop")]


def test_a_chat_streams_held_back_logprobs_with_the_text_that_shows_them():
    """With logprobs too, a step whose text is held back sends nothing (SGLang never sends an empty
    delta with logprobs): its tokens' logprobs come with the next chunk that has text, or the last,
    so every token's logprob is streamed once, in order. The role's chunk comes first, with
    SGLang's (and OpenAI's) empty content."""
    def cumulative():
        return stream_of(result("", 0, completion=1), result("ab", 0, completion=2),
                       result("ab", 0, completion=2, finish={"type": "length"}))

    req = _chat({"messages": [{"role": "user", "content": "x"}], "stream": True, "logprobs": True})
    chunks = asyncio.run(_first_choices(oar.stream_chunks(req, cumulative(), 1)))
    assert [c["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": "ab"}, {}]
    assert [[t["logprob"] for t in c["logprobs"]["content"]] if c["logprobs"] else None for c in chunks] == \
        [None, [-0.5, -1.0], None]
    assert chunks[-1]["finish_reason"] == "length"
    # a stop string trimmed off the last step: its token's logprob comes with the finish chunk
    stopped = stream_of(result("a", 0, completion=1), result("a", 0, completion=2, finish={"type": "stop", "matched": "z"}))
    stopped = asyncio.run(_first_choices(oar.stream_chunks(req, stopped, 1)))
    assert [(c["delta"], c["finish_reason"], c["logprobs"] and [t["logprob"] for t in c["logprobs"]["content"]])
            for c in stopped] == [({"role": "assistant", "content": ""}, None, None), ({"content": "a"}, None, [-0.5]),
                                  ({}, "stop", [-1.0])]
    # an answer with no tokens (max_tokens 0): the role's chunk, then the finish
    empty = stream_of(result("", 0, completion=0, finish={"type": "length"}))
    only = asyncio.run(_first_choices(oar.stream_chunks(req, empty, 1)))
    assert [(c["delta"], c["finish_reason"], c["logprobs"]) for c in only] == \
        [({"role": "assistant", "content": ""}, None, None), ({}, "length", None)]


async def _first_choices(chunks) -> list[dict]:
    return [c["choices"][0] async for c in chunks]


def test_a_step_that_crosses_the_think_end_streams_reasoning_then_content_as_two_deltas():
    req = oa.chat_request({"messages": [{"role": "user", "content": "x"}], "stream": True}, "served",
                          lambda m, kw: "<prompt>", reasoning_parser="deepseek-r1")

    async def collect():
        stream = stream_of(result("<think>ab</think>cd", 0, completion=1),
                         result("<think>ab</think>cde", 0, completion=2, finish={"type": "length"}))
        return [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
                async for c in oar.stream_chunks(req, stream, 1)]

    assert asyncio.run(collect()) == [({"role": "assistant", "content": ""}, None), ({"reasoning_content": "ab", "reasoning": "ab"}, None),
                                      ({"content": "cd"}, None), ({"content": "e"}, None), ({}, "length")]


def test_the_answer_id_is_the_clients_rid_as_sglangs():
    """SGLang answers with its request's id (meta_info.id): a client that sets rid finds it in the
    answer and in every chunk, and can abort by it; without one the id is fresh."""
    done = {"type": "stop", "matched": 2}
    req = _chat({"messages": [{"role": "user", "content": "x"}], "rid": "mine", "stream": True})
    assert oar.response(req, [result("ab", 0, finish=done)], 1)["id"] == "mine"

    async def ids():
        return {c["id"] async for c in oar.stream_chunks(req, stream_of(result("ab", 0, finish=done)), 1)}

    assert asyncio.run(ids()) == {"mine"}
    assert oar.response(_completion({"prompt": ["a", "b"], "rid": ["r0", "r1"]}),
                        [result("ab", 0, finish=done), result("cd", 1, finish=done)], 1)["id"] == "r0"
    assert oar.response(_chat({"messages": [{"role": "user", "content": "x"}]}),
                        [result("ab", 0, finish=done)], 1)["id"].startswith("chatcmpl-")


def test_stream_reasoning_false_sends_the_reasoning_in_one_chunk():
    """SGLang's stream_reasoning false: the role's chunk first (empty content), nothing while the
    reasoning grows, then one reasoning_content chunk, the content after it (with the held steps'
    logprobs, as a step that crosses `</think>` sends them); a stream cut before `</think>` sends the
    reasoning with its finish, an aborted one not."""
    req = oa.chat_request({"messages": [{"role": "user", "content": "x"}], "stream": True, "logprobs": True},
                          "served", lambda m, kw: "<prompt>", reasoning_parser="deepseek-r1")
    req.reasoning = with_stream_reasoning(req.reasoning, {"stream_reasoning": False})

    def chunks(*items: dict) -> list[tuple]:
        out = asyncio.run(_first_choices(oar.stream_chunks(req, stream_of(*items), 1)))
        return [(c["delta"], c["finish_reason"], c["logprobs"] and len(c["logprobs"]["content"])) for c in out]

    assert chunks(result("a", 0, completion=1), result("ab", 0, completion=2), result("ab</think>c", 0, completion=2),
                  result("ab</think>cd", 0, completion=2, finish={"type": "length"})) == [
        ({"role": "assistant", "content": ""}, None, None), ({"reasoning_content": "ab", "reasoning": "ab"}, None, 2),
        ({"content": "c"}, None, None), ({"content": "d"}, None, None), ({}, "length", None)]
    assert chunks(result("a", 0, completion=1), result("ab", 0, completion=2, finish={"type": "length"})) == [
        ({"role": "assistant", "content": ""}, None, None), ({"reasoning_content": "ab", "reasoning": "ab"}, None, 2),
        ({}, "length", None)]
    assert chunks(result("a", 0, completion=1), result("ab", 0, completion=2, finish={"type": "abort"})) == [
        ({"role": "assistant", "content": ""}, None, None), ({}, "abort", 2)]
