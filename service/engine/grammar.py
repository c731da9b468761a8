"""Grammar-constrained decoding with xgrammar: compile once per constraint text, mask the batch's logits per step.

A request's matcher is its grammar state. It advances only when a token is sampled for the request, so it
follows the request through chunked prefill (no token until the prompt is done), recompute preemption (the
generated tokens are kept, only their KV is recomputed) and swap, and each of `n` samples has its own.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict

import torch

from sluice.scheduling.output import ScheduledRequest
from sluice.scheduling.sampling_params import StructuredOutput

logger = logging.getLogger("sluice.grammar")
CACHE_SIZE = 512  # compiled grammars kept, least recently used dropped: agents resend the same schemas


class GrammarError(ValueError):
    """A constraint that does not compile; `param` names the API parameter it came from."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class GrammarCompiler:
    """Compiles StructuredOutput constraints for one tokenizer, thread-safe, cached by the constraint text."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr  # imported on first use: engines without constrained requests never pay for it

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.vocab_size = vocab_size
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: StructuredOutput):
        """The compiled grammar; GrammarError when the schema, regex, choice list or grammar is invalid."""
        with self._lock:
            compiled = self._cache.get(constraint.key)
            if compiled is not None:
                self._cache.move_to_end(constraint.key)
                return compiled
        try:
            compiled = self._compile(constraint)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar reports bad input as RuntimeError with its parser's message
            reason = str(e).split("\n")[0]
            reason = reason.split("] ", 1)[-1].split(": ", 1)[-1] if "] " in reason else reason
            raise GrammarError(f"invalid {constraint.param}: {reason}", constraint.param) from None
        with self._lock:
            self._cache[constraint.key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, c: StructuredOutput):
        compiler = self._compiler
        if c.kind == "json_object":  # any JSON object, with the same compact whitespace as schemas get
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if c.kind == "json":
            try:
                json.loads(c.spec)
            except ValueError:
                raise GrammarError(f"invalid {c.param}: the schema is not valid JSON", c.param) from None
            schema = _bounded_strings_without_controls(json.loads(c.spec))
            # Compact separators: a small model free to emit "any whitespace" can pad a reply until max_tokens.
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        if c.kind == "regex":
            return compiler.compile_regex(c.spec)
        if c.kind == "choice":
            choices = json.loads(c.spec)
            # Raw UTF-8 in the literals: JSON's \ud83d-style escapes would be read as lone surrogate code points.
            literals = (json.dumps(x, ensure_ascii=False) for x in choices)
            return compiler.compile_grammar("root ::= " + " | ".join(literals))
        if c.kind == "grammar":
            return compiler.compile_grammar(c.spec)
        raise GrammarError(f"unknown structured output kind {c.kind!r}", c.param)


def _bounded_strings_without_controls(node):
    """Length-bounded strings as a pattern that keeps control characters out.

    xgrammar (0.2.9) lets a string with minLength/maxLength hold raw control characters, which no JSON parser
    accepts. The pattern form is exact about length and refuses them; it also refuses escapes (quotes,
    backslashes, \\n) inside such strings, a smaller loss than a reply that does not parse.
    """
    if isinstance(node, list):
        return [_bounded_strings_without_controls(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _bounded_strings_without_controls(v) for k, v in node.items()}
    bounded = "minLength" in out or "maxLength" in out
    plain = not any(k in out for k in ("pattern", "format", "enum", "const"))
    if out.get("type") == "string" and bounded and plain:
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        upper = "" if high is None else str(int(high))
        out["pattern"] = "^[^\\x00-\\x1f\"\\\\]{" + f"{low},{upper}" + "}$"
    return out


class GrammarState:
    """The matchers of the constrained requests in flight, and the bitmask the sampler's logits are masked by."""

    def __init__(self, compiler: GrammarCompiler, max_num_seqs: int):
        self.compiler = compiler
        self._xgr = compiler._xgr
        self.matchers: dict[str, object] = {}
        self._bitmask = self._xgr.allocate_token_bitmask(max_num_seqs, compiler.vocab_size)

    def add(self, request_id: str, constraint: StructuredOutput) -> None:
        """Start a request's matcher (the compile is a cache hit when the API compiled it first)."""
        self.matchers[request_id] = self._xgr.GrammarMatcher(self.compiler.compile(constraint))

    def remove(self, request_id: str) -> None:
        """Forget a request that ended."""
        self.matchers.pop(request_id, None)

    def mask_logits(self, logits: torch.Tensor, to_sample: list[ScheduledRequest]) -> None:
        """Set the logits of every token the grammar forbids to -inf, for the constrained rows only."""
        if not self.matchers:
            return
        rows = [i for i, r in enumerate(to_sample) if r.request_id in self.matchers]
        if not rows:
            return
        bitmask = self._bitmask
        if bitmask.shape[0] < len(to_sample):
            bitmask = self._bitmask = self._xgr.allocate_token_bitmask(len(to_sample), self.compiler.vocab_size)
        for i in rows:
            self.matchers[to_sample[i].request_id].fill_next_token_bitmask(bitmask, i)
        mask = bitmask[: len(to_sample)]
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)
        width = min(logits.shape[-1], self.compiler.vocab_size)
        self._xgr.apply_token_bitmask_inplace(logits[:, :width], mask, indices=rows)
        if logits.shape[-1] > width:  # padded vocabulary rows past the tokenizer's: never grammatical
            logits[rows, width:] = float("-inf")

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance a request's matcher by its sampled token; True once the grammar is complete."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token_id):
            logger.error("request %s: sampled token %d rejected by its grammar", request_id, token_id)
            return True
        return matcher.is_terminated()
