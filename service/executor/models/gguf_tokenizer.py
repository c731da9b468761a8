"""A GGUF file's byte-level BPE tokenizer (llama.cpp's "gpt2" model: Llama 3, Qwen, SmolLM), built from its metadata.

transformers builds it through gguf's reader (every metadata array as numpy views) and GPT2Tokenizer: 3.2 s at
135M. The same `tokenizers` objects are built here from the token list and merges that `read_gguf` reads as plain
lists: a byte-level BPE, the pre-tokenizer's split for the file's `tokenizer.ggml.pre`, the tokens the file marks
control as special and those it marks user-defined as added. A tokenizer of another kind (sentencepiece, unigram),
a file without merges, or a pre-tokenizer not listed here gets None, and transformers builds it.
"""

from __future__ import annotations

from functools import lru_cache

VOCABULARY = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
# Each pre-tokenizer's split, as llama.cpp's vocabulary names it; None: GPT-2's own, the byte-level default.
SPLITS = {"gpt-2": None, "default": None, "smollm": None,
          "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3,
          "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable character for each byte, in which byte-level vocabularies spell their tokens."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def gguf_tokenizer(metadata: dict):
    """The file's tokenizer (`read_gguf`'s metadata, `VOCABULARY` read) as a transformers fast tokenizer; None
    where transformers' own GGUF support must build it."""
    if metadata.get("tokenizer.ggml.model") != "gpt2" or "tokenizer.ggml.merges" not in metadata:
        return None
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in SPLITS:
        return None
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens, kinds = metadata["tokenizer.ggml.tokens"], metadata.get("tokenizer.ggml.token_type") or ()
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
             for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))
    split = SPLITS[pre]
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else \
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()

    def named(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    typed = list(zip(tokens, kinds, strict=False))  # a file without types has no control or user tokens
    # A control token spelled outside the byte alphabet is a converter's mislabel: adding it would grow the
    # vocabulary past the model's.
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token, kind in typed
                                if kind == CONTROL and set(token) <= alphabet])
    backend.add_tokens([AddedToken(token, normalized=False, special=False) for token, kind in typed
                        if kind == USER_DEFINED and token in vocab])
    options = {flag: metadata[f"tokenizer.ggml.{flag}"] for flag in ("add_bos_token", "add_eos_token")
               if f"tokenizer.ggml.{flag}" in metadata}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=named("bos_token_id"), eos_token=named("eos_token_id"),
        unk_token=named("unknown_token_id"), pad_token=named("padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"), **options)
