"""A GGUF file's model config, read from its metadata for the families the owned forward runs.

llama.cpp's converter writes a model's shape as `<architecture>.<key>` scalars. transformers reads them through
gguf's reader, which materializes every metadata array, and builds the family's config class, which imports its
modeling stack: 3.5 s and about 60 MB at 135M. Here the scalars are renamed to config.json's keys and go through
the same check as a checkpoint directory's (`config_json.owned_config`). A file whose numbers mean something else
(a scaled or partial rope, a sliding window, experts, per-layer head counts) gets None, and transformers reads it.
"""

from __future__ import annotations

from sluice.service.executor.models.config_json import owned_config

# The GGUF architectures read here, and the transformers class each one's checkpoint directory names.
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SHAPE_KEYS = {"context_length": "max_position_embeddings", "embedding_length": "hidden_size",
              "feed_forward_length": "intermediate_size", "block_count": "num_hidden_layers",
              "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
              "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta"}
TOKEN_IDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "padding_token_id": "pad_token_id",
             "unknown_token_id": "unk_token_id"}
# Keys whose presence changes what the shape means to the forward; the owned one reads none of them.
MEANING_KEYS = ("attention.sliding_window", "expert_count", "rope.scaling.factor", "attention.layer_norm_epsilon")


def reads_shape(metadata: dict) -> bool:
    """Whether the metadata states a shape the owned forward runs as these readers read it (a family of FAMILIES,
    all of SHAPE_KEYS, none of MEANING_KEYS, a full rope over keys and values of one width)."""
    if metadata.get("general.architecture") not in FAMILIES:
        return False
    stated = _stated(metadata)
    if any(key in stated for key in MEANING_KEYS) or stated.get("rope.scaling.type", "none") != "none":
        return False
    if any(key not in stated for key in SHAPE_KEYS):  # an array (per-layer heads) is stepped over: absent here
        return False
    head_dim = _head_dim(stated)
    # not a partial rope, nor values of another width than keys
    return {stated.get("attention.value_length", head_dim), stated.get("rope.dimension_count", head_dim)} == {head_dim}


def _stated(metadata: dict) -> dict:
    arch = metadata["general.architecture"]
    return {key[len(arch) + 1:]: value for key, value in metadata.items() if key.startswith(arch + ".")}


def _head_dim(stated: dict) -> int:
    return stated.get("attention.key_length", stated["embedding_length"] // stated["attention.head_count"])


def gguf_config(metadata: dict, tensor_names, name_or_path: str):
    """The model config the metadata states (`read_gguf`'s, the token list included), as a `PreTrainedConfig`;
    None where transformers' own GGUF support must read it."""
    if not reads_shape(metadata):
        return None
    arch = metadata["general.architecture"]
    stated = _stated(metadata)
    values = {name: stated[key] for key, name in SHAPE_KEYS.items()}
    head_dim = _head_dim(stated)
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = stated.get("vocab_size", len(tokens) if tokens is not None else None)
    if vocab_size is None:
        return None
    values.update(model_type=arch, head_dim=head_dim, vocab_size=vocab_size, hidden_act="silu",
                  tie_word_embeddings="output.weight" not in tensor_names)
    values.update({name: metadata[f"tokenizer.ggml.{key}"] for key, name in TOKEN_IDS.items()
                   if f"tokenizer.ggml.{key}" in metadata})
    return owned_config(values, name_or_path)
