"""`bench quant`: what int8 and int4 weights cost in accuracy: perplexity on a fixed text, greedy agreement with fp32.

All use transformers' own forward on the same loaded model, with its linears in the engine's quantized formats
or not (`quantized_copy`), so only the weights differ, and every quantized linear runs its few-row kernel whatever
the row count: the arithmetic decoding runs (int4's kernel rounds activations to int8; the dequantize path for long
prefills would not). The text is public domain (the opening of the US Declaration of Independence), fixed so runs
compare across commits.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from sluice import native
from sluice.service.executor.layers.gguf_linear import GgufMethod, QuantizeFormat
from sluice.service.executor.layers.linear import Linear

TEXT = (
    "When in the Course of human events, it becomes necessary for one people to dissolve the political bands which "
    "have connected them with another, and to assume among the powers of the earth, the separate and equal station "
    "to which the Laws of Nature and of Nature's God entitle them, a decent respect to the opinions of mankind "
    "requires that they should declare the causes which impel them to the separation. We hold these truths to be "
    "self-evident, that all men are created equal, that they are endowed by their Creator with certain unalienable "
    "Rights, that among these are Life, Liberty and the pursuit of Happiness. That to secure these rights, "
    "Governments are instituted among Men, deriving their just powers from the consent of the governed, That "
    "whenever any Form of Government becomes destructive of these ends, it is the Right of the People to alter or "
    "to abolish it, and to institute new Government, laying its foundation on such principles and organizing its "
    "powers in such form, as to them shall seem most likely to effect their Safety and Happiness."
)
PROMPTS = (
    "The capital of France is", "Write a haiku about the sea.", "Explain what a hash table is.",
    "List three prime numbers and say why they are prime.", "What is the boiling point of water?",
    "Translate 'good morning' into Spanish.", "Give me a tip for learning to code.", "Who wrote Hamlet?",
)


@torch.inference_mode()
def perplexity(model, tokenizer) -> float:
    """exp(mean next-token cross-entropy) of TEXT."""
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    logits = model(input_ids=ids).logits[0, :-1].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item())


@torch.inference_mode()
def greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    """Greedy continuation of a chat prompt, EOS ignored so every prompt yields max_new_tokens."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def quantized_copy(model: nn.Module, method: str) -> nn.Module:
    """A copy of a transformers model whose linears are the engine's `method` ones (int8, int4), each running its
    few-row kernel whatever the row count."""
    twin, make = copy.deepcopy(model), QuantizeFormat(method, native.load()).make
    for name, linear in [(n, m) for n, m in twin.named_modules() if type(m) is nn.Linear]:
        parent, _, attr = name.rpartition(".")
        bias = None if linear.bias is None else linear.bias.detach()
        setattr(twin.get_submodule(parent) if parent else twin, attr,
                make(linear.weight.detach(), bias, [name], [linear.out_features]))
    for module in twin.modules():
        if isinstance(module, Linear) and isinstance(module.method, GgufMethod):
            module.method.max_rows = 1 << 30
    return twin


def quant_quality(model, tokenizer, methods: tuple[str, ...] = ("int8", "int4"), max_new_tokens: int = 64) -> dict:
    """fp32 vs each method: perplexity, and how far greedy outputs agree with fp32's (prefix before the first
    change)."""
    result = {"perplexity": {"fp32": perplexity(model, tokenizer)}, "greedy_prompts": len(PROMPTS),
              "greedy_tokens": max_new_tokens, "greedy": {}}
    reference = [greedy(model, tokenizer, prompt, max_new_tokens) for prompt in PROMPTS]
    for method in methods:
        quantized = quantized_copy(model, method)
        result["perplexity"][method] = perplexity(quantized, tokenizer)
        prefixes, identical = [], 0
        for prompt, a in zip(PROMPTS, reference, strict=True):
            b = greedy(quantized, tokenizer, prompt, max_new_tokens)
            same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            prefixes.append(same / len(a))
            identical += same == len(a)
        result["greedy"][method] = {"identical": identical, "mean_agreeing_prefix": sum(prefixes) / len(prefixes)}
        del quantized
    return result
