"""Tool calling end to end, through the `openai` client and LangChain: a tiny random Qwen2 served
with a Qwen2.5-style tools template (--chat-template) and --tool-call-parser qwen25, and SmolLM2
(no parser: a required call is SGLang's JSON array). The random model says nothing sensible, but
under a required or named choice its calls are well-formed and their arguments validate."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
import requests

pytestmark = pytest.mark.timeout(600)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": s}}
         for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
GREEDY = {"temperature": 0, "max_tokens": 120}
TOOLS_TEMPLATE = str(Path(__file__).parent / "templates" / "qwen25_tools.jinja")  # the tiny_tools server's


@pytest.fixture(scope="module")
def server(servers):
    return servers("tiny_tools")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _validate(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_gives_calls_whose_arguments_validate(client):
    one = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, **GREEDY).choices[0]
    assert one.finish_reason == "tool_calls" and one.message.content is None
    _validate(one.message.tool_calls)
    assert len(one.message.tool_calls) == 1
    # parallel calls allowed: the grammar lets text and more calls follow the first, which a random
    # model rambles on with until max_tokens; every call it made still validates
    many = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                          **GREEDY).choices[0]
    _validate(many.message.tool_calls)
    assert many.finish_reason in ("tool_calls", "length")


def test_a_named_choice_gives_one_call_of_that_function(client):
    for parallel in (True, False):
        choice = client.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, parallel_tool_calls=parallel,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        _validate(choice.message.tool_calls)


def test_streamed_deltas_rebuild_the_same_calls(client):
    kwargs = {"model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
              **GREEDY}
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls, finish, fragments = {}, None, 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                if tc.id is not None:
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
                fragments += 1
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and fragments > 1  # the arguments came in pieces
    assert list(calls.values()) == [[c.function.name, c.function.arguments] for c in whole.message.tool_calls]


def test_n_choices_each_have_their_calls(client):
    out = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", n=3, seed=5,
                                         temperature=1.0, max_tokens=120, parallel_tool_calls=False)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        _validate(choice.message.tool_calls)
    ids = [c.message.tool_calls[0].id for c in out.choices]
    assert len(set(ids)) == 3 and out.usage.completion_tokens > 0


def test_a_history_with_tool_results_renders_as_apply_chat_template(client, server):
    from tandem.runtime.tokenizer import load_tokenizer, read_chat_template

    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]
    out = client.chat.completions.create(model="m", messages=history, tools=TOOLS, temperature=0, max_tokens=1)
    # the template sees what transformers is given: the arguments as objects, content "" for none
    expected = [*ASK, {**history[1], "content": "", "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in history[1]["tool_calls"]]}, *history[2:]]
    tok = load_tokenizer(server.info()["model_path"])
    prompt = tok.apply_chat_template(expected, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                     chat_template=read_chat_template(TOOLS_TEMPLATE))
    assert "<tool_response>\nsunny\n</tool_response>" in prompt and '"arguments": {"city": "Paris"' in prompt
    assert out.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_bad_tools_are_400s_naming_the_field(client, kwargs, param):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="m", messages=ASK, max_tokens=4, stream=stream, **kwargs)
        assert err.value.body["param"] == param, err.value.body


def test_a_schema_that_does_not_compile_is_named_as_the_tools(client):
    """xgrammar's to judge, when the call's grammar compiles: a 400, or a streamed error event."""
    kwargs = {"model": "m", "messages": ASK, "max_tokens": 4, "tool_choice": "required",
              "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/missing"}}}]}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kwargs)
    assert err.value.body["param"] == "tools" and "does not compile" in err.value.body["message"]
    with pytest.raises(openai.APIError) as err:
        list(client.chat.completions.create(stream=True, **kwargs))
    assert err.value.body["param"] == "tools"


def test_responses_api_function_calls(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    out = client.responses.create(model="m", input="weather?", tools=tools, tool_choice="required",
                                  parallel_tool_calls=False, temperature=0, max_output_tokens=120)
    calls = [item for item in out.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    events = list(client.responses.create(model="m", input="weather?", tools=tools, tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_output_tokens=120, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == calls[0].arguments and events[-1].type == "response.completed"


def test_parse_function_call_route(server):
    text = 'ok\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    resp = requests.post(server.url + "/parse_function_call", timeout=30,
                         json={"text": text, "tool_call_parser": "qwen25", "tools": TOOLS})
    assert resp.json() == {"normal_text": "ok", "calls": [{"tool_index": 1, "name": "get_time",
                                                          "parameters": '{"tz": "UTC"}'}]}
    bad = requests.post(server.url + "/parse_function_call", json={"text": "x", "tool_call_parser": "nope"}, timeout=30)
    assert bad.status_code == 400 and "tool_call_parser" in bad.text


def test_langchain_bind_tools_invoke_and_stream(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="m", temperature=0, max_tokens=120)
    bound = llm.bind_tools([TOOLS[0]], tool_choice="get_weather")
    message = bound.invoke("What is the weather in Paris?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER)
    merged = None
    for chunk in bound.stream("What is the weather in Paris?"):
        merged = chunk if merged is None else merged + chunk
    assert [c["name"] for c in merged.tool_calls] == ["get_weather"]
    assert merged.tool_calls[0]["args"] == message.tool_calls[0]["args"]
    required = llm.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False).invoke("Time in Paris?")
    assert len(required.tool_calls) == 1 and required.tool_calls[0]["name"] in SCHEMAS


def test_smollm2_required_call_is_well_formed(smol_server):
    """SmolLM2 on its own template, no parser: SGLang's JSON-array constraint and parse."""
    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="none", max_retries=0)
    choice = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS[:1], tool_choice="required",
                                            temperature=0, max_tokens=80).choices[0]
    assert choice.finish_reason == "tool_calls"
    _validate(choice.message.tool_calls)
    assert choice.message.tool_calls[0].function.name == "get_weather"


def test_bench_serving_compares_chat_streams_with_and_without_tools(server, tmp_path):
    """`tandem bench serving --tools`: the same rows streamed through chat without and with tools
    (a functional check on the tiny model; the numbers are for a quiet machine)."""
    from tandem.launch import bench_serving

    tools, out = tmp_path / "tools.json", tmp_path / "out.json"
    tools.write_text(json.dumps(TOOLS))
    assert bench_serving.main(["--base-url", server.url, "--tools", str(tools), "--tools-rounds", "1",
                               "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "12",
                               "--disable-tqdm", "--output-file", str(out)]) == 0
    result = json.loads(out.read_text())
    plain, tooled = result["without_tools"][0], result["with_tools"][0]
    for run in (plain, tooled):
        assert run["completed"] == 4 and not run["errors"], run
    assert tooled["total_output_tokens"] == plain["total_output_tokens"] > 0  # the same requests, ignore_eos
    assert result["with_over_without_itl"] > 0
