"""Offline test assets: a byte-level BPE tokenizer trained in-process and a tiny random-weight Llama."""

from __future__ import annotations

import functools

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Mostly ASCII with some multi-byte text: frequent CJK characters get merged into one token, the rare
# emoji and accents stay split across byte tokens, which is what the UTF-8 tests need.
CORPUS = [
    "The capital of France is Paris. Hello world, how are you today? I am fine, thank you.",
    "Streaming tokens over server-sent events, one chunk at a time, until the stop string.",
    "你好世界 你好 世界 中文 文本",
] * 40 + ["café naïve résumé 😀 🎉 日本語 ünïcödé ✓"]


@functools.lru_cache(maxsize=1)
def tokenizer():
    """A ~400-token byte-level BPE tokenizer with specials and a ChatML-style template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(path: str) -> str:
    """Write a random-weight 2-layer Llama and the tokenizer to `path` (HF layout); returns `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def tiny_engine(model_dir: str, num_kv_blocks: int, **scheduler):
    """An LLMEngine on the tiny model saved at `model_dir`: fp32 on CPU, `num_kv_blocks` device blocks, a small
    host swap pool, and the given SchedulerConfig fields."""
    from sluice.service.config import SluiceConfig
    from sluice.service.engine.engine import LLMEngine

    config = SluiceConfig()
    config.model.model, config.model.device, config.model.dtype = model_dir, "cpu", "float32"
    config.cache.num_kv_blocks, config.cache.swap_space = num_kv_blocks, 0.01
    for name, value in scheduler.items():
        setattr(config.scheduler, name, value)
    return LLMEngine(config)
