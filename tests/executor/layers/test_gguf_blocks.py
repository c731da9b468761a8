"""GGUF blocks served as stored: dequantization against the gguf package, the integer GEMV and the tiled prefill
against float matmul, and a tiny Llama written to a .gguf file loaded with every linear a GgufLinear."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.executor.layers.gguf_blocks import GgufBlocks
from sluice.service.executor.layers.gguf_linear import GgufEmbedding, GgufFormat, GgufLinear, MergedLinear
from sluice.service.executor.layers.gguf_packs import pack_q4_k, unpack_q4_k
from sluice.service.executor.layers.linear import PlainFormat
from sluice.service.executor.layers.quant_types import BY_NAME, PACKED_MAX_ROWS, STORED_MAX_ROWS, dequantize
from sluice.service.executor.models import gguf_weights, weights
from tests.support import tiny
from tests.support.gguf_files import PROMPTS, greedy, random_blocks, reference_dequantize, write_tiny_gguf
from tests.support.int8_rounding import RoundedActivations, int8_rounded, k_quant_reference
from tests.support.kernels import integer_kernels, variant_isas
from tests.support.parity import make_engine

TYPES = list(BY_NAME)


def stored(linear, *bounds) -> torch.Tensor:
    """A GGUF linear's rows (bounds: start, stop) as the file stores them."""
    return linear.method.stored_rows(linear, *bounds)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_matches_the_gguf_package(qtype, kernel):
    blocks = random_blocks(qtype, 24, 512)
    want = reference_dequantize(blocks, qtype)
    data = torch.from_numpy(blocks)
    torch.testing.assert_close(dequantize(data, qtype, 512), want, rtol=0, atol=0)  # the same ops: bit for bit
    # the C++ unpacking may fuse a multiply-add: one rounding fewer, within an ulp of the element
    torch.testing.assert_close(dequantize(data, qtype, 512, kernel), want, rtol=2e-7, atol=1e-9)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 3, STORED_MAX_ROWS])
def test_integer_gemv_matches_float_matmul(qtype, rows, kernel):
    n, k = 40, 768
    blocks = torch.from_numpy(random_blocks(qtype, n, k, seed=rows))
    weight = reference_dequantize(blocks.numpy(), qtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))  # a fixed draw: ties are rare, not absent
    got = kernel.gguf_linear(x, blocks, BY_NAME[qtype].type_id)
    # Against the same int8-rounded activations the products are exact integers: only float summation order differs
    # (and, rarely, an activation within an ulp of a rounding tie landing on the other integer: one output in 40).
    exact = int8_rounded(x) @ weight.T
    scale = (x.abs() @ weight.abs().T).amax()
    assert ((got - exact).abs() > 1e-5 * scale).sum() <= max(1, got.numel() // 40)
    # Against float activations: the int8 rounding (at most half a step of max|x| / 127 per element).
    assert (got - x @ weight.T).abs().max() <= 0.01 * scale


@pytest.mark.deep  # slow (builds or a long end-to-end run): `make test-deep`
def test_every_instruction_set_unpacks_and_multiplies_the_same(kernel):
    # The AVX2 build (a Zen 3) runs the same vector code as an AVX-512 build, its integer sums through
    # maddubs instead of VNNI (no product pair reaches int16's limit): the same bits. The portable loops unpack
    # the same codes and sum the floats in another order.
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(9))
    for isa in variant_isas():
        variant = integer_kernels(isa)
        for qtype in TYPES:
            blocks = torch.from_numpy(random_blocks(qtype, 24, 512, seed=3))
            type_id = BY_NAME[qtype].type_id
            want = reference_dequantize(blocks.numpy(), qtype)
            torch.testing.assert_close(variant.gguf_dequantize(blocks, type_id, 512), want, rtol=2e-7, atol=1e-9)
            got, native = variant.gguf_linear(x, blocks, type_id), kernel.gguf_linear(x, blocks, type_id)
            if isa == "avx2":
                assert torch.equal(got, native), qtype
            else:
                torch.testing.assert_close(got, native, rtol=1e-5, atol=1e-5 * native.abs().max().item())


