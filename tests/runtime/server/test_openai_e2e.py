"""The OpenAI API through the PyPI `openai` client against a running tandem (SmolLM2): chat and
completions, streaming with usage, n>1 and seeds, logprobs in both shapes, stop, response_format,
errors in OpenAI's shape naming the field, a client timeout that aborts the request, echo with
prompt logprobs, and the reasoning controls (parser, strict thinking, require_reasoning)."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from server_utils import assert_no_leaks

pytestmark = pytest.mark.timeout(600)

CHAT = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"temperature": 0, "max_tokens": 24}


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_answer_equals_generate_on_the_rendered_template(client, smol_server, smol_tokenizer):
    """The chat template is transformers' apply_chat_template: multi-turn, with and without a system message."""
    conversations = [CHAT, [{"role": "system", "content": "You answer in one word."},
                            {"role": "user", "content": "Capital of France?"},
                            {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}]]
    for messages in conversations:
        chat = client.chat.completions.create(model="any", messages=messages, **GREEDY)
        text = smol_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        native = smol_server.generate({"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 24}})
        choice = chat.choices[0]
        assert choice.message.role == "assistant" and choice.message.content == native["text"]
        assert choice.finish_reason == native["meta_info"]["finish_reason"]["type"]
        assert chat.usage.prompt_tokens == len(smol_tokenizer.encode(text, add_special_tokens=False))
        assert chat.usage.completion_tokens == native["meta_info"]["completion_tokens"]
        assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colors."}]}]
    joined = [{"role": "user", "content": "Name three colors."}]
    assert (client.chat.completions.create(model="m", messages=parts, **GREEDY).choices[0].message.content
            == client.chat.completions.create(model="m", messages=joined, **GREEDY).choices[0].message.content)


def test_greedy_completions_equal_generate_and_echo(client, smol_server):
    prompt = "The three primary colors are"
    out = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
    native = smol_server.generate({"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 12}})
    assert out.choices[0].text == native["text"] and out.object == "text_completion"
    echoed = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + native["text"]
    default = client.completions.create(model="m", prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's legacy default max_tokens
    batch = client.completions.create(model="m", prompt=[prompt, "Once upon a time"], max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == native["text"][:len(
        batch.choices[0].text)]


def test_sglang_client_surface(client, smol_server, smol_tokenizer):
    """What SGLang's OpenAI layer gives a client: the model card by id (404 for another), a chat
    message whose reasoning_content and tool_calls are there (null), an echoed token-id prompt
    decoded without special tokens."""
    served = client.models.list().data[0].id
    assert client.models.retrieve(served).id == served
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    message = client.chat.completions.create(model="m", messages=CHAT, **GREEDY).choices[0].message
    assert message.reasoning_content is None and message.tool_calls is None
    text = smol_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    echoed = client.completions.create(model="m", prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(smol_tokenizer.decode(ids, skip_special_tokens=True))
    assert "<|im_start|>" not in echoed.choices[0].text
    for bad, param in (([[1, -5]], "prompt[0][1]"), ([1, 2.5], "prompt[1]"), ([[1, 2**70]], "prompt[0][1]")):
        resp = smol_server.post("/v1/completions", {"prompt": bad, "max_tokens": 2, "echo": True})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (bad, resp.text)


def test_streaming_deltas_add_up_and_usage_comes_last(client):
    full = client.chat.completions.create(model="m", messages=CHAT, **GREEDY)
    chunks = list(client.chat.completions.create(model="m", messages=CHAT, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert len([c for c in chunks if c.choices]) >= full.usage.completion_tokens // 2  # token by token, not at the end
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    plain = list(client.completions.create(model="m", prompt="One, two,", max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in plain) == client.completions.create(
        model="m", prompt="One, two,", max_tokens=8, temperature=0).choices[0].text


def test_n_choices_and_seeds(client):
    kw = dict(model="m", messages=CHAT, n=3, temperature=1.0, max_tokens=12, seed=1234)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # choice i uses seed + i
    assert a.usage.prompt_tokens == b.usage.prompt_tokens  # the prompt counts once, not per choice


def test_logprobs_in_both_shapes(client):
    chat = client.chat.completions.create(model="m", messages=CHAT, logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    # one entry per generated token, the stop token included (as completion_tokens counts it)
    assert "".join(t.token for t in content).startswith(chat.choices[0].message.content)
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-5 for t in content)
    legacy = client.completions.create(model="m", prompt="Roses are", max_tokens=6, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert "".join(lp.tokens) == legacy.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 for top in lp.top_logprobs)


def test_echo_with_logprobs_scores_the_prompt(client, smol_server):
    """OpenAI's echo + logprobs: the prompt's tokens come first (the first without a logprob),
    scored as /generate scores them, then the completion's."""
    prompt = "Roses are red, violets"
    out = client.completions.create(model="m", prompt=prompt, max_tokens=5, temperature=0, logprobs=1, echo=True)
    lp, text = out.choices[0].logprobs, out.choices[0].text
    native = smol_server.generate({"text": prompt, "return_logprob": True, "logprob_start_len": 0,
                                   "sampling_params": {"temperature": 0, "max_new_tokens": 5}})["meta_info"]
    n_prompt = len(native["input_token_logprobs"])
    assert "".join(lp.tokens) == text and text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n_prompt] == pytest.approx([t[0] for t in native["input_token_logprobs"][1:]], abs=1e-4)
    assert lp.token_logprobs[n_prompt:] == pytest.approx([t[0] for t in native["output_token_logprobs"]], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = list(client.completions.create(model="m", prompt=prompt, max_tokens=5, temperature=0, logprobs=1,
                                              echo=True, stream=True))
    assert "".join(t for c in streamed for t in c.choices[0].logprobs.tokens) == text


def test_stop_and_response_format(client):
    full = client.chat.completions.create(model="m", messages=CHAT, **GREEDY).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 2]
    out = client.chat.completions.create(model="m", messages=CHAT, stop=[stop], **GREEDY).choices[0]
    assert out.message.content == full[:full.index(stop)] and out.finish_reason == "stop" and out.matched_stop == stop
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["color", "count"]}
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Pick a color and a count as JSON."}], temperature=0,
        max_tokens=64, response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}


def test_a_structural_tag_response_format_constrains_both_routes(client):
    """SGLang's legacy structural tag: with at_least_one the answer opens with the tag, a JSON
    object of the schema between begin and end. Before, a 400 for any structural_tag."""
    tag = {"type": "structural_tag", "structures": [{"begin": "<call>", "schema": WEATHER, "end": "</call>"}],
           "triggers": ["<call>"], "at_least_one": True}
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What is the weather in Paris?"}], temperature=0,
        max_tokens=40, response_format=tag).choices[0].message.content
    text = client.completions.create(model="m", prompt="The weather in Paris:", temperature=0, max_tokens=40,
                                     extra_body={"response_format": tag}).choices[0].text
    for out in (chat, text):
        match = re.match(r"<call>(.*?)</call>", out, re.S)
        assert match, out
        jsonschema.validate(json.loads(match.group(1)), WEATHER)


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    # found by the scheduler when the grammar compiles, and still named as the client sent it
    ({"extra_body": {"regex": "(unclosed"}}, "regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "structural_tag", "structures": [{"end": "</a>"}], "triggers": ["<a>"]}},
     "response_format.structures[0].begin"),
    # a begin no trigger starts: xgrammar's to judge, named as the client sent it
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<a>", "end": "</a>"}],
                          "triggers": ["<b>"]}}, "response_format"),
])
def test_bad_fields_are_openai_errors_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=CHAT, **kwargs)
    body = err.value.body
    assert param in body["message"] and body["param"] == param and body["type"] == "BadRequestError"


