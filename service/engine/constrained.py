"""The engine's side of constrained decoding: the grammar state, compiles, and rows a constraint ends."""

from __future__ import annotations

from sluice.scheduling.outcomes import ErrorCode, FinishReason
from sluice.scheduling.request import RequestStatus
from sluice.scheduling.sampling_params import StructuredOutput
from sluice.service.structured.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarState,
    GrammarStep,
    GrammarUnavailable,
)


class ConstrainedDecoding:
    """Mixed into LLMEngine: it owns `_grammar`, `_grammar_lock`, the scheduler, the runner and `_ended_output`."""

    @property
    def grammar(self) -> GrammarState:
        """Grammar compiler and matchers; xgrammar is loaded by the first constrained request, not at start."""
        with self._grammar_lock:
            if self._grammar is None:
                compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self._eos_ids, self.config.grammar)
                self._grammar = GrammarState(compiler, self.config.scheduler.max_num_seqs)
                self.runner.logits_preparers.append(self._grammar.start_masks)
                self.runner.logits_processors.append(self._grammar.mask_logits)
            return self._grammar

    def compile_grammar(self, constraint: StructuredOutput) -> None:
        """Compile and cache a constraint (thread-safe: the API calls it off the engine thread); GrammarError."""
        self._grammar_for(constraint).compiler.compile(constraint)

    async def compile_grammar_async(self, constraint: StructuredOutput) -> None:
        """compile_grammar for the event loop: a caller that leaves gives up its share of the compile."""
        await self._grammar_for(constraint).compiler.compile_async(constraint)

    def _grammar_for(self, constraint: StructuredOutput) -> GrammarState:
        try:
            return self.grammar
        except GrammarUnavailable as e:  # the client's request names what cannot be served here
            raise GrammarError(str(e), constraint.param, code="grammar_unavailable") from None

    def _advance_grammar(self, ro):
        """Feed the sampled token to the request's matcher; a completed grammar ends the request, a broken or
        too costly one ends it with an error (the returned output)."""
        step = self._grammar.accept(ro.request_id, ro.new_token_ids[-1])
        if step is GrammarStep.COMPLETE and not ro.finished:
            self.scheduler.finish_requests([ro.request_id], RequestStatus.FINISHED_STOPPED)
            ro.finished, ro.finish_reason = True, FinishReason.STOP
        if step not in (GrammarStep.REJECTED, GrammarStep.OVER_BUDGET):
            return None
        constraint = self._grammar.constraints[ro.request_id]
        if step is GrammarStep.REJECTED:
            message = f"the output broke the {constraint.param} constraint"
        else:
            message = (f"the {constraint.param} constraint took {self._grammar.last_cost_ms[ro.request_id]:.0f} ms "
                       f"of grammar work per token, more than the budget of "
                       f"{self.config.grammar.grammar_token_budget_ms:g} ms (--grammar-token-budget-ms); simplify it")
        if not ro.finished:
            self.scheduler.finish_requests([ro.request_id], RequestStatus.FINISHED_ABORTED)
        return self._ended_output(ro, FinishReason.ERROR, ErrorCode.CONSTRAINT_ERROR, message)

    def _end_rows_without_token(self, runner_out) -> list:
        """End the rows whose constraints together left no token to sample (their sampled id is meaningless)."""
        ended = []
        for rid in getattr(self.runner, "no_allowed_token", ()):
            runner_out.sampled.pop(rid, None)
            request = self.scheduler.requests.get(rid)
            if request is None:
                continue
            p = request.sampling_params
            names = [p.structured_output.param] if p.structured_output is not None else []
            names += [n for n, on in (("allowed_token_ids", p.allowed_token_ids is not None),
                                      ("bad_words", bool(p.bad_words_token_ids)),
                                      ("min_tokens", request.num_output_tokens < p.min_tokens)) if on]
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            ended.append(self._ended_output(
                request, FinishReason.ERROR, ErrorCode.CONSTRAINT_ERROR,
                f"no token satisfies {' and '.join(names) or 'the constraints'} at output token "
                f"{request.num_output_tokens}: the constraints together allow nothing"))
        return ended