def test_q4_k_packing_keeps_every_bit_of_the_file(kernel):
    blocks = torch.from_numpy(random_blocks("Q4_K", 40, 512, seed=4))  # 40 rows: the last block of 16 is padded
    nibbles, scales_mins, supers = pack_q4_k(blocks)
    assert nibbles.shape == (3, 16, 4, 16, 4) and scales_mins.shape == (3, 16, 2, 16) and supers.shape == (3, 2, 2, 16)
    assert torch.equal(unpack_q4_k(nibbles, scales_mins, supers, 40), blocks)
    raw = torch.from_numpy(random_blocks("Q4_K", 48, 512, seed=5))  # no padding: 148 bytes per 144
    assert sum(t.numel() * t.element_size() for t in pack_q4_k(raw)) == raw.numel() * 148 // 144


@pytest.mark.parametrize("rows", [1, 3, 33, 70])
def test_packed_q4_k_kernel_computes_the_int8_activation_linear(rows, kernel):
    n, k = 40, 768
    blocks = torch.from_numpy(random_blocks("Q4_K", n, k, seed=rows))
    linear = GgufLinear(GgufBlocks(blocks, "Q4_K", k), None, kernel)
    assert linear.method.packed and linear.method.max_rows >= 4096  # prefill chunks too
    assert torch.equal(stored(linear), blocks) and torch.equal(stored(linear, 5, 21), blocks[5:21])
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0  # an all-zero group: scale 0
    got, want = linear(x), k_quant_reference(x, blocks, "Q4_K", k)
    scale = (x.abs() @ dequantize(blocks, "Q4_K", k).abs().T).amax()
    assert ((got.double() - want).abs() > 1e-5 * scale).sum() <= max(1, got.numel() // 40)  # rounding ties
    op = linear.kernel_facts().op  # the fused layer's linear: the same kernel
    assert torch.equal(kernel.q4_k_linear(x, *linear.method.packs(linear), n), got) and op is not None


def test_every_instruction_set_computes_packed_q4_k_the_same(kernel):
    blocks = torch.from_numpy(random_blocks("Q4_K", 48, 512, seed=6))
    packed = pack_q4_k(blocks)
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(6))
    want = kernel.q4_k_linear(x, *packed, 48)
    for isa in variant_isas():
        assert torch.equal(integer_kernels(isa).q4_k_linear(x, *packed, 48), want), isa
    with pytest.raises(RuntimeError, match="multiple of 256"):  # 96 inputs: three groups of 32, no Q4_K block
        kernel.q4_k_linear(torch.randn(2, 96), torch.zeros(1, 3, 4, 16, 4, dtype=torch.uint8),
                           torch.zeros(1, 3, 2, 16, dtype=torch.uint8), torch.zeros(1, 0, 2, 16).half(), 16)
    with pytest.raises(RuntimeError, match="scales_mins uint8"):
        kernel.q4_k_linear(x, packed[0], packed[1].float(), packed[2], 48)


@pytest.mark.parametrize("qtype", ["Q6_K", "Q4_K"])
@pytest.mark.parametrize("native", [True, False])
def test_linear_prefill_tiles_equal_float_matmul(qtype, native, kernel):
    # Blocks kept as stored (or no extension built): past the GEMV's rows, float tiles times float activations.
    n, k = 300, 512
    blocks = random_blocks(qtype, n, k, seed=7)
    weight = reference_dequantize(blocks, qtype)
    linear = GgufLinear(GgufBlocks(torch.from_numpy(blocks), qtype, k), torch.randn(n), kernel if native else None,
                        repack=False)
    linear.method.tile_rows = 64  # several tiles, the last one partial
    x = torch.randn(2, 17, k)
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight, linear.bias), rtol=1e-5, atol=1e-4)


def test_embedding_dequantizes_only_the_rows_looked_up():
    blocks = random_blocks("Q6_K", 50, 256)
    embed = GgufEmbedding(GgufBlocks(torch.from_numpy(blocks), "Q6_K", 256), torch.float32)
    ids = torch.tensor([[3, 49, 3], [0, 7, 11]])
    torch.testing.assert_close(embed(ids), reference_dequantize(blocks, "Q6_K")[ids], rtol=0, atol=0)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(path, config, the float weights under transformers' names that the file's blocks stand for)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "llama")


