"""A GGUF file's config and tokenizer read from its metadata: wherever the readers answer, the owned forward reads
the same numbers as from transformers' GGUF support and the tokenizer is the same `tokenizers` object (tiny files
of each family and pre-tokenizer, and the default model's own file); transformers wherever the file leaves
something to it; a GGUF file served as stored or dequantized that never imports the model classes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from transformers import AutoConfig, AutoTokenizer, PreTrainedConfig

from sluice.service.executor.model_loader import default_gguf
from sluice.service.executor.models.gguf_config import gguf_config
from sluice.service.executor.models.gguf_file import read_gguf
from sluice.service.executor.models.gguf_tokenizer import VOCABULARY, gguf_tokenizer
from tests.support import tiny
from tests.support.gguf_files import add_shape, add_tiny_tokenizer, same_tokenizer
from tests.support.parity import config_reading

SHAPE = {"llama": {}, "qwen2": {}, "qwen3": {"key_length": 128}}  # Qwen3's head is not hidden / heads (32)


def write_gguf(path, arch: str = "llama", pre: str = "smollm", tied: bool = True, **extra):
    """A GGUF file holding a tiny `arch` model's metadata, tests.support.tiny's tokenizer as llama.cpp's
    converter writes it (its specials marked control, "<think>" user-defined), and its norms' tensors only."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    add_shape(writer, SimpleNamespace(max_position_embeddings=512, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      rope_parameters={"rope_theta": 500000.0}, rms_norm_eps=1e-6,
                                      head_dim=SHAPE[arch].get("key_length")))
    add_tiny_tokenizer(writer, pre, ("<think>",))
    for key, value in extra.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("output_norm.weight", np.ones(128, np.float32))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((len(tiny.tokenizer()) + 1, 128), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


PIECES = ["▁", "t", "h", "e", "a", "n", "d", "o", "f", "i", "s", "r", "l", "w", "H", "▁t", "he", "▁the", "▁a", "nd",
          "▁and", "▁o", "▁of", "is", "▁is", "▁w", "or", "ld", "▁wor", "▁world", "el", "lo", "▁H", "▁He", "▁Hel",
          "▁Hello", "你", "好"]


def write_spm_gguf(path, arch: str = "llama", **flags: bool):
    """A GGUF file with a sentencepiece vocabulary as llama.cpp's converter writes Llama 2's: <unk>, <s>, </s>,
    the 256 byte tokens, scored pieces (no merges: they are recovered from the scores), "<think>" user-defined;
    `flags`: tokenizer.ggml.<flag> booleans."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *PIECES, "<think>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(PIECES), 4]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(PIECES))] + [0.0])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(tiny.CHAT_TEMPLATE)
    for flag, value in flags.items():
        writer.add_bool(f"tokenizer.ggml.{flag}", value)
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def ours(path):
    metadata, tensors = read_gguf(path, VOCABULARY)
    return gguf_config(metadata, tensors, str(path)), gguf_tokenizer(metadata)


@pytest.mark.parametrize("arch", sorted(SHAPE))
@pytest.mark.parametrize("tied", [True, False])
def test_a_tiny_file_reads_as_transformers_reads_it(tmp_path, arch, tied):
    path = write_gguf(tmp_path / "tiny.gguf", arch, tied=tied)
    config, tokenizer = ours(path)
    assert type(config) is PreTrainedConfig and config.head_dim == SHAPE[arch].get("key_length", 32)
    assert config_reading(config) == config_reading(AutoConfig.from_pretrained(tmp_path, gguf_file=path.name))
    same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name))


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2"])
def test_each_listed_split_builds_transformers_tokenizer(tmp_path, pre):
    path = write_gguf(tmp_path / "tiny.gguf", pre=pre)
    same_tokenizer(ours(path)[1], AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name))


@pytest.mark.parametrize("flags", [{}, {"add_bos_token": False}, {"add_space_prefix": True}])
def test_a_sentencepiece_vocabulary_builds_transformers_tokenizer(tmp_path, flags):
    path = write_spm_gguf(tmp_path / "spm.gguf", **flags)
    mine, theirs = ours(path)[1], AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    same_tokenizer(mine, theirs)
    hello = 259 + PIECES.index("▁Hello")  # merged from its pieces' scores, the first word given its "▁"
    assert mine("Hello world").input_ids[:2] == ([hello, 259 + PIECES.index("▁world")] if flags.get("add_bos_token")
                                                 is False else [1, hello])


def test_the_default_models_file_reads_as_transformers_reads_it(tmp_path, smollm2_dir):
    path = tmp_path / default_gguf().name  # by itself: beside its converted tokenizer.json, transformers reads that
    path.symlink_to(default_gguf())
    config, tokenizer = ours(path)
    assert config_reading(config) == config_reading(AutoConfig.from_pretrained(tmp_path, gguf_file=path.name))
    same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name))


@pytest.mark.parametrize("change", [
    {"general.architecture": "gemma2"},
    {"llama.rope.scaling.type": "linear"},
    {"llama.attention.sliding_window": 4096},
    {"llama.expert_count": 8},
    {"llama.rope.dimension_count": 16},  # a partial rope (heads are 32 wide)
    {"llama.attention.value_length": 16},
    {"llama.attention.head_count_kv": None},  # per-layer counts are an array, which the reader steps over
    {"llama.rope.freq_base": None},  # each family's class has its own default base
    {"llama.vocab_size": None, "tokenizer.ggml.tokens": None},
])
def test_what_the_file_leaves_to_transformers_goes_there(tmp_path, change):
    metadata, tensors = read_gguf(write_gguf(tmp_path / "tiny.gguf"), VOCABULARY)
    assert gguf_config(metadata, tensors, "tiny") is not None
    metadata = {k: v for k, v in {**metadata, **change}.items() if v is not None}
    assert gguf_config(metadata, tensors, "tiny") is None


@pytest.mark.parametrize("change", [{"tokenizer.ggml.model": "t5"}, {"tokenizer.ggml.pre": "deepseek-llm"},
                                    {"tokenizer.ggml.merges": None}])
def test_other_tokenizers_go_to_transformers(tmp_path, change):
    metadata, _ = read_gguf(write_gguf(tmp_path / "tiny.gguf"), VOCABULARY)
    assert gguf_tokenizer({k: v for k, v in {**metadata, **change}.items() if v is not None}) is None


@pytest.mark.parametrize("change", [{"general.architecture": "gemma2"}, {"general.architecture": "phi3"},
                                    {"tokenizer.ggml.add_space_prefix": False}, {"tokenizer.ggml.scores": None}])
def test_other_sentencepiece_vocabularies_go_to_transformers(tmp_path, change):
    metadata, _ = read_gguf(write_spm_gguf(tmp_path / "spm.gguf"), VOCABULARY)
    assert gguf_tokenizer(metadata) is not None
    assert gguf_tokenizer({k: v for k, v in {**metadata, **change}.items() if v is not None}) is None


@pytest.mark.parametrize("quantization", ["gguf", "none"])  # the file's blocks as stored, or dequantized
def test_serving_a_gguf_file_imports_no_model_class(tmp_path, smollm2_dir, quantization):
    path = tmp_path / default_gguf().name
    shutil.copyfile(default_gguf(), path)
    classes = [f"transformers.models.{t}" for t in ("llama", "gpt2", "qwen2")]
    code = ("import sys; from sluice.service.config import ModelConfig; from sluice.service.executor.model_loader "
            "import load_model; m, t = load_model(sys.argv[1], 'cpu', 'float32', settings=ModelConfig("
            f"quantization={quantization!r})); print([m for m in {classes} if m in sys.modules], type(m).__name__, "
            "t.eos_token)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[] LlamaForCausalLM <|im_end|>"


@pytest.mark.parametrize("keep", [0.5, 0.999])  # cut inside the vocabulary, or inside the last tensor's bytes
def test_a_cut_off_file_is_refused_with_its_name(tmp_path, keep):
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:int(len(whole) * keep)])
    with pytest.raises(ValueError, match="cut.gguf: (a truncated or malformed GGUF header|tensor .* runs past)"):
        read_gguf(cut, VOCABULARY)


@pytest.mark.parametrize("content", [b"", b"GG", b"not a gguf file at all"])
def test_an_empty_or_foreign_file_is_refused_with_its_name(tmp_path, content):
    path = tmp_path / "other.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="other.gguf is not a GGUF file"):
        read_gguf(path)


def test_config_and_tokenizer_are_the_files_but_under_overrides(tmp_path):
    """Both come from the file whatever the weight format (its weights are dequantized by Sluice, not by
    transformers' model); --hf-overrides leaves both to transformers, and so does --no-owned-model the config."""
    from sluice.service.config import ModelConfig
    from sluice.service.executor import model_loader

    path = write_gguf(tmp_path / "tiny.gguf")

    def read(settings: ModelConfig, overrides: dict | None = None):
        return model_loader._read_owned(str(tmp_path), {"gguf_file": path.name}, overrides or {}, settings)

    for settings in (ModelConfig(), ModelConfig(quantization="int4"), ModelConfig(quantization="gguf")):
        config, tokenizer = read(settings)
        assert type(config) is PreTrainedConfig and tokenizer.chat_template == tiny.CHAT_TEMPLATE
    config, tokenizer = read(ModelConfig(owned_model=False))
    assert config is None and tokenizer is not None
    assert read(ModelConfig(quantization="gguf"), {"rms_norm_eps": 1e-5}) == (None, None)


def mapped_kib(path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if line[:1] in "0123456789abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_a_tensors_pages_leave_the_resident_set_once_released(tmp_path):
    """A load copies each tensor out of the mapped file and releases its pages: the file's size does not sit on
    top of the load's peak."""
    import gguf

    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    values = np.arange(4 << 20, dtype=np.float32)  # 16 MiB
    writer.add_tensor("output_norm.weight", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _, tensors = read_gguf(path)
    t = tensors["output_norm.weight"]
    assert np.array_equal(np.array(t.rows(np.float32)), values)  # read: every page of it resident
    assert mapped_kib(path) >= 16 << 10
    t.release()
    assert mapped_kib(path) < 64
    assert np.array_equal(t.rows(np.float32), values)  # still readable: the pages come back from the page cache
