"""The scheduler with speculation on, over the fake runner: drafts take budget and free blocks only, rejected
ones are rolled back and their blocks freed, nothing unverified is prefix-cached, outputs stay the reference's."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tests.support.fake_runner as fake
from sluice.kvcache.manager import cdiv
from sluice.scheduling.output import ModelRunnerOutput
from sluice.scheduling.request import RequestStatus
from tests.support.profiles import examples
from tests.support.sched_helpers import check_invariants, make_request, make_scheduler


def copying_token(tokens: list[int]) -> int:
    """A fake model that mostly copies the token 3 back (so n-gram drafts often hold), sometimes not."""
    h = int.from_bytes(fake.hashlib.blake2b(repr(tokens).encode(), digest_size=8).digest(), "little")
    return tokens[-3] if len(tokens) >= 3 and h % 4 else h % fake.VOCAB


class SpecRunner(fake.FakeRunner):
    """The fake runner, verifying drafts greedily: position j's token is the model's on the slots read back."""

    def execute(self, out) -> ModelRunnerOutput:
        result = super().execute(out)  # writes every scheduled token (drafts too) into its slot
        for s in out.scheduled:
            if not s.draft_token_ids:
                continue
            del result.sampled[s.request_id]
            run = []
            for j in range(len(s.draft_token_ids) + 1):
                end = s.start_pos + 1 + j
                seq = [self._read(s, pos) for pos in range(end)]
                token = fake.next_token(seq)
                run.append(token)
                if j == len(s.draft_token_ids) or token != s.draft_token_ids[j]:
                    break
            result.spec_sampled[s.request_id] = run
        return result

    def _read(self, s, pos: int) -> int:
        entry = self.slots[s.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size]
        assert entry is not None and entry[1] == pos, f"slot for pos {pos} of {s.request_id} holds {entry}"
        return entry[0]


def check_spec_invariants(sched) -> None:
    """No block past a request's known tokens outlives its step; hashed blocks hold known tokens only."""
    kv = sched.kv
    for rid, blocks in kv.req_blocks.items():
        request = sched.requests[rid]
        assert len(blocks) <= cdiv(request.num_tokens, kv.block_size), f"{request} keeps rejected-draft blocks"
        for i, block in enumerate(blocks):
            if block.block_hash is not None and i < kv.req_num_cached.get(rid, 0):
                assert block.block_hash == request.block_hashes[i], f"block {i} of {rid} is cached with other tokens"


workload = st.fixed_dictionaries({
    "num_blocks": st.integers(10, 40),
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "num_host_blocks": st.integers(0, 24),
    "mode": st.sampled_from(["recompute", "swap"]),
    "budget": st.integers(2, 40),
    "k": st.integers(1, 6),
    "n_min": st.integers(1, 2),
    "prefix_caching": st.booleans(),
    "requests": st.lists(st.tuples(st.integers(2, 24), st.integers(1, 24), st.integers(0, 3), st.integers(0, 20),
                                   st.one_of(st.none(), st.integers(0, 40))), min_size=1, max_size=8),
})