def test_the_tensor_directory_reads_as_the_gguf_package_does(tmp_path):
    """gguf_file steps over metadata arrays (strings, numbers, arrays of arrays) instead of materializing them:
    the same scalars, types, dims and bytes as GGUFReader, at a non-default alignment."""
    import gguf

    from sluice.service.executor.models.gguf_file import read_gguf

    path = tmp_path / "mixed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_token_list(["a", "bé", "<s>", ""] * 500)
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_array("test.floats", [0.5, 1.5])
    writer.add_float32("test.f", 0.25)
    writer.add_bool("test.b", True)
    writer.add_string("test.s", "héllo")
    writer.add_uint64("test.u", 2**40)
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("b.weight", rng.standard_normal(7).astype(np.float16))
    for i, qtype in enumerate(("Q8_0", "Q4_K", "Q6_K")):
        writer.add_tensor(f"q{i}.weight", random_blocks(qtype, 4, 256, seed=i),
                          raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata, tensors = read_gguf(path)
    assert (metadata["test.f"], metadata["test.b"], metadata["test.s"], metadata["test.u"]) == (
        0.25, True, "héllo", 2**40)
    assert metadata["general.architecture"] == "llama" and metadata["general.alignment"] == 64
    assert "tokenizer.ggml.tokens" not in metadata and "test.nested" not in metadata  # arrays: stepped over
    reader = gguf.GGUFReader(str(path))
    assert sorted(tensors) == sorted(t.name for t in reader.tensors)
    for t in reader.tensors:
        ours = tensors[t.name]
        assert ours.type_name == t.tensor_type.name and ours.dims == tuple(int(d) for d in t.shape)
        assert np.array_equal(ours.data, np.asarray(t.data).reshape(-1).view(np.uint8)), t.name
    assert np.array_equal(tensors["a.weight"].rows(np.float32), np.asarray(reader.tensors[0].data))
    assert tensors["q1.weight"].rows().shape == (4, 144)  # one Q4_K block of 144 bytes a row
    (tmp_path / "junk.gguf").write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(tmp_path / "junk.gguf")


def test_tiny_llama_gguf_loads_its_blocks_as_stored(tiny_gguf, kernel):
    path, config, _ = tiny_gguf
    model = gguf_weights.load(path, config, torch.device("cpu"), torch.float32)
    assert isinstance(model.embed_tokens, GgufEmbedding) and isinstance(model.lm_head, GgufLinear)
    assert model.lm_head is model.embed_tokens.table  # tied: one copy of the bytes
    first, second = model.layers
    assert isinstance(first.self_attn.qkv_proj, MergedLinear)  # Q4_K, IQ4_NL, Q5_K: side by side
    assert [p.method.qtype for p in first.self_attn.qkv_proj.parts] == ["Q4_K", "IQ4_NL", "Q5_K"]
    assert isinstance(second.self_attn.qkv_proj, GgufLinear) and second.self_attn.qkv_proj.out_features == 512
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) or hasattr(m, "in_features")]
    assert all(isinstance(m, (GgufLinear, MergedLinear)) for m in linears)
    modules = [m for m in model.modules() if isinstance(m, (GgufLinear, GgufEmbedding))]
    buffers = [t for m in modules for t in m.buffers(recurse=False)]
    assert {t.dtype for t in buffers} <= {torch.uint8, torch.int8, torch.float16}  # no float copy of any weight
    blocks = sum(t.numel() * t.element_size() for t in buffers)
    assert blocks < path.stat().st_size  # the blocks as they are, nothing dequantized beside them
    v = first.self_attn.qkv_proj.parts[2]  # Q5_K: regrouped with its fifth bits, every bit kept (not q: the
    # loader reorders q's rows for the rotary layout)
    assert v.method.packed and torch.equal(stored(v), torch.from_numpy(np.array(_raw(path, "blk.0.attn_v.weight"))))
    packed = second.mlp.gate_up_proj  # Q4_1: regrouped for the packed kernel, the same bytes
    assert packed.method.packed and torch.equal(stored(packed), torch.cat([
        torch.from_numpy(np.array(_raw(path, f"blk.1.{name}.weight"))) for name in ("ffn_gate", "ffn_up")]))
    o = second.self_attn.o_proj  # Q5_1 (and layer 0's gate/up, Q5_0): regrouped with their fifth bits
    want = torch.from_numpy(np.array(_raw(path, "blk.1.attn_output.weight")))
    assert o.method.packed and torch.equal(stored(o), want)


class RoundedActivationsFormat(PlainFormat):
    """The tiny Llama's linears as RoundedActivations: what every GGUF linear computes with the native kernels."""

    def make(self, weight, bias, parts, sizes, tied=False):
        return RoundedActivations(weight, bias)


