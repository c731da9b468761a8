"""The Llama family's forward, owned: Llama, SmolLM2, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k norms).

One implementation for CPU and CUDA over the layers in `service/executor/layers`: embedding, RMSNorm, rotary, paged
attention, gated MLP, a head tied to the embedding or its own. The runner packs every scheduled token of a step
into one sequence [T] with explicit positions; the final norm and the head run on the sampled rows only
(embedding requests read the normed hidden states of their own rows instead: service/executor/pooling.py). Where
every linear of a layer has a C++ kernel (GGUF blocks, or float weights packed for oneDNN's GEMV; biases and q/k
norms included), its work before and after the attention runs as two C++ calls on CPU (csrc/llama_layer.cpp: the
same ops in the same order as the Python path, bit for bit) instead of a dozen Python calls between the kernels.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from sluice import native
from sluice.service.executor.forward_context import get_forward_context
from sluice.service.executor.layers.attention import PagedAttention
from sluice.service.executor.layers.linear import Linear
from sluice.service.executor.layers.mlp import GatedMLP
from sluice.service.executor.layers.norm import RMSNorm
from sluice.service.executor.layers.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)), on the packed tokens [T, E]."""

    def __init__(self, input_layernorm: RMSNorm, self_attn: PagedAttention, post_attention_layernorm: RMSNorm,
                 mlp: GatedMLP) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = input_layernorm, self_attn
        self.post_attention_layernorm, self.mlp = post_attention_layernorm, mlp
        self._layer_ops, self._layer_ops_rows = _layer_ops(self)

    def __deepcopy__(self, memo: dict) -> DecoderLayer:
        # The C++ layer object holds its linears' weights (pointers into packed layouts): a copy builds its own.
        parts = (self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp)
        return DecoderLayer(*(copy.deepcopy(part, memo) for part in parts))

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden [T, E] → [T, E]; the attention reads its cache from the forward context."""
        ops = self._layer_ops
        if ops is not None and hidden.shape[0] <= self._layer_ops_rows and hidden.device.type == "cpu" \
                and get_forward_context().lora is None:  # adapter rows: Python path
            q, k, v = ops.before_attention(hidden[None], cos[None], sin[None])
            return ops.after_attention(self.self_attn.attend(q, k, v), hidden[None])[0]
        hidden = self.self_attn(self.input_layernorm(hidden), cos, sin).add_(hidden)
        return self.mlp(self.post_attention_layernorm(hidden)).add_(hidden)  # fresh outputs: added in place


def _layer_ops(layer: DecoderLayer) -> tuple[object | None, int]:
    """csrc/llama_layer.cpp's object running this layer's work around its attention, and the most rows it takes;
    (None, 0) unless each of its four linears offers a layer op (`Linear.kernel_facts`: GGUF blocks, or float weights
    packed for oneDNN's GEMV) and its norms (Qwen3's q/k norms too) are on the CPU in the dtype those compute in."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    head_norms = (attn.q_norm, attn.k_norm) if attn.q_norm is not None else ()
    norms = (layer.input_layernorm, layer.post_attention_layernorm, *head_norms)
    if not all(isinstance(linear, Linear) for linear in linears) \
            or head_norms and attn.q_norm.variance_epsilon != attn.k_norm.variance_epsilon:
        return None, 0
    facts = [linear.kernel_facts() for linear in linears]
    if any(f.op is None for f in facts) \
            or any(n.weight.device.type != "cpu" or n.weight.dtype != facts[0].dtype for n in norms):
        return None, 0
    q_norm, k_norm = (attn.q_norm.weight, attn.k_norm.weight) if head_norms else (None, None)
    ops = native.load()  # loaded already: a linear with a layer op was built on it
    layer_ops = ops.LlamaLayerOps(norms[0].weight, norms[0].variance_epsilon, facts[0].op, attn.num_heads,
                                  attn.num_kv_heads, attn.head_dim, facts[1].op, norms[1].weight,
                                  norms[1].variance_epsilon, facts[2].op, facts[3].op, q_norm, k_norm,
                                  attn.q_norm.variance_epsilon if head_norms else 0.0)
    return layer_ops, min(f.max_rows for f in facts)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM on the paged KV cache. `config` is the transformers config it was built from."""

    def __init__(self, config, embed_tokens: nn.Embedding, layers: list[DecoderLayer], norm: RMSNorm,
                 lm_head: nn.Module, rotary_emb: RotaryEmbedding, generation_config=None) -> None:
        super().__init__()
        self.config, self.generation_config = config, generation_config
        self.embed_tokens, self.layers, self.norm = embed_tokens, nn.ModuleList(layers), norm
        self.lm_head, self.rotary_emb = lm_head, rotary_emb

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the final norm's: an embedding may be kept in GGUF blocks)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.norm.weight.device

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids and positions [T] (every scheduled token, packed) → the last layer's output [T, E], before
        the final norm (which, like the head, then runs on the rows wanted only)."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer.forward(hidden, cos, sin)  # not through nn.Module's call wrapper: microseconds a layer
        return hidden

    def compute_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """input_ids and positions [T] (every scheduled token, packed) → the logits of `rows` [n, V]."""
        return self.lm_head(self.norm(self.hidden_states(input_ids, positions)[rows]))