@settings(max_examples=examples(120, 1200, "SLUICE_HYPOTHESIS_EXAMPLES"), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(workload)
def test_speculating_workloads_keep_block_accounting_and_outputs(w):
    original = fake.next_token
    fake.next_token = copying_token
    try:
        _run_workload(w)
    finally:
        fake.next_token = original


def _run_workload(w):
    bs = w["block_size"]
    sched, _ = make_scheduler(num_blocks=w["num_blocks"], block_size=bs, num_host_blocks=w["num_host_blocks"],
                              prefix_caching=w["prefix_caching"], preemption_mode=w["mode"], max_num_seqs=8,
                              max_num_batched_tokens=w["budget"], speculative_method="ngram",
                              num_speculative_tokens=w["k"], prompt_lookup_min=w["n_min"], prompt_lookup_max=3)
    runner = SpecRunner(w["num_blocks"], bs, w["num_host_blocks"])
    capacity = w["num_blocks"] * bs
    pending, outputs, aborted, drafted = [], {}, set(), 0
    for i, (plen, max_tokens, fam, arrive, abort_at) in enumerate(w["requests"]):
        plen = min(plen, capacity - 1)
        prompt = [(fam * 7 + j % 5) % 11 for j in range(plen)]  # repetitive: something to copy
        pending.append((arrive, f"r{i}", prompt, min(max_tokens, capacity - plen), abort_at))
    for step in range(3000):
        for arrive, rid, prompt, mt, _ in pending:
            if arrive == step:
                sched.add_request(make_request(rid, prompt, max_tokens=mt, arrival=float(step)))
        for _, rid, _, _, abort_at in pending:
            if abort_at == step and rid in sched.requests:
                sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                aborted.add(rid)
        if step > max(a for a, *_ in pending) and not sched.num_unfinished:
            break
        out = sched.schedule()
        assert out.num_batched_tokens <= w["budget"]
        drafted += sum(len(s.draft_token_ids) for s in out.scheduled)
        for ro in sched.update_from_output(out, runner.execute(out)):
            outputs.setdefault(ro.request_id, []).extend(ro.new_token_ids)
        check_invariants(sched)
        check_spec_invariants(sched)
    assert not sched.num_unfinished
    kv = sched.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.swap_space.num_free_blocks == kv.swap_space.num_blocks
    for _, rid, prompt, mt, _ in pending:
        if rid not in aborted:
            assert outputs[rid] == fake.reference_output(prompt, mt), rid


def test_drafts_are_scheduled_accepted_and_counted():
    """One repetitive request alone: drafts are verified, some accepted, and the stats add up."""
    fake_next, fake.next_token = fake.next_token, copying_token
    try:
        sched, _ = make_scheduler(num_blocks=32, block_size=4, speculative_method="ngram", num_speculative_tokens=4)
        runner = SpecRunner(32, 4)
        prompt = [1, 2, 3] * 4
        sched.add_request(make_request("a", prompt, max_tokens=30))
        out_tokens, steps, totals = [], 0, [0, 0, 0]
        while sched.num_unfinished:
            out = sched.schedule()
            assert all(len(s.draft_token_ids) <= 4 for s in out.scheduled)
            for ro in sched.update_from_output(out, runner.execute(out)):
                out_tokens += ro.new_token_ids
            stats = sched.make_stats()
            totals = [a + b for a, b in zip(totals, (stats.spec_num_drafts, stats.spec_num_draft_tokens,
                                                     stats.spec_num_accepted_tokens), strict=True)]
            steps += 1
        assert out_tokens == fake.reference_output(prompt, 30)
        drafts, draft_tokens, accepted = totals
        assert drafts > 0 and 0 < accepted <= draft_tokens <= 4 * drafts
        assert steps + accepted == 30  # every step emits one token plus the drafts it accepted
    finally:
        fake.next_token = fake_next


def test_drafts_never_take_the_last_token_of_the_budget_or_past_max_tokens():
    sched, _ = make_scheduler(num_blocks=32, block_size=4, speculative_method="ngram", num_speculative_tokens=8,
                              max_num_batched_tokens=3)
    sched.add_request(make_request("a", [5, 5, 5, 5, 5, 5], max_tokens=4))
    out = sched.schedule()  # prefill: 3 tokens of budget, no drafts
    assert out.scheduled[0].num_tokens == 3 and not out.scheduled[0].draft_token_ids
    sched.update_from_output(out, ModelRunnerOutput())
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(sampled={"a": 5}))
    out = sched.schedule()  # decoding: 3 tokens of budget leave room for 2 drafts (K is 8)
    assert out.scheduled[0].draft_token_ids == [5, 5] and out.scheduled[0].token_ids == [5, 5, 5]
    # The first draft accepted, the second rejected: progress counts the last token and one draft.
    sched.update_from_output(out, ModelRunnerOutput(spec_sampled={"a": [5, 6]}))
    request = sched.requests["a"]
    assert request.output_token_ids == [5, 5, 6] and request.num_computed_tokens == 8
    out = sched.schedule()  # 3 of 4 output tokens emitted: no draft can be used
    assert out.scheduled[0].draft_token_ids == []
