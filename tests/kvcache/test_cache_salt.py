"""cache_salt: requests share cached prefix blocks only when their salts are equal (per-tenant isolation)."""

from __future__ import annotations

import pytest

from sluice.scheduling.request import Request
from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.api.errors import RequestError
from sluice.service.api.protocol import parse_completion


def hashes(tokens, salt):
    r = Request("r", tokens, SamplingParams(cache_salt=salt))
    r.update_block_hashes(4)
    return r.block_hashes


def test_the_salt_changes_every_hash_of_the_chain_and_only_the_salt_does():
    tokens = list(range(12))
    plain, a, a_again, b = hashes(tokens, None), hashes(tokens, "a"), hashes(tokens, "a"), hashes(tokens, "b")
    assert len(plain) == len(a) == 3
    assert a == a_again
    assert all(x != y for x, y in zip(plain, a, strict=True))  # the chain carries the first block's salt
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_the_api_takes_a_bounded_string():
    assert parse_completion({"prompt": "x", "cache_salt": "tenant-7"}).params.cache_salt == "tenant-7"
    assert parse_completion({"prompt": "x"}).params.cache_salt is None
    for bad in ("", 5, ["a"], "x" * 257):
        with pytest.raises(RequestError) as e:
            parse_completion({"prompt": "x", "cache_salt": bad})
        assert e.value.param == "cache_salt"


def test_tenants_with_different_salts_never_hit_each_others_prefix(model_dir):
    from tests.support.tiny import tiny_engine

    engine = tiny_engine(model_dir, 64)
    prompt = "The capital of France is Paris. Hello world, how are you today? I am fine, thank you." * 2

    def cached(salt: str | None) -> int:
        rid = f"r-{salt}-{len(engine.scheduler.requests)}-{id(object())}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0, cache_salt=salt))
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.request_id == rid]
        return outs[-1].num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0  # the same tenant hits its own prefix
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached(None) > 0
