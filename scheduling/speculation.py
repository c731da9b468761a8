"""The scheduler's side of n-gram speculative decoding: which decoding requests draft, how many tokens, and what
verification did to their progress.

A request with d drafts is scheduled as 1 + d tokens (its last known token, then the drafts), so
`num_computed_tokens` stays the one measure of progress: after the step it advances by 1 + the accepted drafts,
and the blocks that then hold only rejected drafts are freed. Drafts never cost another request its place:
they get only the KV blocks left over after one block for each running request still to be scheduled, and
only the step budget left over. Drafts never enter the prefix cache: block hashes cover known tokens only.
"""

from __future__ import annotations

from sluice.kvcache.manager import KVCacheManager, cdiv
from sluice.scheduling.config import SchedulerConfig
from sluice.scheduling.ngram import TokenBytes, propose
from sluice.scheduling.output import ScheduledRequest, SchedulerStats
from sluice.scheduling.request import Request
from sluice.scheduling.sampling_params import SamplingParams


def may_speculate(p: SamplingParams) -> bool:
    """Structured outputs, logprobs and token restrictions are per-token state the verify step does not carry
    across positions: such requests decode without drafts (embedding requests do not decode at all)."""
    return (p.pooling is None and p.structured_output is None and p.logprobs is None
            and p.allowed_token_ids is None and not p.bad_words_token_ids)


class Speculation:
    """Proposes drafts for decoding requests within the step's budget and free blocks; counts the outcomes."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.enabled = config.speculative_method == "ngram"
        self.k = config.num_speculative_tokens
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max
        self.window = config.prompt_lookup_window
        self.kv = kv
        self.max_model_len = max_model_len

    def drafts(self, request: Request, num_new_tokens: int, budget: int, reserve_blocks: int) -> list[int]:
        """Drafts to verify after the request's last token this step ([] when it should just decode).

        `reserve_blocks`: free blocks to leave for the running requests scheduled after this one.
        """
        p = request.sampling_params
        if not self.enabled or num_new_tokens != 1 or not may_speculate(p):
            return []
        bs, computed = self.kv.block_size, request.num_computed_tokens
        room = (self.kv.num_held_blocks(request.request_id) + self.kv.num_free_blocks - reserve_blocks) * bs
        limit = min(self.k, budget - 1, p.max_tokens - request.num_output_tokens - 1,
                    self.max_model_len - request.num_tokens - 1, room - computed - 1)
        if limit < 1:
            return []
        if request.token_bytes is None:
            request.token_bytes = TokenBytes(request.all_token_ids)
        drafts = propose(request.token_bytes, limit, self.n_min, self.n_max, self.window)
        assert not drafts or cdiv(computed + 1 + len(drafts), bs) <= room // bs
        return drafts

    @staticmethod
    def num_rejected(sched: ScheduledRequest, tokens: list[int], stats: SchedulerStats) -> int:
        """Count a verified run (`tokens`: accepted drafts + one) in `stats`; returns the drafts rejected."""
        d, accepted = len(sched.draft_token_ids), len(tokens) - 1
        assert 0 <= accepted <= d, f"{accepted} tokens accepted of {d} drafts"
        stats.spec_num_drafts += 1
        stats.spec_num_draft_tokens += d
        stats.spec_num_accepted_tokens += accepted
        per_pos = stats.spec_accepted_per_pos
        per_pos.extend([0] * (d - len(per_pos)))
        for i in range(accepted):
            per_pos[i] += 1
        return d - accepted
