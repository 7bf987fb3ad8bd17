"""/v1/responses end to end with the official `openai` client (client.responses.*): the bundled
model with Qwen 2.5's chat template (Hermes tool calls).

Equivalence with chat completions, greedy: a response with `instructions` equals the chat
completion of [system, user]; a response chained by previous_response_id equals the chat
completion of the whole conversation (the first turn's reply included). Streaming: the events'
deltas add up to the final response's text, sequence numbers count up, the item events pair.
Tools: forced calls (required and named) come back as function_call items whose arguments
validate against the schema, streamed too, and a function_call_output continues the chain.
text.format json_schema, retrieve / delete, store false, and the errors. Reasoning with
--reasoning-parser deepseek_r1: chat's reasoning_content, the reasoning item, streamed.

usage: python responses_test.py KVLM_BINARY MODEL_DIR QWEN_TEMPLATE.jinja
"""
import json
import os
import sys

import jsonschema
import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import Checks, Server, model_with_template  # noqa: E402

KVLM, MODEL, TEMPLATE = sys.argv[1], sys.argv[2], sys.argv[3]
if not os.path.exists(TEMPLATE):
    print(f"skipped: {TEMPLATE} is missing (../shared/data beside the repository)")
    sys.exit(77)
checks = Checks()
check = checks.check

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -100, "maximum": 100},
                                        "b": {"type": "integer", "minimum": -100, "maximum": 100}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
         {"type": "function", "name": "add", "description": "Add two integers", "parameters": ADD}]

work = model_with_template(MODEL, TEMPLATE, "kvlm-responses-")


def expect_error(call, status, text, what):
    try:
        call()
    except openai.APIStatusError as e:
        msg = e.response.json()["error"]["message"]
        check(e.status_code == status and text in msg, f"{what}: {e.status_code} {msg}")
        return
    check(False, f"{what}: no error")


srv = Server(KVLM, work, "--served-model-name", "tiny")
try:
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=300)
    greedy = dict(temperature=0.0, max_output_tokens=24)

    # 1. instructions = a system message.
    r1 = client.responses.create(model="tiny", input="Tell me about the sea.", instructions="Answer briefly.", **greedy)
    chat1 = client.chat.completions.create(model="tiny", temperature=0.0, max_completion_tokens=24, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Tell me about the sea."}])
    check(r1.object == "response" and r1.status in ("completed", "incomplete"), f"a response ({r1.status})")
    check(r1.output_text == chat1.choices[0].message.content, "instructions + input == the chat completion of [system, user]")
    check(r1.usage.input_tokens == chat1.usage.prompt_tokens and r1.usage.output_tokens == chat1.usage.completion_tokens,
          "usage as the chat completion's")
    check(r1.instructions == "Answer briefly." and r1.max_output_tokens == 24 and r1.store is True, "request fields echoed")
    check((r1.status == "incomplete") == (chat1.choices[0].finish_reason == "length"), "incomplete at max_output_tokens")

    # 2. previous_response_id replays the conversation (without the first turn's instructions).
    r2 = client.responses.create(model="tiny", input="And the mountains?", previous_response_id=r1.id, **greedy)
    chat2 = client.chat.completions.create(model="tiny", temperature=0.0, max_completion_tokens=24, messages=[
        {"role": "user", "content": "Tell me about the sea."}, {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "And the mountains?"}])
    check(r2.output_text == chat2.choices[0].message.content, "a chained response == the chat completion of the conversation")
    check(r2.previous_response_id == r1.id, "previous_response_id echoed")
    r3 = client.responses.create(model="tiny", input="And the sky?", previous_response_id=r2.id, **greedy)
    check(r3.status in ("completed", "incomplete") and r3.usage.input_tokens > r2.usage.input_tokens, "three turns deep")

    # 3. Streaming.
    events = list(client.responses.create(model="tiny", input="Tell me about the sea.", instructions="Answer briefly.",
                                          stream=True, **greedy))
    types = [e.type for e in events]
    seqs = [e.sequence_number for e in events]
    check(types[:2] == ["response.created", "response.in_progress"], f"stream opens ({types[:2]})")
    check(types[-1] in ("response.completed", "response.incomplete"), f"stream closes ({types[-1]})")
    check(seqs == list(range(len(seqs))), "sequence numbers count up from 0")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    check(text == final.output_text == r1.output_text, "streamed deltas == the final text == the non-streamed text")
    check(types.count("response.output_item.added") == types.count("response.output_item.done") == len(final.output),
          "every item added is done")

    # 4. Tools: forced calls, then the tool's output continues the chain.
    for choice, name in (("required", None), ({"type": "function", "name": "add"}, "add")):
        # One call (parallel_tool_calls false): with several allowed, a sampled reply may run on
        # past max_output_tokens and end incomplete mid-call.
        rt = client.responses.create(model="tiny", input="What is 2 + 3? Use a tool.", tools=TOOLS, tool_choice=choice,
                                     parallel_tool_calls=False, temperature=1.0, max_output_tokens=400,
                                     extra_body={"seed": 7})
        calls = [o for o in rt.output if o.type == "function_call"]
        check(len(calls) == 1, f"tool_choice {choice}: one function_call item ({[o.type for o in rt.output]})")
        for c in calls:
            if name:
                check(c.name == name, f"named call is {name}")
            schema = WEATHER if c.name == "get_weather" else ADD
            try:
                jsonschema.validate(json.loads(c.arguments), schema)
                check(True, "")
            except Exception as e:  # noqa: BLE001
                check(False, f"call arguments {c.arguments!r}: {e}")
            check(c.call_id and c.id.startswith("fc_") and c.status == "completed", "call item fields")
        if calls:
            follow = client.responses.create(model="tiny", previous_response_id=rt.id, tools=TOOLS, max_output_tokens=16,
                                             input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                     "output": "5"}])
            check(follow.status in ("completed", "incomplete") and follow.usage.input_tokens > rt.usage.input_tokens,
                  "a function_call_output continues the conversation")
    sev = list(client.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, stream=True, max_output_tokens=400,
                                       extra_body={"seed": 3}))
    done = [e for e in sev if e.type == "response.function_call_arguments.done"]
    check(done and json.loads(done[0].arguments) is not None, "streamed call: function_call_arguments.done")
    check(sev[-1].type == "response.completed" and any(o.type == "function_call" for o in sev[-1].response.output),
          "streamed call: the final response holds the call")

    # 5. Structured output through text.format.
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    rj = client.responses.create(model="tiny", input="2 + 3 = ?", max_output_tokens=60,
                                 text={"format": {"type": "json_schema", "name": "sum", "schema": schema, "strict": True}})
    try:
        jsonschema.validate(json.loads(rj.output_text), schema)
        check(True, "")
    except Exception as e:  # noqa: BLE001
        check(False, f"json_schema output {rj.output_text!r}: {e}")

    # 6. Retrieve, delete, store false.
    got = client.responses.retrieve(r1.id)
    check(got.id == r1.id and got.output_text == r1.output_text, "retrieve a stored response")
    client.responses.delete(r1.id)
    expect_error(lambda: client.responses.retrieve(r1.id), 404, "not found", "retrieve after delete")
    expect_error(lambda: client.responses.create(model="tiny", input="x", previous_response_id=r2.id), 404, "no longer keeps",
                 "a chain whose first response was deleted")
    rn = client.responses.create(model="tiny", input="hi", store=False, max_output_tokens=4)
    expect_error(lambda: client.responses.retrieve(rn.id), 404, "not found", "store false keeps nothing")

    # 7. Errors.
    expect_error(lambda: client.responses.create(model="tiny", input="x", tools=[{"type": "web_search"}]), 400,
                 "built-in tools", "a built-in tool")
    expect_error(lambda: client.responses.create(model="tiny", input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]), 400, "not supported", "an image input")
    expect_error(lambda: client.responses.create(model="tiny", input="x", previous_response_id="resp_nope"), 404,
                 "not found", "an unknown previous_response_id")
    expect_error(lambda: client.responses.create(model="tiny", input="x", background=True), 400, "background", "background")
    expect_error(lambda: client.responses.create(model="tiny", input=[]), 400, "at least one item", "empty input")
    st, body = srv.post("/v1/responses", raw=b'{"input": "x", ')
    check(st == 400 and "JSON" in body, f"malformed JSON: {st} {body[:120]}")
    st, body = srv.post("/v1/responses", {"input": [{"type": "function_call", "name": "f"}]})
    check(st == 400 and "call_id" in body, f"a function_call item without call_id: {st} {body[:160]}")
    st, body = srv.post("/v1/responses", {"input": "x", "tools": [{"type": "function"}], "tool_choice": "required"})
    check(st == 400, f"a function tool without a name: {st} {body[:160]}")
    status, _ = srv.get("/health")
    check(status == 200, "healthy after the errors")
