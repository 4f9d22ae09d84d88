"""POST /v1/completions against the fake connector."""

from __future__ import annotations

import json

import pytest

from servelm.engine.outputs import CompletionOutput, RequestOutput

from .fake_connector import BOS, CHAT_MODEL, VOCAB_SIZE, encode
from .test_chat import NO_COMPLETION_DETAILS, chunks, events, fingerprint


async def complete(client, **body):
    body.setdefault("model", CHAT_MODEL)
    body.setdefault("prompt", "ab")
    return await client.post("/v1/completions", json=body)


async def test_string_prompt(client, fake):
    r = await complete(client, max_tokens=5)
    assert r.status_code == 200
    assert r.json() == {
        "id": "cmpl-test",
        "object": "text_completion",
        "created": 1700000000,
        "model": "fake-chat",
        "system_fingerprint": fingerprint(),
        "choices": [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 5,
            "total_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 2},
            "completion_tokens_details": NO_COMPLETION_DETAILS,
        },
    }
    # Text prompts are tokenized with special tokens (BOS here) before the engine sees them.
    assert fake.generate_calls[0][2] == encode("ab")
    assert fake.generate_calls[0][3].max_tokens == 5


async def test_default_max_tokens_is_16_and_null_means_context(client, fake):
    await complete(client)
    await complete(client, max_tokens=None)
    assert [c[3].max_tokens for c in fake.generate_calls] == [16, None]


@pytest.mark.parametrize(
    "prompt,expected",
    [
        ("ab", [encode("ab")]),
        (["ab", "c"], [encode("ab"), encode("c")]),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5, 6], [7]], [[5, 6], [7]]),
    ],
)
async def test_prompt_forms(client, fake, prompt, expected):
    r = await complete(client, prompt=prompt, max_tokens=1)
    assert r.status_code == 200, r.text
    assert [c[2] for c in fake.generate_calls] == expected
    assert len(r.json()["choices"]) == len(expected)


async def test_choices_are_indexed_prompt_major(client, fake):
    r = await complete(client, prompt=["a", "b"], n=2, max_tokens=1)
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c[1] for c in fake.generate_calls] == ["cmpl-test-0", "cmpl-test-1"]
    assert body["usage"]["prompt_tokens"] == 4  # each prompt counted once, not per choice
    assert body["usage"]["completion_tokens"] == 4


async def test_echo_with_legacy_logprobs(client):
    r = await complete(client, prompt="ab", echo=True, logprobs=1, max_tokens=2)
    choice = r.json()["choices"][0]
    assert choice["text"] == "abHe"
    assert choice["logprobs"] == {
        # BOS first: it decodes to "" and nothing predicts it (null logprob)
        "tokens": ["", "a", "b", "H", "e"],
        "token_logprobs": [None, -0.5, -0.5, -0.5, -0.5],
        "top_logprobs": [None, {"a": -0.5}, {"b": -0.5}, {"H": -0.5}, {"e": -0.5}],
        "text_offset": [0, 0, 1, 2, 3],
    }


async def test_echo_token_prompt_is_detokenized(client, fake):
    r = await complete(client, prompt=encode("xy", add_special_tokens=False), echo=True, max_tokens=1)
    assert r.json()["choices"][0]["text"] == "xyH"
    assert fake.generate_calls[0][3].prompt_logprobs is None


@pytest.mark.parametrize(("prompt", "param"), [([VOCAB_SIZE + 5], "prompt"), ([[BOS], [BOS, VOCAB_SIZE]], "prompt[1]")])
async def test_echo_of_a_token_outside_the_vocabulary_blames_the_prompt(client, fake, prompt, param):
    r = await complete(client, prompt=prompt, echo=True, max_tokens=1)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "vocabulary" in r.json()["error"]["message"]
    assert fake.generate_calls == []


async def test_logprobs_without_echo(client, fake):
    r = await complete(client, logprobs=2, max_tokens=2)
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H", "e"]
    assert lp["text_offset"] == [0, 1]
    assert lp["top_logprobs"] == [{"H": -0.5, "a": -1.0}, {"e": -0.5, "a": -1.0}]
    assert fake.generate_calls[0][3].logprobs == 2
    assert fake.generate_calls[0][3].prompt_logprobs is None


async def test_logprobs_zero_keeps_the_chosen_token(client):
    r = await complete(client, logprobs=0, max_tokens=1)
    assert r.json()["choices"][0]["logprobs"]["top_logprobs"] == [{"H": -0.5}]


