#!/usr/bin/env python3
"""The official OpenAI Python SDK against a running Pagoda router (scripts/check-sdks.sh starts one).

Every call goes through the SDK's own request building, response parsing and error classes, so a field or shape
the SDK cannot read fails here. Greedy answers are compared across endpoints: the Responses API must answer what
chat completions answer for the same messages.

    scripts/openai_sdk_check.py http://127.0.0.1:8080
"""

import json
import os
import sys

import openai

from pagoda_servers import wait_ready

QUESTION = "What is the capital city of France? Answer in one word."


def check(cond, what):
    if not cond:
        sys.exit(f"openai SDK check failed: {what}")


def main():
    url = sys.argv[1].rstrip("/")
    wait_ready(url, None)
    # The server is on loopback: no proxy from the environment may stand between.
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=os.environ["PAGODA_API_KEY"], max_retries=0, timeout=120,
                           http_client=openai.DefaultHttpxClient(trust_env=False))
    model = client.models.list().data[0].id
    check(model == client.models.retrieve(model).id, "models.retrieve")

    # Chat completions, plain and streamed with usage.
    messages = [{"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
    answer = chat.choices[0].message.content
    check("Paris" in answer, f"chat answer {answer!r}")
    chunks = list(client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(streamed == answer, f"streamed chat {streamed!r} != {answer!r}")
    check(chunks[-1].usage.completion_tokens == chat.usage.completion_tokens, "streamed chat usage")

    # Completions.
    completion = client.completions.create(model=model, prompt="The capital of France is", temperature=0,
                                           max_tokens=8)
    check(completion.choices[0].text.strip() != "", "completion text")

    # Responses: the chat path's answer, in the SDK's types.
    response = client.responses.create(model=model, input=QUESTION, temperature=0, max_output_tokens=24)
    check(response.object == "response" and response.id.startswith("resp_"), f"response object {response}")
    check(response.output_text == answer, f"responses answer {response.output_text!r} != chat {answer!r}")
    check(response.usage.input_tokens == chat.usage.prompt_tokens, "responses usage")
    check(response.status in ("completed", "incomplete"), f"status {response.status}")

    # Streamed: typed events whose deltas add up to the answer, ending with the final response.
    events = list(client.responses.create(model=model, input=QUESTION, temperature=0, max_output_tokens=24,
                                          stream=True))
    kinds = [e.type for e in events]
    check(kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"),
          f"event order {kinds}")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    check(deltas == answer, f"streamed deltas {deltas!r}")
    check(events[-1].response.output_text == answer, "the final event's response")
    check([e.sequence_number for e in events] == list(range(len(events))), "sequence numbers")

    # Continued: the stored turn and a new input; its prompt starts with cached blocks.
    follow = client.responses.create(model=model, input="And of Germany?", previous_response_id=response.id,
                                     temperature=0, max_output_tokens=16)
    whole = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Germany?"}]
    again = client.chat.completions.create(model=model, messages=whole, temperature=0, max_tokens=16)
    check(follow.output_text == again.choices[0].message.content, "the continued conversation's answer")
    check(follow.usage.input_tokens_details.cached_tokens > 0, f"cached tokens of the follow-up: {follow.usage}")

    # Structured output through text.format.
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    shaped = client.responses.create(model=model, input=QUESTION, temperature=0, max_output_tokens=48,
                                     text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    check(isinstance(json.loads(shaped.output_text).get("city"), str), f"json_schema answer {shaped.output_text!r}")

    # A forced function call, then its output handed back.
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                           "required": ["city"], "additionalProperties": False}}
    call = client.responses.create(model=model, input="What is the weather in Paris?", tools=[tool],
                                   tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                   max_output_tokens=32)
    item = call.output[0]
    check(item.type == "function_call" and item.name == "get_weather", f"function call item {item}")
    check(isinstance(json.loads(item.arguments).get("city"), str), f"arguments {item.arguments!r}")
    told = client.responses.create(model=model, previous_response_id=call.id, temperature=0, max_output_tokens=24,
                                   input=[{"type": "function_call_output", "call_id": item.call_id,
                                           "output": "Sunny, 21 degrees."}])
    check(told.output_text.strip() != "", "an answer after the function's output")

    # Retrieved and deleted.
    check(client.responses.retrieve(response.id).output_text == answer, "responses.retrieve")
    client.responses.delete(response.id)
    try:
        client.responses.retrieve(response.id)
        check(False, "a deleted response was retrieved")
    except openai.NotFoundError:
        pass

    # Errors arrive as the SDK's classes.
    try:
        client.chat.completions.create(model=model, messages=messages, temperature=9)
        check(False, "temperature 9 was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and e.body.get("param") == "temperature", f"bad request body {e.body}")
    try:
        client.responses.create(model="no-such-model", input="x")
        check(False, "an unknown model was accepted")
    except openai.NotFoundError:
        pass
    print(f"openai SDK {openai.__version__}: chat, completions, responses (plain, streamed, continued, structured, "
          "function call, retrieved, deleted) and errors ok")


if __name__ == "__main__":
    main()
