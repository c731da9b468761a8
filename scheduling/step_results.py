"""Applying a step's results to the scheduler's requests: progress, sampled tokens, stops, and a failed step."""

from __future__ import annotations

import bisect

from sluice.scheduling.output import ModelRunnerOutput, RequestOutput, SchedulerOutput
from sluice.scheduling.request import Request, RequestStatus


class StepResults:
    """Mixed into Scheduler: it owns `requests`, `running`, `swapped`, `waiting`, `kv`, `spec`, `counters`,
    `_stats`, `_release` and the in-flight bookkeeping these methods update."""

    def update_from_output(
        self, out: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Advance progress, append sampled tokens, finish requests that stopped, free their blocks."""
        self.kv.commit_swaps()  # the step ran: its copies are done
        self._in_flight, self._ended_in_flight = {}, []
        outputs: list[RequestOutput] = []
        any_finished = False
        for sched in out.scheduled:
            request = self.requests.get(sched.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # ended while the step ran (a WAITING one is a new request reusing the id)
            request.num_computed_tokens += sched.num_tokens
            if request.num_output_tokens == 0:
                self._stats.num_prompt_tokens += sched.num_tokens
            tokens = runner_output.spec_sampled.get(sched.request_id)
            if tokens is not None:  # verified drafts: progress covers the accepted ones only
                request.num_computed_tokens -= self.spec.num_rejected(sched, tokens, self._stats)
            elif (token := runner_output.sampled.get(sched.request_id)) is not None:
                tokens = [token]
            else:
                pooled = runner_output.pooled.get(sched.request_id) if runner_output.pooled else None
                if pooled is not None:  # an embedding request's last prompt chunk: it is done
                    request.status = RequestStatus.FINISHED_STOPPED
                    any_finished = True
                    self._release(request)
                    outputs.append(RequestOutput.of(request, [], [], pooled))
                continue  # else a prefill chunk that did not reach the end of the prompt
            tokens, status = self._append_until_stop(request, tokens)
            logprobs = runner_output.logprobs.get(sched.request_id)
            if status is not None:
                request.status = status
                any_finished = True
                self._release(request)
            elif sched.draft_token_ids:  # blocks holding only rejected drafts go back
                self.kv.trim(request, request.num_tokens)
            outputs.append(RequestOutput.of(request, tokens, [logprobs] if logprobs else []))
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _append_until_stop(self, request: Request, tokens: list[int]) -> tuple[list[int], RequestStatus | None]:
        """Append tokens up to and including the first that ends the request (as one-token steps would)."""
        for i, token in enumerate(tokens):
            request.append_output_token(token)
            self._stats.num_generation_tokens += 1
            status = self._check_stop(request, token)
            if status is not None:
                tokens = tokens[: i + 1]
                break
        request.update_block_hashes(self.block_size)
        self._charge_output(request, len(tokens))
        return tokens, status

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def fail_step(self, out: SchedulerOutput) -> list[RequestOutput]:
        """The step's copies or forward raised: fail what it computed, put back what it only moved.

        - scheduled requests end with an error; the blocks this step was to fill lose their prefix hashes;
        - requests resumed by a swap-in but not scheduled go back to `swapped`, onto the host slots that still
          hold their KV (those slots are released only after a step's copies succeed);
        - requests swapped out this step drop their unfinished host copy and wait to be recomputed.
        """
        outputs = []
        swapped_in = set(out.swapped_in_ids)
        # Every block a swap-in was to fill, whoever holds it now: its contents are unknown. The forward's own
        # blocks are handled per request below, from each one's start position on.
        self.kv.uncache_block_ids([dev for _, dev in out.swap_in])
        for sched in out.scheduled:
            request = self.requests.get(sched.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # ended while the step ran (a WAITING one is a new request reusing the id)
            request.status = RequestStatus.FINISHED_ERROR
            self.running.remove(request)
            self._release(request, uncache_from_block=sched.start_pos // self.block_size)
            outputs.append(RequestOutput.of(request, [], []))
        for rid in out.swapped_in_ids:
            request = self.requests.get(rid)
            if request is None or rid not in self.kv.swapping_in:
                continue  # failed above, or ended while the step ran
            self.kv.undo_swap_in(request)
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                request.status = RequestStatus.SWAPPED
                bisect.insort(self.swapped, request, key=self.key)
        for rid in out.swapped_out_ids:
            request = self.requests.get(rid)
            if request is None or rid in swapped_in or request.status != RequestStatus.SWAPPED:
                continue  # ended, or already back on its older host copy
            self.swapped.remove(request)
            self.kv.drop_host_blocks(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
            self.waiting.push_front(request)
        for sched in self._ended_in_flight:  # ended while the step ran: their blocks are free, not yet reused
            self.kv.uncache_block_ids(sched.block_ids[sched.start_pos // self.block_size :])
        self._in_flight, self._ended_in_flight = {}, []
        self.kv.commit_swaps()  # what is left pending belongs to requests that ended: nothing reads it now
        return outputs