async def test_best_of(client, fake):
    r = await complete(client, n=1, best_of=3, max_tokens=1)
    assert r.status_code == 200
    assert fake.generate_calls[0][3].best_of == 3
    r = await complete(client, n=1, best_of=3, stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    r = await complete(client, n=3, best_of=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


async def test_suffix_rejected(client):
    r = await complete(client, suffix="end")
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "suffix"
    assert "suffix" in r.json()["error"]["message"]
    assert (await complete(client, suffix="")).status_code == 200


async def test_empty_text_prompt_is_fine_when_it_has_special_tokens(client, fake):
    # "" becomes [BOS]: the model can still generate. Only an empty token list is an error.
    assert (await complete(client, prompt="", max_tokens=1)).status_code == 200
    assert fake.generate_calls[0][2] == [BOS]


@pytest.mark.parametrize("prompt,param", [([], "prompt"), ([[1], []], "prompt[1]")])
async def test_empty_prompts(client, prompt, param):
    r = await complete(client, prompt=prompt)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_bad_token_ids(client):
    r = await complete(client, prompt=[1, -2])
    assert r.status_code == 400
    r = await complete(client, prompt=[1, 2**40])
    assert r.status_code == 400


async def test_context_overflow_same_shape_as_chat(client, fake):
    fake.max_model_len = 10
    r = await complete(client, prompt=[5] * 8, max_tokens=5)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert err["message"] == (
        "This model's maximum context length is 10 tokens. However, you requested 13 tokens "
        "(8 in the prompt, 5 in the completion). Please reduce the length of the prompt or completion."
    )


async def test_stream_byte_exact_with_usage(client, fake):
    fake.reply_text = "Hi"
    r = await complete(client, stream=True, stream_options={"include_usage": True})
    fp = fingerprint()
    head = f'{{"id":"cmpl-test","object":"text_completion","created":1700000000,"model":"fake-chat","system_fingerprint":"{fp}",'
    assert r.text == (
        f'data: {head}"choices":[{{"index":0,"text":"H","logprobs":null,"finish_reason":null}}],"usage":null}}\n\n'
        f'data: {head}"choices":[{{"index":0,"text":"i","logprobs":null,"finish_reason":"stop"}}],"usage":null}}\n\n'
        f'data: {head}"choices":[],"usage":{{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,"prompt_tokens_details":{{"cached_tokens":2}},"completion_tokens_details":{{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}}}}\n\n'
        "data: [DONE]\n\n"
    )


async def test_stream_echo_and_logprobs_offsets(client, fake):
    fake.reply_text = "Hi"
    r = await complete(client, prompt="ab", stream=True, echo=True, logprobs=0)
    cs = [c["choices"][0] for c in chunks(r.text)]
    assert [c["text"] for c in cs] == ["abH", "i"]
    assert cs[0]["logprobs"]["tokens"] == ["", "a", "b", "H"]
    assert cs[0]["logprobs"]["text_offset"] == [0, 0, 1, 2]
    assert cs[1]["logprobs"]["text_offset"] == [3]
    assert cs[1]["finish_reason"] == "stop"


async def test_stream_multiple_prompts_and_n(client, fake):
    fake.reply_text = "a"
    r = await complete(client, prompt=["x", "y"], n=2, stream=True)
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for c in chunks(r.text):
        (choice,) = c["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finished[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "a", 1: "a 1", 2: "a", 3: "a 1"}
    assert finished == {0: "stop", 1: "stop", 2: "stop", 3: "stop"}


async def test_error_in_one_prompt_aborts_the_others(client, fake):
    fake.error_after = 1
    r = await complete(client, prompt=["x", "y"], stream=True)
    evs = events(r.text)
    assert evs[-1] == "[DONE]"
    assert "error" in json.loads(evs[-2])


async def test_first_token_text_is_detokenized_once(client, fake):
    r = await complete(client, prompt=[BOS, 70], echo=True, logprobs=0, max_tokens=1)
    assert r.json()["choices"][0]["logprobs"]["tokens"][0] == ""


async def test_stream_text_with_unicode_line_separators_stays_one_line_per_event(client, fake):
    # U+2028, U+2029 and U+0085 are legal raw in JSON and in SSE, but str.splitlines() (and so
    # httpx's aiter_lines, which many clients read streams with) breaks lines at them.
    fake.script = [
        RequestOutput("r", None, [1], [CompletionOutput(0, "a\u2028b", [5])], delta=True),
        RequestOutput("r", None, [1], [CompletionOutput(0, "\u2029c\x85d", [6], finish_reason="stop")], True, True),
    ]
    async with client.stream(
        "POST", "/v1/completions", json={"model": CHAT_MODEL, "prompt": "ab", "stream": True}
    ) as r:
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    texts = [json.loads(line.removeprefix("data: "))["choices"][0]["text"] for line in lines[:-1]]
    assert "".join(texts) == "a\u2028b\u2029c\x85d"