def test_a_stream_whose_grammar_fails_ends_with_an_error_naming_the_field(client):
    stream = client.chat.completions.create(model="m", messages=CHAT, stream=True, extra_body={"regex": "(unclosed"})
    with pytest.raises(openai.APIError) as err:
        list(stream)
    assert err.value.body["param"] == "regex" and "does not compile" in err.value.body["message"]


def test_a_client_timeout_aborts_the_request(smol_server):
    impatient = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x", max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model="m", prompt="Tell a very long story.", max_tokens=3000,
                                     extra_body={"ignore_eos": True})
    assert_no_leaks(smol_server)  # the server noticed the disconnect and aborted the request


def test_the_responses_api_answers_as_chat_on_instructions_then_input(client, smol_server):
    """/v1/responses through the client's responses.create and responses.stream (SGLang's
    serving_responses): the answer is the chat answer on [system: instructions, user: input],
    streamed as numbered events whose deltas add up; what needs stored responses is a 400 naming
    the field."""
    greedy = dict(model="m", temperature=0, max_output_tokens=24)
    out = client.responses.create(input="Name three colors.", instructions="Answer in one line.", **greedy)
    chat = client.chat.completions.create(model="m", messages=[{"role": "system", "content": "Answer in one line."},
                                                               *CHAT], **GREEDY)
    assert out.output_text == chat.choices[0].message.content and out.id.startswith("resp_")
    assert out.usage.output_tokens == chat.usage.completion_tokens
    assert out.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    with client.responses.stream(input="Say hi.", **{**greedy, "max_output_tokens": 200}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == client.responses.create(input="Say hi.", **{**greedy,
                                                                                    "max_output_tokens": 200}).output_text
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(input="x", previous_response_id="resp_1", **greedy)
    assert err.value.body["param"] == "previous_response_id"
    assert_no_leaks(smol_server)


def test_reasoning_content_is_split_off_whole_and_streamed(servers):
    """--reasoning-parser qwen3 on a tiny model whose answer a regex forces into
    `<think>...</think>answer`: reasoning_content (and vLLM's `reasoning`) and content, the same
    when streamed."""
    server = servers("tiny_reasoning")
    body = {"model": "m", "messages": CHAT, "temperature": 0, "max_tokens": 60,
            "regex": r"<think>[a-z]{4,12} [a-z]{4,12}</think>[A-Z][a-z]{3,10}",
            "require_reasoning": False}  # the regex writes the tags itself: it holds from the first token
    whole = server.post("/v1/chat/completions", body).json()["choices"][0]["message"]
    assert whole["reasoning_content"] and " " in whole["reasoning_content"] and "<" not in whole["reasoning_content"]
    assert whole["content"][:1].isupper() and "<" not in whole["content"]
    assert whole["reasoning"] == whole["reasoning_content"]  # vLLM's name beside SGLang's
    raw = server.post("/v1/chat/completions", {**body, "separate_reasoning": False}).json()["choices"][0]["message"]
    assert raw["content"] == f"<think>{whole['reasoning_content']}</think>{whole['content']}"
    assert raw.get("reasoning_content") is None
    resp = server.post("/v1/chat/completions", {**body, "stream": True}, stream=True)
    events = [json.loads(line[6:]) for line in resp.iter_lines(decode_unicode=True)
              if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"]
    bad = server.post("/v1/chat/completions", {**body, "separate_reasoning": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "separate_reasoning"


def test_max_thinking_tokens_forces_the_end_of_the_reasoning(servers, smol_tokenizer):
    """A budget of k reasoning tokens (the deepseek-r1 template opens <think>): output tokens
    k, k+1, ... are exactly "</think>", whatever the model wanted; a 400 without strict thinking."""
    server = servers("tiny_strict_thinking")
    end = smol_tokenizer.encode("</think>", add_special_tokens=False)
    for k in (0, 1, 5):
        out = server.generate({"input_ids": [5, 6, 7, 8], "sampling_params": {
            "temperature": 0, "max_new_tokens": 16, "ignore_eos": True, "max_thinking_tokens": k}})
        assert out["output_ids"][k:k + len(end)] == end, k
    chat = server.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 16, "temperature": 0.8, "seed": 3,
                                                "max_thinking_tokens": 4}).json()
    ids_text = chat["choices"][0]["message"]
    assert "</think>" not in (ids_text["content"] or "") and ids_text["reasoning_content"] is not None
    bad = servers("tiny").post("/generate", {"text": "hi", "sampling_params": {
        "max_thinking_tokens": 3}})
    assert bad.status_code == 400 and "max_thinking_tokens needs --enable-strict-thinking" in bad.json()["error"]["message"]


COLOR = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99}},
         "required": ["c", "n"], "additionalProperties": False}


