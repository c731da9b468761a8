"""Llama layers with lean forwards: attention on the paged cache with rotary in one C++ op, and an MLP and a
decoder layer without transformers' per-call wrappers.

At batch 1 on CPU each small op and wrapper costs microseconds, and a layer has dozens of them. transformers'
attention projects q, k and v, transposes each to [1, H, T, D], applies rotary as sixteen small ops and looks
the attention function up by name; the paged hook then transposes back. That glue cost more than the attention
itself. Here the attention keeps the projections' [T, H, D] views, rotates q and k in place with
`cpu_ops.rotary_embedding_` and calls `paged_attention` directly; the MLP applies SiLU and the product in place
on the gate's fresh output; the decoder layer calls its four parts with nothing but what they use. Quantized
projections that read one input run as one fused call (q/k/v, gate/up). Where every linear of a layer is
quantized, its work before and after the attention runs as two C++ calls (csrc/llama_layer.cpp: the same ops in
the same order), so at batch 1 the Python between the kernels no longer costs as much as the kernels. Every
result is the eager one bit for bit (for quantized linears: the Python path's).

A copy of the model put back on transformers' own attention (`set_attn_implementation("sdpa")`, as the bench's
raw-forward ceiling does) runs transformers' forwards again. Like `fused_norm`, a module is swapped only if its
class's forward (and, for attention, its module's `apply_rotary_pos_emb`; for the MLP, its activation) is,
source for source, transformers' Llama one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.llama import modeling_llama

from sluice.kvcache.paged_attention import paged_attention
from sluice.service.engine import cpu_ops
from sluice.service.engine.attention_backend import ATTN_IMPLEMENTATION, get_forward_context
from sluice.service.engine.fused_norm import FusedRMSNorm
from sluice.service.engine.module_swap import same_source, swap_modules
from sluice.service.engine.quantized_linear import QuantizedLinear, fuse_linears

ROTARY_DTYPES = (torch.float32, torch.bfloat16)


def _computes_llama_attention(module: nn.Module) -> bool:
    rotary = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
    # Llama's forward passes no window to the attention: a config that sets one must keep its own forward.
    return (same_source(type(module).forward, modeling_llama.LlamaAttention.forward)
            and rotary is not None and same_source(rotary, modeling_llama.apply_rotary_pos_emb)
            and getattr(module.config, "sliding_window", None) is None)


def _computes_llama_mlp(module: nn.Module) -> bool:
    return (same_source(type(module).forward, modeling_llama.LlamaMLP.forward)
            and type(getattr(module, "act_fn", None)) in (SiLUActivation, nn.SiLU))


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place by cos, sin [T, D], as transformers' Llama does."""
    ops = cpu_ops.load()
    if ops is not None and q.device.type == "cpu" and q.dtype in ROTARY_DTYPES \
            and q.dtype == k.dtype == cos.dtype == sin.dtype:
        ops.rotary_embedding_(q, k, cos, sin)
        return
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = q.shape[-1] // 2
    for x in (q, k):
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * cos + rotated * sin)


def _copy_attributes(source: nn.Module, target: nn.Module) -> None:
    """The plain attributes transformers' forward reads (config, layer_idx, scaling, gradient_checkpointing ...)."""
    for name, value in vars(source).items():
        if not name.startswith("_") and name != "training":
            setattr(target, name, value)


def _forwards(*modules: nn.Module) -> tuple:
    """The modules' bound forwards. The lean layers call their parts through these, not through nn.Module's call
    wrapper, which costs microseconds a call at batch 1 (so no hooks run on those inner modules)."""
    return tuple(module.forward for module in modules)


