"""Tiny GGUF files for the tests, written with the gguf package as llama.cpp's converter writes them: valid random
blocks of every type, a tiny model of each family the owned forward runs (its shape, tiny's tokenizer and its
weights' float values by transformers' names), and the check that two tokenizers are the same."""

from __future__ import annotations

import json

import numpy as np
import torch

from tests.support import tiny

# Types gguf.quants cannot quantize: random codes, and small float16 scales at these bytes of a block.
RANDOM_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "Q3_K": (108,), "Q2_K": (80, 82),
                 "IQ4_XS": (0,), "IQ3_S": (0,)}
SCALE_SIZES = {"Q6_K": 2e-5, "IQ4_NL": 1e-3, "Q3_K": 1e-3, "Q2_K": 2e-3, "IQ4_XS": 3e-5}  # else 1e-4


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row_bytes] of valid blocks: gguf.quants.quantize of random floats where the package quantizes
    the type, else random bytes with small finite float16 scales (RANDOM_SCALES)."""
    import gguf

    rng = np.random.default_rng(seed)
    if qtype not in RANDOM_SCALES:
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType[qtype])
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, (n * k // block_size, block_bytes), dtype=np.uint8)
    for at in RANDOM_SCALES[qtype]:  # d (and dmin): element magnitudes around 0.1
        d = (rng.random(len(blocks)) * SCALE_SIZES.get(qtype, 1e-4)).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def reference_dequantize(blocks: np.ndarray, qtype: str) -> torch.Tensor:
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]).astype(np.float32))


# The tiny Llama's linears, in types that cover every block type and both a fused and a split q/k/v.
LAYER_TYPES = [
    {"q_proj": "Q4_K", "k_proj": "IQ4_NL", "v_proj": "Q5_K", "o_proj": "Q6_K", "gate_proj": "Q5_0", "up_proj": "Q5_0",
     "down_proj": "Q8_0"},
    {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q4_0", "o_proj": "Q5_1", "gate_proj": "Q4_1", "up_proj": "Q4_1",
     "down_proj": "IQ4_XS"},
]
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def tiny_config(arch: str = "llama"):
    import transformers

    tok = tiny.tokenizer()
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
              "qwen3": transformers.Qwen3Config}[arch]
    return config(
        vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=tok.eos_token_id, bos_token_id=None,
        tie_word_embeddings=True, **({"head_dim": 64} if arch == "qwen3" else {}))


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (the inverse of gguf_weights.reverse_permute)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_tiny_gguf(path, arch: str, rope_freqs: np.ndarray | None = None, types: list[dict] | None = None):
    """A tiny `arch` model's GGUF file, its shape and tiny's tokenizer in the metadata (Qwen2: q/k/v biases; Qwen3:
    q/k norms, as llama.cpp's converter names them; only Llama's q/k rows are permuted; `rope_freqs`: Llama 3.1's
    rope factors, as llama.cpp stores them; `types`: each layer's linears' types, LAYER_TYPES' by default): (path,
    config, the float weights under transformers' names)."""
    import gguf

    config = tiny_config(arch)
    writer = gguf.GGUFWriter(str(path), arch)
    add_shape(writer, config)
    add_tiny_tokenizer(writer)
    floats: dict[str, torch.Tensor] = {}
    rng = np.random.default_rng(3)

    def quantized(hf: str, name: str, qtype: str, n: int, k: int, heads: int = 0) -> None:
        blocks = random_blocks(qtype, n, k, seed=len(floats))
        floats[hf] = reference_dequantize(blocks, qtype)
        writer.add_tensor(name, llama_cpp_permute(blocks, heads) if heads else blocks,
                          raw_dtype=gguf.GGMLQuantizationType[qtype])

    def norm(hf: str, name: str, size: int = config.hidden_size, scale: float = 0.1) -> None:
        floats[hf] = torch.from_numpy(1 + scale * rng.standard_normal(size).astype(np.float32))
        writer.add_tensor(name, floats[hf].numpy())

    quantized("model.embed_tokens.weight", "token_embd.weight", "Q6_K", config.vocab_size, config.hidden_size)
    sizes = {"q_proj": (256, 256), "k_proj": (128, 256), "v_proj": (128, 256), "o_proj": (256, 256),
             "gate_proj": (512, 256), "up_proj": (512, 256), "down_proj": (256, 512)}
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads} if arch == "llama" else {}
    for i, layer_types in enumerate(types or LAYER_TYPES):
        for part, qtype in layer_types.items():
            group = "self_attn" if part.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            quantized(f"model.layers.{i}.{group}.{part}.weight", f"blk.{i}.{GGUF_NAMES[part]}.weight", qtype,
                      *sizes[part], heads.get(part, 0))
            if arch == "qwen2" and part in ("q_proj", "k_proj", "v_proj"):
                norm(f"model.layers.{i}.self_attn.{part}.bias", f"blk.{i}.{GGUF_NAMES[part]}.bias", sizes[part][0], 1)
        if arch == "qwen3":
            for part in ("q", "k"):
                norm(f"model.layers.{i}.self_attn.{part}_norm.weight", f"blk.{i}.attn_{part}_norm.weight", 64)
        norm(f"model.layers.{i}.input_layernorm.weight", f"blk.{i}.attn_norm.weight")
        norm(f"model.layers.{i}.post_attention_layernorm.weight", f"blk.{i}.ffn_norm.weight")
    norm("model.norm.weight", "output_norm.weight")
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, config, floats


def add_shape(writer, config) -> None:
    """A transformers config's shape as llama.cpp's converter writes it (key and value widths where the config
    states its head size)."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def add_tiny_tokenizer(writer, pre: str = "smollm", extra: tuple[str, ...] = ()) -> None:
    """tests.support.tiny's tokenizer as llama.cpp's converter writes it (its specials marked control), `extra`
    tokens after it marked user-defined, and its chat template."""
    tok = tiny.tokenizer()
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens + list(extra))
    writer.add_token_types([3 if t in tiny.SPECIALS else 1 for t in tokens] + [4] * len(extra))
    writer.add_token_merges([" ".join(m) for m in json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tiny.CHAT_TEMPLATE)


TEXTS = ["Hello world, how are you? 12345 3.14", "  two spaces\tand a tab\r\n\n", "你好世界 😀 ünïcödé",
         "<|im_start|>user\nhi<|im_end|>\n", "don't I'll WE'RE", "<think>ok</think><|endoftext|>"]


def same_tokenizer(mine, theirs) -> None:
    """The same `tokenizers` object, special tokens and chat template, and the same ids and text for TEXTS."""
    assert json.loads(mine.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "chat_template", "all_special_tokens"):
        assert getattr(mine, name) == getattr(theirs, name), name
    chat = [{"role": "user", "content": TEXTS[2]}]
    assert mine.apply_chat_template(chat, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, add_generation_prompt=True)
    for text in TEXTS:
        assert mine(text).input_ids == theirs(text).input_ids
        assert mine.decode(theirs(text).input_ids, skip_special_tokens=True) == \
            theirs.decode(theirs(text).input_ids, skip_special_tokens=True)


PROMPTS = [[5, 17, 99, 3, 41, 8, 200, 13, 77, 6], list(range(30, 70)), [11, 12]]


def greedy(model, prompts, tokens: int = 12) -> list[list[int]]:
    """Each prompt's greedy continuation by an engine on `model`."""
    from sluice.scheduling.sampling_params import SamplingParams
    from tests.support.parity import make_engine

    engine = make_engine(model, "recompute", num_blocks=64, budget=32)
    return [r.token_ids for r in engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                         ignore_eos=True))]
