"""A tiny random Qwen3-Reranker and the model card's formula computed by transformers: the oracle of the rerank and
score tests (tests/engine/test_rerank.py, tests/api/test_rerank_api.py).

The model is a random 2-layer Qwen3ForCausalLM with SmolLM2's tokenizer, which has `<|im_start|>` / `<|im_end|>` as
special tokens and "yes" / "no" as single tokens, as Qwen3's does. Its weights are drawn wider than transformers'
default (initializer_range 0.2) so the yes/no logits differ enough for the documents to get distinct scores.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

# vLLM's launch line for Qwen3-Reranker, as its docs give it
HF_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                "is_original_qwen3_reranker": True}
LAUNCH = ("--runner", "pooling", "--hf-overrides", json.dumps(HF_OVERRIDES))

# The model card's prompt, written out here independently of service/api/rerank.py
PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct '
          'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of France is Paris.", "Streaming tokens over server-sent events, one chunk at a time.",
             "你好世界 中文 文本", "Paris is the capital and largest city of France, on the Seine. café résumé 😀"]


def save_tiny_reranker(path: Path, tokenizer_dir: str) -> str:
    """A random tiny Qwen3 causal LM (tied head) with the tokenizer of `tokenizer_dir` (SmolLM2's), saved at `path`."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.2,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(3)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@functools.cache
def tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def model_card_ids(model_dir: str, query: str, document: str, instruction: str | None = None) -> list[int]:
    """The model card's process_inputs for one pair: prefix tokens, the formatted pair tokenized, suffix tokens."""
    tok = tokenizer(model_dir)
    pair = f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    return (tok.encode(PREFIX, add_special_tokens=False) + tok(pair)["input_ids"]
            + tok.encode(SUFFIX, add_special_tokens=False))


@functools.cache
def _reference_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_score(model_dir: str, ids: list[int]) -> float:
    """The model card's compute_logits on transformers' model: log_softmax of the last position's [no, yes]
    logits, exp of yes."""
    tok = tokenizer(model_dir)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    with torch.no_grad():
        logits = _reference_model(model_dir)(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(torch.stack([logits[no], logits[yes]]), dim=0)[1].exp().item()
