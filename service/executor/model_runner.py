"""Runs one engine step on the model: block swaps, one packed forward over every scheduled request, sampling
(and pooling, for embedding requests)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sluice.kvcache.config import CacheConfig
from sluice.kvcache.transfer import tensors_to_device, to_device
from sluice.scheduling.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from sluice.service.attention import triton_decode
from sluice.service.attention.attention_backend import ATTN_IMPLEMENTATION, register
from sluice.service.attention.decode_kernel import load as load_decode_kernel
from sluice.service.attention.paged_attention import KERNEL_ROWS_MAX, AttentionMetadata, resolve_backend
from sluice.service.executor.decode_buffers import DecodeBuffers, DecodeStep
from sluice.service.executor.forward_context import ForwardContext, get_forward_context, set_forward_context
from sluice.service.executor.kv_sizing import KVShape, kv_cache_blocks
from sluice.service.executor.layers.attention import PagedAttention
from sluice.service.executor.models.llama import LlamaForCausalLM
from sluice.service.executor.models.packed import packed_hidden, packed_logits
from sluice.service.executor.pooling import Pooler
from sluice.service.executor.sampler import pending_stops, sample
from sluice.service.executor.spec_verify import expand_rows, verify

GiB = 1 << 30


class ModelRunner:
    """Owns the paged KV tensors and turns a SchedulerOutput into sampled tokens."""

    def __init__(
        self,
        model,
        cache_config: CacheConfig,
        device: torch.device | str,
        dtype: torch.dtype,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int = 0,
        preemption_mode: str = "recompute",
    ):
        self.model = model
        # Sluice's own model calls the paged attention itself; a transformers one does through its
        # AttentionInterface (idempotent: a caller-built model may still be on sdpa/eager).
        if not isinstance(model, LlamaForCausalLM):
            model.set_attn_implementation(register(get_forward_context))
            if model.config._attn_implementation != ATTN_IMPLEMENTATION:
                raise ValueError(f"{type(model).__name__} does not dispatch attention through transformers' "
                                 "AttentionInterface, so it cannot use the paged KV cache")
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.block_size = cache_config.block_size
        self.kv_dtype = cache_config.cache_dtype(dtype)
        self.attention_backend = resolve_backend(cache_config.attention_backend, self.device, self.block_size,
                                                 mixed_dtypes=self.kv_dtype != dtype)
        shape = KVShape.of(model, self.block_size, self.kv_dtype)
        # --num-kv-blocks, else --kv-cache-memory in GiB, else auto (on CUDA after a profile forward): kv_sizing.
        self.num_kv_blocks, self.kv_cache_source = kv_cache_blocks(
            model, cache_config, self.device, shape, max_num_batched_tokens, max_num_seqs, max_model_len,
            self.attention_backend,
        )
        self.kv_cache_bytes = self.num_kv_blocks * shape.block_bytes
        # Swap 'auto' on CPU with preemption mode swap: a host pool as large as the cache (up to a cap).
        swap_gib = cache_config.swap_space_gib(self.device.type, preemption_mode, self.kv_cache_bytes / GiB)
        self.num_host_blocks = int(swap_gib * GiB // shape.block_bytes)
        # One block past the pool's: the scratch block padding rows of a decode step write to and read from.
        self.kv = shape.allocate(self.num_kv_blocks + 1, self.device, self.num_host_blocks)
        # A sequence holds at most max_model_len tokens, and never more blocks than the cache has.
        max_blocks = -(-max_model_len // self.block_size) if max_model_len else self.num_kv_blocks
        self.decode_buffers = DecodeBuffers(max_num_seqs, min(max_blocks, self.num_kv_blocks), self.block_size,
                                            self.num_kv_blocks, self.device, pad=self.device.type == "cuda")
        # Decode steps on CUDA attend through the Triton kernel that reads lengths and tables on the device: one
        # shape per row count, so a CUDA graph per size replays every later step (cuda_graphs.py).
        self.decode_tables = self.attention_backend in ("flex", "triton") and triton_decode.available(self.device)
        self.graphs = None  # DecodeGraphs, once the engine has captured them (capture_graphs)
        self.decode_kernel = None
        if cache_config.cpu_decode_kernel and self.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            self.decode_kernel = load_decode_kernel()
        self.kernel_rows_max = self._kernel_rows_max(model, dtype)
        # Called as process(logits [rows, vocab] float32, requests sampled from those rows) before sampling.
        self.logits_processors: list[Callable[[torch.Tensor, list[ScheduledRequest]], None]] = []
        # Called with the same rows before the forward, so that their host work (grammar masks) overlaps it.
        self.logits_preparers: list[Callable[[list[ScheduledRequest]], None]] = []
        self.no_allowed_token: list[str] = []  # the last step's rows whose constraints left no token to sample
        self.lora_slots = None  # LoRASlots where the engine serves adapters (lora/manager.py)
        self.pooler = Pooler()  # embedding requests: pooled final hidden states, partial sums across chunks

    def _kernel_rows_max(self, model, dtype: torch.dtype) -> int:
        """The most query rows of a sequence the decode kernel attends (AttentionMetadata.build): every row of a
        step where Sluice's own model has no layer the kernel cannot take (a sliding window) and the kernel's
        vector path takes its heads; else a verify step's rows (KERNEL_ROWS_MAX)."""
        kernel = self.decode_kernel
        if kernel is None or not isinstance(model, LlamaForCausalLM):  # (build applies it on the torch backend)
            return KERNEL_ROWS_MAX
        layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        if not layers or any(m.sliding_window for m in layers):
            return KERNEL_ROWS_MAX
        shapes = {(m.num_heads, m.num_kv_heads, m.head_dim) for m in layers}
        if not all(kernel.attends_chunks(*heads, dtype, self.kv_dtype) for heads in shapes):
            return KERNEL_ROWS_MAX
        return max(self.max_num_batched_tokens, KERNEL_ROWS_MAX)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Swap in, swap out, then run the scheduled tokens and sample for requests flagged `sample`."""
        # Every swap-in before every swap-out: a request resumed and preempted again in one step must copy out
        # what its swap-in just brought back. check_copy_order() refuses schedules this order would corrupt.
        out.check_copy_order()
        self.kv.swap_in(out.swap_in)
        self.kv.swap_out(out.swap_out)
        if self.pooler.partial and out.finished_ids:
            self.pooler.forget(out.finished_ids)
        if not out.scheduled:
            return ModelRunnerOutput()
        decode = all(r.num_tokens == 1 for r in out.scheduled) and self.decode_buffers.size_for(len(out.scheduled))
        lora = None if self.lora_slots is None else self.lora_slots.batch(
            [r.sampling_params.lora_request for r in out.scheduled], [r.num_tokens for r in out.scheduled])
        to_sample = [r for r in out.scheduled if r.sample]
        speculating = any(r.draft_token_ids for r in to_sample)
        rows = expand_rows(to_sample) if speculating else to_sample  # a request with d drafts: 1 + d rows
        for prepare in self.logits_preparers:
            prepare(rows)
        pooled = {}
        if decode and lora is None and self.graphs is not None and decode in self.graphs:
            logits = self._replay_decode(out.scheduled)
        else:
            input_ids, positions, meta, sample_rows = (self._prepare_decode if decode else self._prepare)(
                out.scheduled)
            with set_forward_context(ForwardContext(meta, self.kv.layers, lora)):
                if any(r.sampling_params.pooling is not None for r in out.scheduled):
                    logits, pooled = self._forward_pooling(input_ids, positions, sample_rows, out.scheduled)
                else:
                    logits = self._forward(input_ids, positions, sample_rows)
        if not to_sample:
            return ModelRunnerOutput(pooled=pooled)
        logits = logits.float()
        for process in self.logits_processors:  # penalties, biases, grammar masks: in place, batched
            process(logits, rows)
        constrained, dead = _rows_without_token(logits, rows)
        result = ModelRunnerOutput(pooled=pooled)
        if speculating:
            logits, to_sample = self._verify(logits, to_sample, rows, result)
        if to_sample:
            sampled = sample(logits, to_sample)  # its read-back syncs: `dead` is on the host after it
            result.sampled = {r.request_id: t for r, t in zip(to_sample, sampled.token_ids, strict=True)}
            result.logprobs = {r.request_id: lp for r, lp in zip(to_sample, sampled.logprobs, strict=True)
                               if lp is not None}
        self.no_allowed_token = [rows[i].request_id for i, d in zip(constrained, dead.tolist(), strict=True) if d]
        return result

    @staticmethod
    def _verify(logits: torch.Tensor, to_sample: list[ScheduledRequest], rows: list[ScheduledRequest],
                result: ModelRunnerOutput) -> tuple[torch.Tensor, list[ScheduledRequest]]:
        """Verify the drafts of the requests that have some (into result.spec_sampled); returns the logits and
        requests left for plain sampling."""
        plain, spec, plain_rows, spec_rows, i = [], [], [], [], 0
        for r in to_sample:
            width = 1 + len(r.draft_token_ids)
            (spec if r.draft_token_ids else plain).append(r)
            (spec_rows if r.draft_token_ids else plain_rows).extend(range(i, i + width))
            i += width
        index = to_device(spec_rows, torch.long, logits.device)
        runs = verify(logits[index], spec, [rows[j] for j in spec_rows])
        result.spec_sampled = {r.request_id: run for r, run in zip(spec, runs, strict=True)}
        return (logits[to_device(plain_rows, torch.long, logits.device)] if plain else logits[:0]), plain

    def _prepare(self, scheduled: list[ScheduledRequest]):
        """Packed input ids, positions, attention metadata and the rows whose logits are needed."""
        query_lens = [r.num_tokens for r in scheduled]
        seq_lens = [r.start_pos + r.num_tokens for r in scheduled]
        input_ids = torch.tensor([t for r in scheduled for t in r.token_ids], dtype=torch.long)
        width = max(len(r.block_ids) for r in scheduled)
        block_tables = torch.tensor([r.block_ids + [0] * (width - len(r.block_ids)) for r in scheduled],
                                    dtype=torch.int32)
        q_lens = torch.tensor(query_lens)
        cu_q = torch.zeros(len(scheduled) + 1, dtype=torch.long)
        torch.cumsum(q_lens, 0, out=cu_q[1:])
        # position of token t = start_pos of its sequence + (t - first row of its sequence)
        seq_of_token = torch.repeat_interleave(torch.arange(len(scheduled)), q_lens)
        starts = torch.tensor([r.start_pos for r in scheduled])
        positions = torch.arange(len(input_ids)) + (starts - cu_q[:-1])[seq_of_token]
        blocks = block_tables[seq_of_token, positions // self.block_size].long()
        slot_mapping = blocks * self.block_size + positions % self.block_size
        if any(r.draft_token_ids for r in scheduled):  # a request verifying d drafts: its last 1 + d rows
            ends = cu_q[1:].tolist()
            sample_rows = torch.tensor([row for r, end in zip(scheduled, ends, strict=True) if r.sample
                                        for row in range(end - 1 - len(r.draft_token_ids), end)], dtype=torch.long)
        else:
            sample_rows = (cu_q[1:] - 1)[torch.tensor([r.sample for r in scheduled])]
        input_ids, positions, slot_mapping, block_tables, sample_rows = tensors_to_device(
            [input_ids, positions, slot_mapping, block_tables, sample_rows], self.device)
        meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, slot_mapping, self.block_size,
                                       self.decode_kernel, self.attention_backend, kernel_rows_max=self.kernel_rows_max)
        return input_ids, positions, meta, sample_rows

    def _fill_decode(self, scheduled: list[ScheduledRequest]) -> tuple[DecodeStep, torch.Tensor]:
        """A decode step's inputs copied into the persistent buffers, and its sampled rows (padded rows never
        reach sampling)."""
        step = self.decode_buffers.fill([r.token_ids[0] for r in scheduled], [r.start_pos for r in scheduled],
                                        [r.block_ids for r in scheduled])
        return step, to_device([i for i, r in enumerate(scheduled) if r.sample], torch.long, self.device)

    def _prepare_decode(self, scheduled: list[ScheduledRequest]):
        """_prepare for a step of decodes only, on the persistent buffers."""
        step, sample_rows = self._fill_decode(scheduled)
        return (step.input_ids, step.positions, self._decode_metadata(step, [r.start_pos + 1 for r in scheduled]),
                sample_rows)

    def _replay_decode(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """A decode step through its captured graph: the inputs copied into the buffers, the graph replayed; the
        logits of the sampled rows."""
        step, sample_rows = self._fill_decode(scheduled)
        return self.graphs.replay(step.size)[sample_rows]

    def _decode_metadata(self, step: DecodeStep, seq_lens: list[int]) -> AttentionMetadata:
        """The attention metadata of a decode step, reading the step's buffers (padding rows: length 1)."""
        if self.decode_tables:  # lengths read on the device: the longest a sequence can be bounds the window rule
            return AttentionMetadata.for_decode_tables(step.block_tables, step.seq_lens, step.slot_mapping,
                                                       self.block_size, self.decode_buffers.max_len)
        lens = seq_lens + [1] * (step.size - step.num_seqs)
        return AttentionMetadata.build([1] * step.size, lens, step.block_tables, step.slot_mapping, self.block_size,
                                       self.decode_kernel, self.attention_backend, seq_lens_tensor=step.seq_lens)

    def capture_decode(self, capture: Callable[[int, Callable[[], torch.Tensor]], None]) -> None:
        """The hook CUDA graphs plug into: for each capture size, largest first, capture(size, run) where run() is
        the decode forward of that many padding rows on the persistent buffers, logits [size, V] (a graph
        recorded around run() replays on whatever a later step copies into the same buffers, where the decode
        attention reads its lengths on the device: `decode_tables`). run() holds tensors made here that such a
        graph reads (row indices, metadata): the capturer keeps run as long as its graph."""
        for size in reversed(self.decode_buffers.sizes):
            step = self.decode_buffers.padding_step(size)
            meta = self._decode_metadata(step, [])
            rows = torch.arange(size, device=self.device)

            def run(step=step, meta=meta, rows=rows) -> torch.Tensor:
                with torch.inference_mode(), set_forward_context(ForwardContext(meta, self.kv.layers)):
                    return self._forward(step.input_ids, step.positions, rows)

            capture(size, run)

    def capture_graphs(self) -> None:
        """CUDA graphs of the decode step at every capture size (where this runner's decodes can be captured)."""
        if self.device.type == "cuda" and self.decode_tables:
            from sluice.service.executor.cuda_graphs import capture_decode_graphs

            self.graphs = capture_decode_graphs(self)

    def _forward_pooling(self, input_ids: torch.Tensor, positions: torch.Tensor, sample_rows: torch.Tensor,
                         scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """_forward for a step with embedding requests: the logits of the sampled rows and the pooled vectors."""
        hidden, norm, head = packed_hidden(self.model, input_ids, positions)
        return head(norm(hidden[sample_rows])), self.pooler.pool(hidden, norm, scheduled, head)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, sample_rows: torch.Tensor) -> torch.Tensor:
        """One forward over the packed batch (as a single sequence of batch 1); logits [len(sample_rows), V]."""
        return packed_logits(self.model, input_ids, positions, sample_rows)


def _rows_without_token(logits: torch.Tensor, to_sample: list[ScheduledRequest]) -> tuple[list[int], torch.Tensor]:
    """The constrained rows, and for each whether no finite logit is left (counting the stop tokens the sampler
    masks for min_tokens); on CUDA the flags reach the host by a copy the sampler's read-back waits for."""
    rows = [i for i, r in enumerate(to_sample) if _may_forbid_all(r.sampling_params)]
    if not rows:
        return rows, torch.zeros(0, dtype=torch.bool)
    forbidden = torch.isneginf(logits[torch.tensor(rows).to(logits.device, non_blocking=True)])
    for j, i in enumerate(rows):
        forbidden[j, pending_stops(to_sample[i], logits.shape[-1])] = True
    dead = forbidden.all(-1)
    if dead.device.type != "cpu":
        dead = torch.empty(dead.shape, dtype=torch.bool, pin_memory=True).copy_(dead, non_blocking=True)
    return rows, dead


def _may_forbid_all(p) -> bool:
    """Only a grammar, allowed_token_ids or bad words can leave a row without any token."""
    return p.structured_output is not None or p.allowed_token_ids is not None or bool(p.bad_words_token_ids)
