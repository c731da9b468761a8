"""Request validation: what the OpenAI endpoints accept, and a clear 400 with `param` for what they don't."""

from __future__ import annotations

import pytest

from sluice.service.api.protocol import RequestError, parse_chat, parse_completion, resolve_params

MSG = [{"role": "user", "content": "hi"}]


def test_completion_defaults():
    r = parse_completion({"model": "m", "prompt": "hello"})
    assert r.prompts == ["hello"] and r.n == 1 and not r.stream and r.priority == 0
    assert r.params.max_tokens == 16 and r.params.temperature == 1.0 and r.params.logprobs is None


@pytest.mark.parametrize("prompt,want", [
    ("a", ["a"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_forms(prompt, want):
    assert parse_completion({"prompt": prompt}).prompts == want


def test_full_completion_request():
    r = parse_completion({
        "prompt": "x", "max_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": -1, "min_p": 0.1, "seed": 7,
        "stop": "\n", "stop_token_ids": [3], "ignore_eos": True, "min_tokens": 2, "n": 3, "logprobs": 2,
        "stream": True, "stream_options": {"include_usage": True}, "priority": -5, "user": "u",
        "presence_penalty": 0, "frequency_penalty": 0.0, "echo": False, "best_of": 3,
    })
    p = r.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (5, 0.0, 0.5, 0, 0.1, 7)
    assert p.stop == ["\n"] and p.stop_token_ids == [3] and p.ignore_eos and p.min_tokens == 2 and p.logprobs == 2
    assert r.n == 3 and r.stream and r.include_usage and r.priority == -5 and r.user == "u"


def test_chat_request():
    r = parse_chat({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ], "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 9})
    assert r.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                          {"role": "assistant", "content": ""}]
    assert r.params.logprobs == 3 and r.max_tokens == 9 and r.chat
    assert parse_chat({"messages": MSG}).max_tokens is None  # chat default: what the context leaves
    assert parse_chat({"messages": MSG, "logprobs": True}).params.logprobs == 0


BAD_COMPLETIONS = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt[0]"),
    ({"prompt": ["a", 1]}, "prompt[1]"),
    ({"prompt": [1, -2]}, "prompt[1]"),
    ({"prompt": [1.5]}, "prompt[0]"),
    ({"prompt": [True]}, "prompt[0]"),
    ({"prompt": None}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": ["a"] * 65}, "prompt"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 1.0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 10**30}, "max_tokens"),
    ({"prompt": "a", "temperature": 2.5}, "temperature"),
    ({"prompt": "a", "temperature": -0.1}, "temperature"),
    ({"prompt": "a", "temperature": float("nan")}, "temperature"),
    ({"prompt": "a", "temperature": float("inf")}, "temperature"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "temperature": False}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "top_k": -2}, "top_k"),
    ({"prompt": "a", "min_p": 2}, "min_p"),
    ({"prompt": "a", "seed": 2**70}, "seed"),
    ({"prompt": "a", "seed": "1"}, "seed"),
    ({"prompt": "a", "stop": ""}, "stop"),
    ({"prompt": "a", "stop": [""]}, "stop[0]"),
    ({"prompt": "a", "stop": [1]}, "stop[0]"),
    ({"prompt": "a", "stop": ["x"] * 17}, "stop"),
    ({"prompt": "a", "stop": "x" * 257}, "stop"),
    ({"prompt": "a", "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"prompt": "a", "stop_token_ids": 3}, "stop_token_ids"),
    ({"prompt": "a", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "a", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 17}, "n"),
    ({"prompt": "a", "n": True}, "n"),
    ({"prompt": ["a"] * 10, "n": 10}, "n"),
    ({"prompt": "a", "best_of": 2}, "best_of"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "logprobs": True}, "logprobs"),
    ({"prompt": "a", "stream": "true"}, "stream"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "stream": True, "stream_options": []}, "stream_options"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"prompt": "a", "priority": 1.5}, "priority"),
    ({"prompt": "a", "priority": 2**40}, "priority"),
    ({"prompt": "a", "user": 5}, "user"),
    ({"prompt": "a", "model": 5}, "model"),
    ({"prompt": "a", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "a", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "a", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "a", "suffix": "x"}, "suffix"),
    ({"prompt": "a", "logit_bias": {"x": 5}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"1": 101}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"1": True}}, "logit_bias"),
    ({"prompt": "a", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "a", "allowed_token_ids": [1.5]}, "allowed_token_ids[0]"),
    ({"prompt": "a", "bad_words": "x"}, "bad_words"),
    ({"prompt": "a", "bad_words": [""]}, "bad_words[0]"),
    ({"prompt": "a", "skip_special_tokens": "no"}, "skip_special_tokens"),
]


