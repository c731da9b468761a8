"""Value ranges live once: the protocol models bound what clients send, the API builds SamplingParams from those
values without validating them again, and SamplingParams.validate (the check for in-process callers, run once per
request by the engine) accepts whatever the models accept."""

from __future__ import annotations

import json
from pathlib import Path

import annotated_types as at
import pytest

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.api.errors import RequestError
from sluice.service.api.preprocess import prepare_generate
from sluice.service.api.protocol import parse_completion, resolve_params
from sluice.service.api.protocol_models import CompletionRequest
from sluice.service.engine.async_engine import ModelInfo
from tests.support.tiny import tokenizer

BIG = 2**40  # a context no bound of the models reaches


def _edges():
    """(field, value) for each end of every numeric range CompletionRequest declares: the extremes it accepts."""
    for name, f in CompletionRequest.model_fields.items():
        for m in f.metadata:
            if isinstance(m, at.Ge):
                yield name, m.ge
            elif isinstance(m, at.Gt):
                yield name, m.gt + (1 if isinstance(m.gt, int) else 1e-9)
            elif isinstance(m, at.Le):
                yield name, m.le
            elif isinstance(m, at.Lt):
                yield name, m.lt - 1


EDGES = [*_edges(), ("logit_bias", {"1": -100, "2": 100}), ("allowed_token_ids", [1]), ("stop", ["x"]),
         ("bad_words", ["x"]), ("stop_token_ids", [0])]


def test_the_edges_cover_the_sampling_ranges():
    names = {name for name, _ in EDGES}
    assert {"temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "max_tokens", "logprobs",
            "presence_penalty", "frequency_penalty", "repetition_penalty"} <= names


@pytest.mark.parametrize("name,value", EDGES, ids=lambda v: str(v)[:24])
def test_what_the_models_accept_validate_accepts(name, value):
    body = {"prompt": [1], name: value}
    if name == "min_tokens":
        body["max_tokens"] = max(value, 1)
    params = resolve_params(parse_completion(body), [1], max_model_len=BIG, vocab_size=100)
    params.validate()  # the engine's check never refuses what the API let through


def test_validate_still_guards_in_process_callers():
    for bad in ({"temperature": 2.5}, {"top_p": 0.0}, {"min_tokens": 5, "max_tokens": 2}, {"stop": [""]},
                {"logprobs": 21}, {"repetition_penalty": 0.0}, {"logit_bias": {1: 101.0}}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad).validate()


def test_min_tokens_past_max_tokens_is_the_apis_400():
    with pytest.raises(RequestError) as e:
        resolve_params(parse_completion({"prompt": [1], "max_tokens": 2, "min_tokens": 5}), [1], 50, 100)
    assert (e.value.status, e.value.param) == (400, "min_tokens")


def test_the_api_path_never_calls_validate(monkeypatch):
    def refuse(self):
        raise AssertionError("SamplingParams.validate called on the API path")

    monkeypatch.setattr(SamplingParams, "validate", refuse)
    model = ModelInfo("tiny", 256, 400, tokenizer())
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 2, "temperature": 0.5}).encode()
    done = prepare_generate(chat, True, model, "none")
    assert len(done.batch) == 2 and done.batch[0][2].temperature == 0.5
    text = json.dumps({"prompt": ["Hello", "world"], "max_tokens": 3, "min_tokens": 1}).encode()
    assert len(prepare_generate(text, False, model, "none").batch) == 2


def test_validate_has_one_caller_the_engine():
    root = Path(__file__).resolve().parents[2] / "service"
    callers = [p.relative_to(root).as_posix() for p in root.rglob("*.py") if "params.validate()" in p.read_text()]
    assert callers == ["engine/engine.py"]