def forced_gaps(model, prompts, texts) -> list[float]:
    """How far below `model`'s best logprob each token of `texts` lies, at that point of the text (teacher forced)."""
    engine = make_engine(model, "recompute", num_blocks=256, budget=32)
    prefixes = [prompt + text[:j] for prompt, text in zip(prompts, texts, strict=True) for j in range(len(text))]
    wanted = [t for text in texts for t in text]
    outs = engine.generate(prefixes, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20, ignore_eos=True))
    gaps = []
    for out, token in zip(outs, wanted, strict=True):
        top = dict(out.logprobs[0].top)
        gaps.append(out.logprobs[0].top[0][1] - top.get(token, float("-inf")))
    return gaps


@pytest.mark.parametrize("native", [False, True])
def test_tiny_llama_gguf_greedy_follows_the_float_weights(tiny_gguf, native, kernel, monkeypatch):
    """The file's blocks (q/k unpermuted) against the owned model on the dequantized float weights. Through
    torch's dequantize + matmul, against plain float linears: identical greedy tokens. Through the integer kernels
    (every call here has at most 32 rows, the step budget), against float linears on activations rounded as the
    kernels round them (llama.cpp's arithmetic): rounding is a step function, so a one-ulp difference in a sum's
    order may move an activation a whole quantum and break a near-tie the other way; each token is checked against
    the reference's logprobs at that point of our text instead (greedy_gaps in tests/support/int8_rounding)."""
    path, config, floats = tiny_gguf
    if not native:
        monkeypatch.setattr(gguf_weights.native, "load", lambda: None)
    ours = gguf_weights.load(path, config, torch.device("cpu"), torch.float32)
    assert isinstance(ours.layers[0].mlp.gate_up_proj, GgufLinear)
    assert (ours.layers[0].mlp.gate_up_proj.method.kernel is not None) == native
    method = (RoundedActivationsFormat if native else PlainFormat)(torch.device("cpu"), torch.float32)
    reference = weights.build(config, floats.get, method, torch.device("cpu"), torch.float32)
    assert STORED_MAX_ROWS >= 32
    texts = greedy(ours, PROMPTS)
    if not native:
        assert texts == greedy(reference, PROMPTS)
        return
    gaps = forced_gaps(reference, PROMPTS, texts)
    assert max(gaps) <= 0.05 and sum(g == 0 for g in gaps) >= 0.9 * len(gaps), gaps