def test_sampling_controls_are_parsed():
    p = parse_completion({"prompt": "a", "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.3,
                          "logit_bias": {"7": -100, "9": 2.5}, "allowed_token_ids": [1, 2, 1, 2], "bad_words": ["no"],
                          "skip_special_tokens": False, "echo": True}).params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.3)
    assert p.logit_bias == {7: -100.0, 9: 2.5} and p.allowed_token_ids == [1, 2] and p.bad_words == ["no"]
    assert not p.skip_special_tokens and p.has_logit_controls
    assert not parse_completion({"prompt": "a", "presence_penalty": 0, "logit_bias": {}}).params.has_logit_controls


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_bad_completion_requests(body, param):
    with pytest.raises(RequestError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param and e.value.message
    assert e.value.to_dict()["error"].keys() == {"message", "type", "param", "code"}


BAD_CHATS = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSG, "logprobs": 3}, "logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": MSG, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
     "response_format.json_schema.schema"),
    ({"messages": MSG, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"messages": MSG, "guided_choice": []}, "guided_choice"),
    ({"messages": MSG, "guided_json": "{not json"}, "guided_json"),
    ({"messages": MSG, "guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
]


@pytest.mark.parametrize("body,param", BAD_CHATS)
def test_bad_chat_requests(body, param):
    with pytest.raises(RequestError) as e:
        parse_chat(body)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("body", [[], "x", 5, None])
def test_body_must_be_an_object(body):
    with pytest.raises(RequestError):
        parse_completion(body)


def test_resolve_checks_vocab_and_context():
    r = parse_completion({"prompt": [1], "max_tokens": 10})
    assert resolve_params(r, [1, 2, 3], max_model_len=13, vocab_size=100).max_tokens == 10
    with pytest.raises(RequestError) as e:
        resolve_params(r, [1, 2, 3, 4], max_model_len=13, vocab_size=100)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert e.value.message.startswith("This model's maximum context length is 13 tokens. However, you requested 14")
    with pytest.raises(RequestError, match="outside the vocabulary"):
        resolve_params(r, [1, 100], max_model_len=50, vocab_size=100)
    with pytest.raises(RequestError, match="empty"):
        resolve_params(r, [], max_model_len=50, vocab_size=100)


def test_resolve_chat_default_max_tokens_and_full_context():
    r = parse_chat({"messages": MSG})
    assert resolve_params(r, [1] * 30, max_model_len=32, vocab_size=100).max_tokens == 2
    with pytest.raises(RequestError) as e:
        resolve_params(r, [1] * 32, max_model_len=32, vocab_size=100)
    assert e.value.param == "messages" and "in the messages" in e.value.message


def test_resolve_reports_sampling_param_conflicts():
    r = parse_completion({"prompt": "a", "max_tokens": 2, "min_tokens": 5})
    with pytest.raises(RequestError) as e:
        resolve_params(r, [1], max_model_len=50, vocab_size=100)
    assert e.value.param == "min_tokens"
    r = parse_completion({"prompt": "a", "stop_token_ids": [500]})
    with pytest.raises(RequestError) as e:
        resolve_params(r, [1], max_model_len=50, vocab_size=100)
    assert e.value.param == "stop_token_ids"


# ---- per-request caps (ServerConfig's --max-n, --max-prompts-per-request, --max-embedding-inputs) ---------------

def test_caps_come_from_the_server_config_and_the_queue_bounds_them():
    from sluice.service.api.protocol import DEFAULT_CAPS, RequestCaps
    from sluice.service.config import ServerConfig

    server = ServerConfig()
    assert (DEFAULT_CAPS.max_n, DEFAULT_CAPS.max_prompts, DEFAULT_CAPS.max_embedding_inputs) == (16, 64, 128)
    assert max(DEFAULT_CAPS.max_n, DEFAULT_CAPS.max_prompts, DEFAULT_CAPS.max_embedding_inputs) \
        < server.max_queued_requests  # one request never fills the queue by itself
    caps = RequestCaps(max_n=4, max_prompts=8, max_embedding_inputs=300, max_queued=6)

    def refused(fn, *args) -> RequestError:
        with pytest.raises(RequestError) as info:
            fn(*args)
        assert info.value.status == 400
        return info.value

    assert parse_completion({"prompt": ["a"] * 3, "n": 2}, caps).n == 2  # 6: the queue's bound, reached
    e = refused(parse_completion, {"prompt": "a", "n": 5}, caps)
    assert e.param == "n" and "at most 4" in e.message and "--max-n" in e.message
    e = refused(parse_completion, {"prompt": [[1]] * 7}, caps)  # 7 <= --max-prompts-per-request, > the queue
    assert e.param == "prompt" and "--max-queued-requests" in e.message
    e = refused(parse_completion, {"prompt": ["a"] * 2, "n": 4}, caps)
    assert e.param == "n" and "2 x 4" in e.message
    e = refused(parse_chat, {"messages": MSG, "n": 5}, caps)
    assert e.param == "n" and "--max-n" in e.message
    caps.check_embedding_inputs(6)
    e = refused(caps.check_embedding_inputs, 7)
    assert e.param == "input" and "--max-queued-requests" in e.message
    e = refused(RequestCaps(4, 8, 3, 256).check_embedding_inputs, 4)
    assert e.param == "input" and "--max-embedding-inputs" in e.message


def test_the_cap_knobs_are_flags_and_must_be_positive():
    import argparse

    from sluice.service.api.protocol import RequestCaps
    from sluice.service.config import add_config_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    config = config_from_args(parser.parse_args(["--max-n", "2", "--max-prompts-per-request", "5",
                                                 "--max-embedding-inputs", "7"]))
    assert RequestCaps.of(config.server) == RequestCaps(2, 5, 7, 256)
    config.server.max_n = 0
    with pytest.raises(ValueError, match="max_n"):
        config.validate()
