#!/usr/bin/env python3
"""The official `openai` Python SDK as floodgate's client, as a platform
engineer's users would run it.

    openai_peer.py calls BASE_URL[,BASE_URL...] KEY ROUNDS PER_ROUND GAP MODE

Runs ROUNDS rounds of PER_ROUND chat completions, GAP seconds apart, each
round with a new SDK client (its own connections), alternating between the
base URLs round by round. MODE is "stream" (stream_options.include_usage:
the usage arrives in a last chunk before `data: [DONE]`, where the SDK
stops reading and closes the answer), "bare" (streams that do not ask for
their usage), "indexing" (streams that do not ask for their usage,
read by the plain loop that indexes `chunk.choices[0]` on every chunk),
"plain", "both" (alternating stream and plain), or "headers"
(plain calls through the SDK's raw-response interface, which hands the
caller the answer's headers; "headers:N" with max_tokens N, else 300),
or "abandon" (streams of model "fake-model-slow", asking for their usage,
closed by the caller after their first chunk).
Prints one JSON line per call: the usage tokens the SDK read, or the error
it raised; in "headers" mode, with the answer's `x-ratelimit-*` and
`retry-after` headers, and a refusal's body (the `error` object the SDK
read, its `code` and `type`, and the whole body as sent).
"""

import json
import sys
import time

import openai


def one_call(client, stream, max_tokens, ask_usage=True):
    messages = [{"role": "user", "content": "Say hello."}]
    try:
        if stream:
            extra = {"stream_options": {"include_usage": True}} if ask_usage else {}
            chunks = client.chat.completions.create(
                model="fake-model",
                messages=messages,
                max_tokens=max_tokens,
                stream=True,
                **extra,
            )
            read, text = None, ""
            for chunk in chunks:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                if chunk.usage is not None:
                    read = chunk.usage.total_tokens
            return {"stream": True, "read": read, "text": text}
        answer = client.chat.completions.create(
            model="fake-model", messages=messages, max_tokens=max_tokens
        )
        return {
            "stream": False,
            "read": answer.usage.total_tokens,
            "text": answer.choices[0].message.content,
        }
    except openai.RateLimitError as e:
        return {"error": "RateLimitError", "status": e.status_code}
    except openai.APIError as e:
        return {"error": type(e).__name__, "detail": str(e)}


def indexing_call(client, max_tokens):
    """A stream read as most code reads one: every chunk's first choice."""
    messages = [{"role": "user", "content": "Say hello."}]
    try:
        chunks = client.chat.completions.create(
            model="fake-model", messages=messages, max_tokens=max_tokens, stream=True
        )
        read, text, count = None, "", 0
        for chunk in chunks:
            text += chunk.choices[0].delta.content or ""
            count += 1
            if getattr(chunk, "usage", None) is not None:
                read = chunk.usage.total_tokens
        return {"stream": True, "read": read, "text": text, "chunks": count}
    except IndexError as e:
        return {"error": "IndexError", "detail": str(e)}
    except openai.APIError as e:
        return {"error": type(e).__name__, "detail": str(e)}


def abandoning_call(client, max_tokens):
    """A stream its caller closes after the first chunk, as a user who
    stops a generation does."""
    messages = [{"role": "user", "content": "Say hello."}]
    try:
        chunks = client.chat.completions.create(
            model="fake-model-slow",
            messages=messages,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        first = None
        for chunk in chunks:
            first = chunk.choices[0].delta.content if chunk.choices else None
            break
        chunks.close()
        return {"stream": True, "first": first}
    except openai.APIError as e:
        return {"error": type(e).__name__, "detail": str(e)}


def rate_limit_fields(headers):
    return {
        name: value
        for name, value in headers.items()
        if name.lower().startswith("x-ratelimit-") or name.lower() == "retry-after"
    }


def call_with_headers(client, max_tokens):
    messages = [{"role": "user", "content": "Say hello."}]
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="fake-model", messages=messages, max_tokens=max_tokens
        )
        answer = raw.parse()
        return {
            "stream": False,
            "read": answer.usage.total_tokens,
            "headers": rate_limit_fields(raw.headers),
        }
    except openai.APIStatusError as e:
        try:
            whole = e.response.json()
        except ValueError:
            whole = None
        return {
            "error": type(e).__name__,
            "status": e.status_code,
            "headers": rate_limit_fields(e.response.headers),
            "body": e.body,
            "code": e.code,
            "type": e.type,
            "whole": whole,
        }


def calls(urls, key, rounds, per_round, gap, mode):
    for r in range(rounds):
        client = openai.OpenAI(
            base_url=urls[r % len(urls)], api_key=key, max_retries=0, timeout=30
        )
        for i in range(per_round):
            if mode.startswith("headers"):
                max_tokens = int(mode.split(":")[1]) if ":" in mode else 300
                print(json.dumps(call_with_headers(client, max_tokens)), flush=True)
                time.sleep(gap)
                continue
            if mode == "abandon":
                print(json.dumps(abandoning_call(client, 300)), flush=True)
                time.sleep(gap)
                continue
            if mode == "indexing":
                print(json.dumps(indexing_call(client, 300)), flush=True)
                time.sleep(gap)
                continue
            stream = mode in ("stream", "bare") or (mode == "both" and i % 2 == 0)
            print(json.dumps(one_call(client, stream, 300, mode != "bare")), flush=True)
            time.sleep(gap)
        client.close()


def main():
    if len(sys.argv) == 8 and sys.argv[1] == "calls":
        urls = sys.argv[2].split(",")
        calls(
            urls,
            sys.argv[3],
            int(sys.argv[4]),
            int(sys.argv[5]),
            float(sys.argv[6]),
            sys.argv[7],
        )
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
