"""The verify step on its own: greedy acceptance is exact, rejection sampling emits tokens distributed as p."""

import pytest
import torch

from sluice.scheduling.output import ScheduledRequest
from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.executor.sampler import draw, filtered_logits
from sluice.service.executor.spec_verify import expand_rows, verify

# chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails once in a thousand runs,
# and the draws are seeded, so a run either always passes or always fails.
CHI2_CRITICAL = {3: 16.27, 4: 18.47, 5: 20.52}


def request(rid: str, drafts: list[int], params: SamplingParams, num_output_tokens: int = 3) -> ScheduledRequest:
    return ScheduledRequest(rid, [0, *drafts], 10, [0], True, params, num_output_tokens,
                            token_history=None, num_prompt_tokens=7, draft_token_ids=drafts)


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True) if p > 0)


def test_greedy_accepts_while_drafts_equal_the_argmax_then_emits_it():
    logits = torch.full((4, 5), -1.0)
    for row, best in enumerate([2, 4, 1, 3]):
        logits[row, best] = 1.0
    greedy = SamplingParams(temperature=0.0)
    # drafts 2, 4, 0: two accepted, the third rejected -> the argmax of the third position (1)
    reqs = [request("a", [2, 4, 0], greedy)]
    assert verify(logits, reqs, expand_rows(reqs)) == [[2, 4, 1]]
    reqs = [request("b", [2, 4, 1], greedy)]  # all accepted: the bonus token from the last position
    assert verify(logits, reqs, expand_rows(reqs)) == [[2, 4, 1, 3]]
    reqs = [request("c", [0, 4, 1], greedy)]
    assert verify(logits, reqs, expand_rows(reqs)) == [[2]]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
], ids=["plain", "top_k", "top_p"])
@pytest.mark.parametrize("draft", [0, 3])  # a likely draft and an unlikely one
def test_rejection_sampling_emits_tokens_distributed_as_p(params, draft):
    """Over many one-draft verifications, the first emitted token is distributed as p at the first position, and
    the bonus token (after an accepted draft) as p at the second."""
    torch.manual_seed(0)
    first = torch.tensor([2.0, 1.0, 0.5, -0.5, 0.0, 1.5])
    second = torch.tensor([0.0, 2.5, -1.0, 1.0, 0.5, 0.0])
    n = 10_000
    reqs = [request(f"r{i}", [draft], params) for i in range(n)]
    logits = torch.stack([first, second]).repeat(n, 1)
    runs = verify(logits.clone(), reqs, expand_rows(reqs))
    p_first = torch.softmax(filtered_logits(first[None], [reqs[0]])[0][0], -1).tolist()
    p_second = torch.softmax(filtered_logits(second[None], [reqs[0]])[0][0], -1).tolist()
    counts = [sum(1 for run in runs if run[0] == t) for t in range(6)]
    support = sum(1 for p in p_first if p > 0)
    assert chi_square(counts, p_first) < CHI2_CRITICAL.get(support - 1, 20.52), (counts, p_first)
    assert all(c == 0 for c, p in zip(counts, p_first, strict=True) if p == 0)
    bonus = [run[1] for run in runs if len(run) == 2]
    assert all(run[0] == draft for run in runs if len(run) == 2)
    if len(bonus) > 1000:
        bonus_counts = [bonus.count(t) for t in range(6)]
        support = sum(1 for p in p_second if p > 0)
        assert chi_square(bonus_counts, p_second) < CHI2_CRITICAL.get(support - 1, 20.52), (bonus_counts, p_second)


def test_seeded_verification_is_reproducible_and_depends_on_the_seed():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)).repeat(40, 1)

    def runs(seed):
        reqs = [request(f"r{i}", [7, 8], SamplingParams(temperature=1.0, seed=seed + i)) for i in range(40)]
        return verify(logits.clone(), reqs, expand_rows(reqs))

    assert runs(11) == runs(11)
    assert runs(11) != runs(12)


def test_expanded_rows_see_the_drafts_before_them():
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, min_tokens=5)
    history = [1, 2, 3]
    r = ScheduledRequest("a", [3, 8, 9], 2, [0], True, params, 3, token_history=history, num_prompt_tokens=1,
                         min_tokens_pending=True, draft_token_ids=[8, 9])
    rows = expand_rows([r])
    assert [row.token_history for row in rows] == [[1, 2, 3], [1, 2, 3, 8], [1, 2, 3, 8, 9]]
    assert [row.num_output_tokens for row in rows] == [3, 4, 5]
    assert [row.min_tokens_pending for row in rows] == [True, True, False]
    assert history == [1, 2, 3]  # the request's own list is never extended


def test_sampled_verification_emits_what_one_token_sampling_draws_at_each_position():
    """Accepting a draft exactly when the position's one-token draw equals it: the emitted run is the one-token
    decoder's, position by position, for every seed (and the acceptance rate is still p(draft))."""
    gen = torch.Generator().manual_seed(3)
    params = [SamplingParams(temperature=0.8, top_k=6, seed=s) for s in range(200)]
    logits = torch.randn(3, 8, generator=gen) * 2
    drafts = [int(logits[0].argmax()), int(logits[1].argmax())]
    reqs = [request(f"r{i}", drafts, p) for i, p in enumerate(params)]
    runs = verify(logits.repeat(len(reqs), 1), reqs, expand_rows(reqs))
    for r, run in zip(reqs, runs, strict=True):
        one_token = []
        for j, row in enumerate(expand_rows([r])):
            x, u = filtered_logits(logits[j][None], [row])
            one_token.append(int(draw(x, u)[0]))
            if j == len(drafts) or one_token[-1] != drafts[j]:
                break
        assert run == one_token
    assert 0 < sum(len(run) > 1 for run in runs) < len(runs)  # some accepted, some rejected