finally:
    srv.stop()

# Reasoning (--reasoning-parser deepseek_r1) with a template that opens <think> for the reply, as
# DeepSeek-R1's and Qwen3's thinking templates do: the reply up to </think> (all of it, for a
# model that never closes the block) is reasoning — chat's reasoning_content, the Responses
# API's reasoning item, streamed as reasoning_text events.
think = os.path.join(work, "think.jinja")
with open(think, "w") as f:
    f.write("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
            "{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
reasoner = Server(KVLM, model_with_template(MODEL, think, "kvlm-think-"), "--served-model-name", "tiny",
                  "--reasoning-parser", "deepseek_r1")
try:
    client = openai.OpenAI(base_url=reasoner.base + "/v1", api_key="none", max_retries=0)
    # ignore_eos: the bundled model ends a <think> block's reply at once; 12 tokens of it it is.
    go = {"ignore_eos": True}
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2 + 3?"}], temperature=0.0,
                                       max_completion_tokens=12, extra_body=go)
    reasoning = c.choices[0].message.model_extra.get("reasoning_content")
    check(bool(reasoning) and not c.choices[0].message.content, f"chat: the open block is reasoning_content ({reasoning!r})")
    r = client.responses.create(model="tiny", input="2 + 3?", temperature=0.0, max_output_tokens=12, extra_body=go)
    check(r.output[0].type == "reasoning" and r.output[0].content[0].text == reasoning,
          f"responses: a reasoning item with the same text ({[o.type for o in r.output]})")
    ev = list(client.responses.create(model="tiny", input="2 + 3?", temperature=0.0, max_output_tokens=12, stream=True,
                                      extra_body=go))
    streamed = "".join(e.delta for e in ev if e.type == "response.reasoning_text.delta")
    check(streamed == reasoning, "responses stream: reasoning_text deltas add up to the reasoning")
finally:
    reasoner.stop()

stateless = Server(KVLM, work, "--served-model-name", "tiny", "--responses-store-size", "0")
try:
    client = openai.OpenAI(base_url=stateless.base + "/v1", api_key="none", max_retries=0)
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=4)
    expect_error(lambda: client.responses.retrieve(r.id), 404, "not found", "stateless: nothing kept")
    expect_error(lambda: client.responses.create(model="tiny", input="x", previous_response_id=r.id), 400,
                 "--responses-store-size 0", "stateless: previous_response_id refused")
finally:
    stateless.stop()

sys.exit(checks.report())
