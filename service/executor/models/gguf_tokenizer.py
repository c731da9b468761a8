"""A GGUF file's tokenizer, built from its metadata: byte-level BPE (llama.cpp's "gpt2" model: Llama 3, Qwen,
SmolLM) and sentencepiece BPE (its "llama" model: Llama 2, Mistral, TinyLlama).

transformers builds them through gguf's reader (every metadata array as numpy views) and its GPT2Tokenizer or
LlamaTokenizer: 3.2 s at 135M. The same `tokenizers` objects are built here from the arrays `read_gguf` reads as
plain lists: the BPE (a sentencepiece file's merges recovered from its scores, as transformers recovers them), the
pre-tokenizer (the split for the file's `tokenizer.ggml.pre`, or sentencepiece's metaspace) and decoder, the tokens
the file marks control as special and those it marks user-defined as added. Anything else (unigram, Gemma's and
Phi-3's vocabularies, a split not listed here, a sentencepiece file without the leading space) gets None, and
transformers builds it.
"""

from __future__ import annotations

from functools import lru_cache

VOCABULARY = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
# Each pre-tokenizer's split, as llama.cpp's vocabulary names it; None: GPT-2's own, the byte-level default.
SPLITS = {"gpt-2": None, "default": None, "smollm": None,
          "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3,
          "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}
# Architectures whose sentencepiece vocabularies transformers spells or splits its own way.
OWN_SENTENCEPIECE = ("gemma", "gemma2", "gemma3", "phi3")


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable character for each byte, in which byte-level vocabularies spell their tokens."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def gguf_tokenizer(metadata: dict):
    """The file's tokenizer (`read_gguf`'s metadata, `VOCABULARY` read) as a transformers fast tokenizer; None
    where transformers' own GGUF support must build it."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    kind, tokens = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.tokens")
    built = _byte_level(metadata) if kind == "gpt2" else _sentencepiece(metadata) if kind == "llama" else None
    if built is None:
        return None
    backend, spelled = built
    typed = list(zip(tokens, metadata.get("tokenizer.ggml.token_type") or (), strict=False))
    # A control token spelled outside a byte-level alphabet is a converter's mislabel: adding it would grow the
    # vocabulary past the model's.
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token, kind in typed
                                if kind == CONTROL and spelled(token)])
    vocab = backend.get_vocab(with_added_tokens=False)
    backend.add_tokens([AddedToken(token, normalized=False, special=False) for token, kind in typed
                        if kind == USER_DEFINED and token in vocab])

    def named(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    options = {flag: metadata[f"tokenizer.ggml.{flag}"] for flag in ("add_bos_token", "add_eos_token")
               if f"tokenizer.ggml.{flag}" in metadata}
    if kind == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
        options.setdefault("add_bos_token", True)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=named("bos_token_id"), eos_token=named("eos_token_id"),
        unk_token=named("unknown_token_id"), pad_token=named("padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"), **options)


def _byte_level(metadata: dict):
    """(backend, which tokens are spelled in the byte alphabet) of a byte-level BPE file; None where its split is
    not listed or it has no merges."""
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in SPLITS or "tokenizer.ggml.merges" not in metadata:
        return None
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
             for index, token in enumerate(metadata["tokenizer.ggml.tokens"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=_file_merges(metadata), dropout=None,
                                   continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = SPLITS[pre]
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else \
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, lambda token: set(token) <= alphabet


def _sentencepiece(metadata: dict):
    """(backend, every token) of a sentencepiece BPE file: byte fallback, a leading "▁" on the first word, merges
    from the file or, where it has none, recovered from the scores; None for a vocabulary transformers builds its
    own way, or one that asks for no leading space (which transformers' LlamaTokenizer would add anyway)."""
    if metadata.get("general.architecture") in OWN_SENTENCEPIECE or \
            metadata.get("tokenizer.ggml.add_space_prefix", True) is not True:
        return None
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.tokenization_utils_base import generate_merges

    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = _file_merges(metadata)
    elif "tokenizer.ggml.scores" in metadata:
        merges = generate_merges(vocab, dict(zip(tokens, metadata["tokenizer.ggml.scores"], strict=False)))
    else:
        return None
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    return backend, lambda token: True


def _file_merges(metadata: dict) -> list[tuple[str, ...]]:
    """The merges the file lists ("a b" each), as the pairs the BPE model takes."""
    return [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