def test_llama_3_rope_factors_give_transformers_llama3_frequencies(tmp_path):
    """llama.cpp stores Llama 3.1's rope scaling as one factor per frequency (rope_freqs.weight), no rope type in
    the config: served with the factors, the frequencies are transformers' llama3 rope's."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    want = ROPE_INIT_FUNCTIONS["llama3"](scaled)[0]
    plain = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    path, config, _ = write_tiny_gguf(tmp_path / "llama31.gguf", "llama", rope_freqs=(plain / want).numpy())
    model = gguf_weights.load(path, config, torch.device("cpu"), torch.float32)
    assert not torch.allclose(want, plain)
    torch.testing.assert_close(model.rotary_emb.inv_freq, want, rtol=1e-6, atol=0)
    # the file dequantized by transformers (no --quantization gguf): its model leaves the factors out
    from transformers import AutoModelForCausalLM

    dequantized = AutoModelForCausalLM.from_config(config)
    owned = weights.from_transformers(dequantized, PlainFormat(torch.device("cpu"), torch.float32),
                                      torch.device("cpu"), torch.float32)
    gguf_weights.apply_rope_factors(owned, path)
    torch.testing.assert_close(owned.rotary_emb.inv_freq, want, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="only Sluice's own forward"):
        gguf_weights.apply_rope_factors(dequantized, path)


def test_method_describes_the_types_it_served(tiny_gguf):
    path, config, _ = tiny_gguf
    method = GgufFormat(torch.float32)
    weights.build(config, gguf_weights.read_tensors(path, config), method, torch.device("cpu"), torch.float32)
    assert method.made == {"Q4_K": 1, "IQ4_NL": 1, "Q5_K": 1, "Q6_K": 2, "Q5_0": 1, "Q8_0": 1, "Q4_0": 1, "Q5_1": 1,
                           "Q4_1": 1, "IQ4_XS": 1}


def _raw(path, name: str) -> np.ndarray:
    import gguf

    return _raw_rows(gguf.GGUFReader(str(path)), name)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_decodes_through_the_fused_layer_as_through_python(tmp_path, arch, kernel):
    """Every block type (K-quants, a q/k/v of mixed types side by side; Qwen2's biases, Qwen3's q/k norms) in
    csrc/llama_layer.cpp's two calls per layer: the same kernels in the same order as the Python path, so the same
    greedy tokens."""
    path, config, _ = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch)
    model = gguf_weights.load(path, config, torch.device("cpu"), torch.float32)
    assert all(layer._layer_ops is not None for layer in model.layers)
    biases = [name for name, _ in model.named_parameters() if name.endswith("bias")]
    assert {name.split(".")[1] for name in biases} == ({"0", "1"} if arch == "qwen2" else set()), biases
    assert all((layer.self_attn.q_norm is not None) == (arch == "qwen3") for layer in model.layers)
    assert [layer._layer_ops_rows for layer in model.layers] == [PACKED_MAX_ROWS] * 2  # packed for every call size
    fused = greedy(model, PROMPTS)
    for layer in model.layers:
        layer._layer_ops = None
    assert greedy(model, PROMPTS) == fused


def _raw_rows(reader, name: str) -> np.ndarray:
    tensor = next(t for t in reader.tensors if t.name == name)
    return np.asarray(tensor.data)


@pytest.mark.slow
def test_default_model_under_gguf_serves_the_wheels_blocks_as_stored(smollm2_dir, kernel):
    import gguf

    from sluice.service.config import SluiceConfig
    from sluice.service.engine.engine import LLMEngine
    from sluice.service.executor.model_loader import default_gguf

    cfg = SluiceConfig()
    cfg.model.quantization, cfg.cache.num_kv_blocks = "gguf", 64
    engine = LLMEngine(cfg)
    model = engine.model
    projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the file's 210, q/k/v and gate/up fused
    body = [m for name, m in model.layers.named_modules() if name.rpartition(".")[2] in projections]
    assert len(body) == 120
    assert all(isinstance(m, GgufLinear) and m.method.qtype == "Q4_1" and m.method.packed for m in body)
    # The file's Q8_0 embedding, and the tied head reading the very same bytes.
    assert model.lm_head.method.qtype == "Q8_0" and model.lm_head is model.embed_tokens.table
    reader = gguf.GGUFReader(str(default_gguf()))
    # ffn_down's rows are not permuted by llama.cpp's converter: the bytes are the file's, row for row.
    assert np.array_equal(stored(model.layers[0].mlp.down_proj).numpy(),
                          _raw_rows(reader, "blk.0.ffn_down.weight"))
    assert np.array_equal(stored(model.lm_head).numpy(), _raw_rows(reader, "token_embd.weight"))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "The capital of France is"}],
                                                  add_generation_prompt=True, tokenize=False)
    # The float checkpoint was dequantized from this very file, and --quantization int4 quantizes it back into the
    # same Q4_1 blocks and Q8_0 embedding: one family of linears, the same kernels, the same tokens.
    params = SamplingParams(max_tokens=16, temperature=0.0)
    int4_cfg = SluiceConfig()
    int4_cfg.model.quantization, int4_cfg.cache.num_kv_blocks = "int4", 64
    int4 = LLMEngine(int4_cfg)
    assert torch.equal(stored(int4.model.layers[0].mlp.down_proj), stored(model.layers[0].mlp.down_proj))
    assert torch.equal(stored(int4.model.lm_head), stored(model.lm_head))
    assert engine.generate([prompt], params)[0].token_ids == int4.generate([prompt], params)[0].token_ids


def test_gguf_needs_a_gguf_file_the_engine_loads(model_dir):
    from sluice.service.config import SluiceConfig
    from sluice.service.engine.engine import LLMEngine
    from tests.support.parity import build_pair

    _, ours = build_pair("llama")
    cfg = SluiceConfig()
    cfg.model.quantization = "gguf"
    with pytest.raises(ValueError, match="load the model itself"):
        LLMEngine(cfg, model=ours, tokenizer=tiny.tokenizer())
    cfg.model.model = model_dir  # a plain safetensors checkpoint
    with pytest.raises(ValueError, match="is not a .gguf file"):
        LLMEngine(cfg)