def test_require_reasoning_reasons_freely_then_the_grammar_holds(servers, smol_tokenizer):
    """require_reasoning + json_schema: the reasoning tokens are the unconstrained ones, then
    `</think>`, then JSON that validates (the budget forces the end: a random model never writes
    it); without an end the answer stays free; a budget with a constraint needs require_reasoning."""
    server = servers("tiny_strict_thinking")
    end = smol_tokenizer.encode("</think>", add_special_tokens=False)
    prompt = {"input_ids": [5, 6, 7, 8]}
    for k in (0, 5):
        free = server.generate({**prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 16,
                                                              "ignore_eos": True, "max_thinking_tokens": k}})
        out = server.generate({**prompt, "require_reasoning": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": 64, "max_thinking_tokens": k, "json_schema": json.dumps(COLOR)}})
        ids = out["output_ids"]
        assert ids[:k + len(end)] == free["output_ids"][:k] + end, k
        answer = smol_tokenizer.decode(ids[k + len(end):], skip_special_tokens=True)
        jsonschema.validate(json.loads(answer), COLOR)
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    unclosed = server.generate({**prompt, "require_reasoning": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True, "json_schema": json.dumps(COLOR)}})
    plain = server.generate({**prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}})
    assert unclosed["output_ids"] == plain["output_ids"]  # no </think> written: never constrained
    bad = server.post("/generate", {**prompt, "sampling_params": {"max_thinking_tokens": 2, "regex": "a+"}})
    assert bad.status_code == 400 and "needs require_reasoning" in bad.json()["error"]["message"]
    # chat on a reasoning server: a constrained answer reasons first by default (SGLang's chat default)
    chat = server.post("/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 64, "temperature": 0, "max_thinking_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": COLOR}}}).json()
    message = chat["choices"][0]["message"]
    assert message["reasoning_content"] and chat["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(message["content"]), COLOR)


def test_a_text_prompt_gets_the_tokenizers_bos_a_chat_only_the_templates(tmp_path, tiny_model_dir, smol_tokenizer):
    """As SGLang tokenizes: /generate and completion text with the tokenizer's special tokens (a
    BOS for Llama-3 or Mistral tokenizers), a rendered chat template without (it wrote its own)."""
    import shutil

    from server_utils import start_server

    model = tmp_path / "bos_model"
    shutil.copytree(tiny_model_dir("llama"), model)
    spec = json.loads((model / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}  # id 0
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    server = start_server(["--model-path", str(model), "--max-total-tokens", "2000"], str(tmp_path / "bos.log"))
    try:
        plain = len(smol_tokenizer.encode("Hello world", add_special_tokens=False))
        native = server.generate({"text": "Hello world", "sampling_params": {"max_new_tokens": 1}})
        assert native["meta_info"]["prompt_tokens"] == plain + 1
        completion = server.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 1}).json()
        assert completion["usage"]["prompt_tokens"] == plain + 1
        chat = server.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()
        rendered = smol_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        assert chat["usage"]["prompt_tokens"] == len(smol_tokenizer.encode(rendered, add_special_tokens=False))
    finally:
        server.stop()