class PagedLlamaAttention(nn.Module):
    """A Llama attention layer reading and writing the paged KV cache of the forward context."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        _copy_attributes(attn, self)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.transformers_forward = type(attn).forward
        # q, k and v in one kernel call where their linears allow it (quantized ones): one pass over the input.
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        self.qkv_heads = [proj.out_features // self.head_dim for proj in (self.q_proj, self.k_proj, self.v_proj)]
        self._projections = _forwards(self.qkv_proj) if self.qkv_proj is not None else \
            _forwards(self.q_proj, self.k_proj, self.v_proj)
        self._o_proj = self.o_proj.forward

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """hidden_states [1, T, E] (the runner packs every sequence into one row) → ([1, T, E], None)."""
        if self.config._attn_implementation != ATTN_IMPLEMENTATION:  # a copy put back on sdpa (the bench's)
            return self.transformers_forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)
        return self.paged_forward(hidden_states, position_embeddings), None

    def paged_forward(self, hidden_states: torch.Tensor,
                      position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The attention on the paged cache: hidden_states [1, T, E] → [1, T, E]."""
        batch, tokens = hidden_states.shape[:2]
        assert batch == 1, "the paged cache packs a step's sequences into one row"
        # Each projection is a fresh tensor (or a slice of one): its [T, H, D] view can be rotated in place.
        if len(self._projections) == 1:
            q, k, v = self._projections[0](hidden_states).view(tokens, -1, self.head_dim).split(self.qkv_heads, dim=1)
        else:
            q, k, v = (project(hidden_states).view(tokens, -1, self.head_dim) for project in self._projections)
        cos, sin = position_embeddings
        apply_rotary(q, k, cos[0], sin[0])
        return self._o_proj(self.attend(q, k, v).reshape(1, tokens, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D] (rotated) on this layer's paged cache → [T, H, D]."""
        context = get_forward_context()
        key_cache, value_cache = context.kv_caches[self.layer_idx]
        return paged_attention(q, k, v, key_cache, value_cache, context.attn_metadata, scale=self.scaling)


class LeanLlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), the activation and product in place on the gate's output."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])  # as qkv_proj in PagedLlamaAttention
        self._projections = _forwards(self.gate_up_proj) if self.gate_up_proj is not None else \
            _forwards(self.gate_proj, self.up_proj)
        self._down_proj = self.down_proj.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The Llama MLP on x [..., E]."""
        if len(self._projections) == 1:
            gate, up = self._projections[0](x).split(self.gate_proj.out_features, dim=-1)
        else:
            gate, up = (project(x) for project in self._projections)
        F.silu(gate, inplace=True)  # gate is a fresh tensor (or a slice of one): free to overwrite
        return self._down_proj(gate.mul_(up))


class LeanLlamaDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)): the Llama decoder layer, its parts called without extra kwargs."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = layer.input_layernorm, layer.self_attn
        self.post_attention_layernorm, self.mlp = layer.post_attention_layernorm, layer.mlp
        _copy_attributes(layer, self)
        self.gradient_checkpointing = False  # a class attribute of transformers' layers: read by their forward
        self.transformers_forward = type(layer).forward
        self._input_norm, self._post_norm, self._mlp = _forwards(self.input_layernorm,
                                                                 self.post_attention_layernorm, self.mlp)
        self._attention = self.self_attn.paged_forward  # projections, attention, o projection
        self._layer_ops, self._layer_ops_rows = _layer_ops(self)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                **kwargs) -> torch.Tensor:
        """hidden_states [1, T, E] → [1, T, E]; the attention reads its cache from the forward context."""
        if self.self_attn.config._attn_implementation != ATTN_IMPLEMENTATION:  # cache and mask are in kwargs
            return self.transformers_forward(self, hidden_states, position_embeddings=position_embeddings, **kwargs)
        ops = self._layer_ops
        if ops is not None and hidden_states.shape[1] <= self._layer_ops_rows \
                and hidden_states.dtype == torch.float32 and hidden_states.device.type == "cpu":
            q, k, v = ops.before_attention(hidden_states, *position_embeddings)
            return ops.after_attention(self.self_attn.attend(q, k, v), hidden_states)
        hidden_states = self._attention(self._input_norm(hidden_states), position_embeddings).add_(hidden_states)
        return self._mlp(self._post_norm(hidden_states)).add_(hidden_states)  # fresh outputs: added in place


def _layer_ops(layer: LeanLlamaDecoderLayer) -> tuple[object | None, int]:
    """csrc/llama_layer.cpp's object running this layer's work around its attention, and the most rows it takes
    (its linears' kernel limit); (None, 0) unless every linear is quantized (q/k/v and gate/up fused) and both
    norms are the fused C++ one."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    ops = cpu_ops.load()
    if ops is None or not isinstance(mlp, LeanLlamaMLP) or not all(isinstance(n, FusedRMSNorm) for n in norms) \
            or not all(isinstance(linear, QuantizedLinear) for linear in linears):
        return None, 0
    kernels = [linear.kernel_op() for linear in linears]
    if None in kernels or any(n.weight.dtype != torch.float32 for n in norms):
        return None, 0
    heads, kv_heads, _ = attn.qkv_heads
    layer_ops = ops.LlamaLayerOps(norms[0].weight, norms[0].variance_epsilon, kernels[0], heads, kv_heads,
                                  attn.head_dim, kernels[1], norms[1].weight, norms[1].variance_epsilon, *kernels[2:])
    return layer_ops, min(linear.kernel_max_rows for linear in linears)


def _computes_llama_decoder_layer(module: nn.Module) -> bool:
    # The lean layer calls its attention with positions only: that takes the paged forward, swapped first.
    return (same_source(type(module).forward, modeling_llama.LlamaDecoderLayer.forward)
            and isinstance(getattr(module, "self_attn", None), PagedLlamaAttention))


def lean_causal_lm_forward(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """For a Llama causal LM whose decoder layers are all lean: forward(input_ids [T], positions [T], rows) → the
    logits of those rows [n, V], on the paged cache of the forward context. The same ops in the same order as the
    model's own forward, without transformers' wrappers around it (kwargs merging, output recording, a new
    ModuleList per call): a few hundred microseconds a step. The final norm runs on the kept rows only (it is per
    row). None for any other model."""
    inner = getattr(model, "model", None)
    if inner is None or not same_source(type(model).forward, modeling_llama.LlamaForCausalLM.forward) \
            or not same_source(type(inner).forward, modeling_llama.LlamaModel.forward):
        return None
    layers = [layer.forward for layer in inner.layers[: inner.config.num_hidden_layers]]
    if not all(isinstance(layer.__self__, LeanLlamaDecoderLayer) for layer in layers):
        return None
    embed, rotary, norm, head = inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        hidden = embed(input_ids[None])
        position_embeddings = rotary(hidden, positions[None])
        for layer in layers:
            hidden = layer(hidden, position_embeddings)
        return head(norm(hidden[:, rows]))[0]

    return forward


# In this order: a decoder layer qualifies only once its attention was swapped.
SWAPS = (("attention", _computes_llama_attention, PagedLlamaAttention), ("mlp", _computes_llama_mlp, LeanLlamaMLP),
         ("decoder layer", _computes_llama_decoder_layer, LeanLlamaDecoderLayer))


def lean_llama_layers(model: nn.Module) -> dict[str, int]:
    """Swap Llama-formula attention, MLP and (where its attention was swapped) decoder-layer modules of `model` for
    their lean forwards, in place; returns how many of each."""
    return {kind: swap_modules(model, computes_llama, lean) for kind, computes_llama, lean in SWAPS}
