"""Attention compute on the paged KV cache: `paged_attention.py` (the step's metadata and the dispatch among the
backends: the C++ decode kernel on CPU via `decode_kernel.py`, SDPA, FlexAttention `flex_attention.py`, the Triton
kernels of the CUDA path `triton_decode.py` and `triton_varlen.py`, flash-attn) and `attention_backend.py` (the same
attention as a transformers AttentionInterface hook, for models on transformers' forward).

Uses `sluice.kvcache` (the cache's tensors and host-to-device transfer); the KV cache never imports it."""
