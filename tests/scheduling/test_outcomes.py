"""The typed outcomes: what each error code answers, and that the enums read as their plain text everywhere."""

from __future__ import annotations

import orjson
import pytest
from prometheus_client import CollectorRegistry

from sluice.metrics.families import FINISH_REASONS
from sluice.metrics.prometheus import SluiceMetrics
from sluice.scheduling.outcomes import ErrorCode, FinishReason, RequestRejected
from sluice.service.engine.outputs import EngineOutput
from tests.support.sched_helpers import make_request, make_scheduler

# (status, OpenAI error type, x-should-retry, message reaches the client): what clients saw before the enum.
EXPECTED = {
    "queue_timeout": (429, "rate_limit_error", False, True),
    "shutdown": (503, "server_error", True, True),
    "engine_dead": (503, "server_error", True, True),
    "step_failed": (500, "server_error", False, False),
    "detokenize_failed": (500, "server_error", False, False),
    "slow_reader": (408, "timeout_error", False, True),
    "constraint_error": (400, "invalid_request_error", False, True),
    "internal_error": (500, "server_error", False, False),
}


@pytest.mark.parametrize("code", sorted(EXPECTED))
def test_each_error_code_carries_its_http_answer(code):
    c = ErrorCode(code)
    assert (c.status, c.type, c.retry, c.public) == EXPECTED[code]


def test_enums_read_as_their_plain_text():
    for member in (FinishReason.STOP, ErrorCode.SLOW_READER):
        assert str(member) == f"{member}" == member.value and member == member.value
    assert orjson.loads(orjson.dumps({"r": FinishReason.LENGTH})) == {"r": "length"}
    assert FINISH_REASONS == ("stop", "length", "abort", "error")


def test_a_finish_reason_enum_counts_under_its_plain_label():
    reg = CollectorRegistry()
    m = SluiceMetrics("m", registry=reg)
    m.observe_finished(FinishReason.ABORT, 1.0, 3, 2)
    assert reg.get_sample_value("sluice_requests_finished_total", {"model_name": "m", "finish_reason": "abort"}) == 1


def test_ended_output_has_no_tokens_and_never_a_negative_cached_count():
    out = EngineOutput.ended("r", FinishReason.ERROR, ErrorCode.STEP_FAILED, "boom", 5, 2, -1)
    assert (out.finished, out.text, out.token_ids, out.num_cached_tokens) == (True, "", [], 0)
    assert (out.error_code, out.error, out.num_prompt_tokens, out.num_output_tokens) == ("step_failed", "boom", 5, 2)
    assert not EngineOutput.tokens("r", "x", [7], [], None, 1, 1, 0).finished


def test_the_scheduler_rejects_with_a_code():
    sched, _ = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(RequestRejected) as e:
        sched.add_request(make_request("big", list(range(1, 11)), max_tokens=8))
    assert e.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and isinstance(e.value, ValueError)
    sched.add_request(make_request("ok", [1, 2, 3, 4], max_tokens=4))
    with pytest.raises(RequestRejected) as e:
        sched.add_request(make_request("ok", [1, 2, 3, 4], max_tokens=4))
    assert e.value.code is ErrorCode.DUPLICATE_REQUEST_ID
