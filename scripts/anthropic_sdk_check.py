#!/usr/bin/env python3
"""The official Anthropic Python SDK against a running Pagoda router (scripts/check-sdks.sh starts one).

Every call goes through the SDK's own request building (its key in `x-api-key`), response parsing, stream
accumulation and error classes, so a field, event or shape the SDK cannot read fails here. Greedy answers are
compared with the chat-completions path: the Messages API must answer what chat answers for the same messages.

    PAGODA_API_KEY=... scripts/anthropic_sdk_check.py http://127.0.0.1:8080
"""

import json
import os
import sys
import urllib.request

import anthropic

from pagoda_servers import wait_ready

QUESTION = "What is the capital city of France? Answer in one word."
# The SDK has no sampling parameters of its own any more; the API still takes them.
GREEDY = {"temperature": 0}


def check(cond, what):
    if not cond:
        sys.exit(f"anthropic SDK check failed: {what}")


def openai_call(url, key, path, body=None):
    """An OpenAI-path call beside the SDK's, for comparison (no proxy: the server is on loopback)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}{path}", data=data,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=120) as r:
        return json.load(r)


def main():
    url = sys.argv[1].rstrip("/")
    key = os.environ["PAGODA_API_KEY"]
    wait_ready(url, None)
    client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120,
                                 http_client=anthropic.DefaultHttpxClient(trust_env=False))
    model = openai_call(url, key, "/v1/models")["data"][0]["id"]
    models = client.models.list()
    card = client.models.retrieve(model)
    check([m.id for m in models.data][0] == model and models.has_more is False, f"models.list {models}")
    check(card.type == "model" and card.display_name == model and card.created_at.year >= 2024, f"model {card}")
    messages = [{"role": "user", "content": QUESTION}]

    # A plain message: the chat path's answer, in the SDK's types, with Anthropic's usage accounting.
    reference = openai_call(url, key, "/v1/chat/completions",
                            {"model": model, "messages": messages, "temperature": 0, "max_tokens": 24})
    answer = reference["choices"][0]["message"]["content"]
    message = client.messages.create(model=model, max_tokens=24, messages=messages, extra_body=GREEDY,
                                     system="You are a helpful assistant.")
    check(message.type == "message" and message.role == "assistant" and message.id.startswith("msg_"),
          f"message object {message}")
    plain = client.messages.create(model=model, max_tokens=24, messages=messages, extra_body=GREEDY)
    check(plain.content[0].type == "text" and plain.content[0].text == answer,
          f"messages answer {plain.content[0].text!r} != chat {answer!r}")
    usage = plain.usage
    check(usage.input_tokens + (usage.cache_read_input_tokens or 0) == reference["usage"]["prompt_tokens"],
          f"usage {usage} against the chat prompt's {reference['usage']['prompt_tokens']} tokens")
    check(usage.output_tokens == reference["usage"]["completion_tokens"], f"output tokens {usage}")
    finish = reference["choices"][0]["finish_reason"]
    check(plain.stop_reason == ("max_tokens" if finish == "length" else "end_turn"), f"stop_reason {plain}")

    # Streamed through the SDK's helper, which accumulates the events into a message.
    with client.messages.stream(model=model, max_tokens=24, messages=messages, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    check(streamed == answer, f"streamed {streamed!r} != {answer!r}")
    check(final.content[0].text == answer and final.stop_reason == plain.stop_reason, f"final message {final}")
    check(final.usage.output_tokens == usage.output_tokens, f"streamed usage {final.usage}")

    # A stop sequence: the text ends before it, and the message says which one stopped it.
    stop = "Paris" if "Paris" in answer else answer.split()[0]
    stopped = client.messages.create(model=model, max_tokens=24, messages=messages, extra_body=GREEDY,
                                     stop_sequences=[stop, "\n\nNever"])
    check(stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop, f"stop sequence {stopped}")
    check(stop not in stopped.content[0].text, f"the stop sequence is cut: {stopped.content[0].text!r}")

    # count_tokens: the prompt a request would run.
    counted = client.messages.count_tokens(model=model, messages=messages)
    check(counted.input_tokens == reference["usage"]["prompt_tokens"], f"count_tokens {counted}")

    # Structured output: the answer holds to the schema.
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    shaped = client.messages.create(model=model, max_tokens=48, messages=messages, extra_body=GREEDY,
                                    output_config={"format": {"type": "json_schema", "schema": schema}})
    check(isinstance(json.loads(shaped.content[0].text).get("city"), str), f"json_schema answer {shaped.content}")

    # A forced tool call, then its result handed back.
    tool = {"name": "get_weather", "description": "The weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                             "required": ["city"], "additionalProperties": False}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = client.messages.create(model=model, max_tokens=32, messages=ask, tools=[tool], extra_body=GREEDY,
                                  tool_choice={"type": "tool", "name": "get_weather"})
    block = call.content[0]
    check(call.stop_reason == "tool_use" and block.type == "tool_use" and block.name == "get_weather",
          f"tool call {call}")
    check(isinstance(block.input.get("city"), str) and block.id.startswith("toolu_"), f"tool input {block}")
    with client.messages.stream(model=model, max_tokens=32, messages=ask, tools=[tool], extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        streamed_call = stream.get_final_message()
    check(streamed_call.content[0].type == "tool_use" and streamed_call.content[0].input == block.input,
          f"streamed tool call {streamed_call}")
    told = client.messages.create(model=model, max_tokens=24, extra_body=GREEDY, messages=ask + [
        {"role": "assistant", "content": [block.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                      "content": "Sunny, 21 degrees."}]}])
    check(told.content[0].type == "text" and told.content[0].text.strip() != "", f"answer after the result {told}")

    # Errors arrive as the SDK's classes.
    try:
        client.messages.create(model=model, max_tokens=8, messages=messages, extra_body={"temperature": 9})
        check(False, "temperature 9 was accepted")
    except anthropic.BadRequestError as e:
        check(e.status_code == 400 and e.body["error"]["type"] == "invalid_request_error"
              and "temperature" in e.body["error"]["message"], f"bad request body {e.body}")
    try:
        client.messages.create(model="no-such-model", max_tokens=8, messages=messages)
        check(False, "an unknown model was accepted")
    except anthropic.NotFoundError as e:
        check(e.body["error"]["type"] == "not_found_error", f"not found body {e.body}")
    try:
        anthropic.Anthropic(base_url=url, api_key="not-a-key-of-this-server", max_retries=0,
                            http_client=anthropic.DefaultHttpxClient(trust_env=False)).messages.create(
            model=model, max_tokens=8, messages=messages)
        check(False, "an unknown key was accepted")
    except anthropic.AuthenticationError:
        pass
    print(f"anthropic SDK {anthropic.__version__}: messages (plain, streamed, stop sequence, structured, tool call and "
          "result), "
          "count_tokens, errors and x-api-key ok")


if __name__ == "__main__":
    main()
