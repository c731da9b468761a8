"""Decoder rerankers in the engine: Qwen3-Reranker's score (softmax of the last position's [no, yes] logits, P(yes))
equals transformers' on the same weights, through chunked prefill, prefix-cache hits and batches shared with
generation; the prompt is the model card's; vLLM's --runner / --hf-overrides resolve as vLLM's do.

The model is tests/support/reranker.py's tiny random Qwen3 with SmolLM2's tokenizer, loaded by the engine with
vLLM's launch line (architectures overridden to Qwen3ForSequenceClassification: Sluice still runs its own causal LM).
Tolerance: 1e-4 on each score, everything in float32.
"""

from __future__ import annotations

import json

import pytest

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.api.rerank import qwen3_reranker_ids
from sluice.service.executor.pooling import ClassifyParams, resolve_runner
from tests.support import reranker as R

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory, smollm2_dir) -> str:
    return R.save_tiny_reranker(tmp_path_factory.mktemp("qwen3-reranker"), str(smollm2_dir))


def _engine(model_dir: str, runner: str = "pooling", overrides: dict | None = R.HF_OVERRIDES, **scheduler):
    from sluice.service.config import SluiceConfig
    from sluice.service.engine.engine import LLMEngine

    config = SluiceConfig()
    config.model.model, config.model.device, config.model.dtype = model_dir, "cpu", "float32"
    config.model.runner, config.model.hf_overrides = runner, json.dumps(overrides) if overrides else ""
    config.cache.num_kv_blocks, config.cache.block_size = 64, 16
    for name, value in scheduler.items():
        setattr(config.scheduler, name, value)
    return LLMEngine(config)


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Requests added together, run to completion: their final outputs (a generation's tokens gathered)."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    done, tokens = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out
    for rid, out in done.items():
        out.token_ids = tokens[rid]
    return done


def test_the_prompt_is_the_model_cards(reranker_dir):
    tok = R.tokenizer(reranker_dir)
    for doc in R.DOCUMENTS:
        assert qwen3_reranker_ids(tok, R.DEFAULT_INSTRUCTION, R.QUERY, doc) == R.model_card_ids(reranker_dir, R.QUERY,
                                                                                                 doc)
    mine = "Given a question, find the passage that answers it"
    assert qwen3_reranker_ids(tok, mine, R.QUERY, "x") == R.model_card_ids(reranker_dir, R.QUERY, "x", mine)
    ids = R.model_card_ids(reranker_dir, R.QUERY, "x")
    assert tok.decode(ids).startswith("<|im_start|>system\nJudge whether the Document")
    assert tok.decode(ids).endswith("<Document>: x<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_scores_match_transformers_across_chunks_cache_hits_and_generation(reranker_dir):
    # A 32-token budget: each ~100-token prompt spans several prefill chunks; the second round finds the shared
    # query prefix (and whole prompts) in the prefix cache; a generation request shares the batches.
    engine = _engine(reranker_dir, max_num_batched_tokens=32)
    assert engine.runner_type == "pooling" and engine.classifier.tokens == ("no", "yes")
    assert type(engine.model).__module__.startswith("sluice."), "the owned causal LM runs the reranker"
    tok = R.tokenizer(reranker_dir)
    assert engine.classifier.token_ids == tuple(tok.convert_tokens_to_ids(["no", "yes"]))
    prompts = [R.model_card_ids(reranker_dir, R.QUERY, doc) for doc in R.DOCUMENTS]
    want = [R.reference_score(reranker_dir, ids) for ids in prompts]
    assert max(want) - min(want) > 0.1, "the tiny model should tell the documents apart"
    params = SamplingParams(max_tokens=1, pooling=ClassifyParams(token_ids=engine.classifier.token_ids))
    for round_ in range(2):
        requests = {f"doc{round_}-{i}": (ids, params) for i, ids in enumerate(prompts)}
        requests[f"gen{round_}"] = (tok.encode("Hello there"), SamplingParams(max_tokens=4, temperature=0.0))
        done = _run(engine, requests)
        for i, ids in enumerate(prompts):
            out = done[f"doc{round_}-{i}"]
            assert out.embedding.shape == (1,) and out.num_prompt_tokens == len(ids)
            assert abs(out.embedding[0].item() - want[i]) <= TOLERANCE, (round_, i, out.embedding[0].item(), want[i])
            if round_:
                assert out.num_cached_tokens >= 64, "the second round should hit the prefix cache"
        assert len(done[f"gen{round_}"].token_ids) == 4
    stats = engine.kv_stats()
    assert stats["free_blocks"] == stats["total_blocks"], "every block is free at the end"


def test_runner_resolves_as_vllms(reranker_dir):
    from transformers import AutoConfig

    from sluice.service.executor.model_loader import apply_hf_overrides

    tok = R.tokenizer(reranker_dir)
    plain = AutoConfig.from_pretrained(reranker_dir)
    assert resolve_runner("auto", plain, tok, plain.vocab_size) == ("generate", None)
    assert resolve_runner("pooling", plain, tok, plain.vocab_size) == ("pooling", None)
    reranker = AutoConfig.from_pretrained(reranker_dir)
    apply_hf_overrides(reranker, R.HF_OVERRIDES)
    runner, spec = resolve_runner("auto", reranker, tok, reranker.vocab_size)
    assert runner == "pooling" and spec.qwen3_template and spec.tokens == ("no", "yes")
    assert resolve_runner("generate", reranker, tok, reranker.vocab_size)[0] == "generate"
    for tokens, why in ((["no", "yes", "maybe"], "two tokens"), (["no"], "two tokens"),
                        (["no", "absolutely-not-a-token"], "not a single token")):
        reranker.classifier_from_token = tokens
        with pytest.raises(ValueError, match=why):
            resolve_runner("pooling", reranker, tok, reranker.vocab_size)


def test_hf_overrides_merge_into_the_config_and_keep_the_owned_forward(reranker_dir):
    from transformers import AutoConfig

    from sluice.service.config import ModelConfig
    from sluice.service.executor.model_loader import apply_hf_overrides, load_model
    from sluice.service.executor.models.llama import LlamaForCausalLM

    config = AutoConfig.from_pretrained(reranker_dir)
    apply_hf_overrides(config, {"rms_norm_eps": 1e-5, "max_position_embeddings": 300, "new_field": {"a": 1}})
    assert config.max_position_embeddings == 300 and config.new_field == {"a": 1}
    settings = ModelConfig(hf_overrides=json.dumps({**R.HF_OVERRIDES, "max_position_embeddings": 256}))
    model, _ = load_model(reranker_dir, "cpu", "float32", settings=settings)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.architectures == ["Qwen3ForSequenceClassification"]
    assert model.config.classifier_from_token == ["no", "yes"] and model.config.max_position_embeddings == 256


@pytest.mark.parametrize("text, why", [("{bad", "not valid JSON"), ("[1, 2]", "must be a JSON object"),
                                       ('"x"', "must be a JSON object")])
def test_hf_overrides_must_be_a_json_object(text, why, capsys):
    from sluice.service.cli import build_parser
    from sluice.service.config import parse_hf_overrides

    with pytest.raises(ValueError, match=why):
        parse_hf_overrides(text)
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--hf-overrides", text])
    assert exit_.value.code == 2 and "--hf-overrides" in capsys.readouterr().err
    assert parse_hf_overrides("") == {} and parse_hf_overrides(' {"a": [1]} ') == {"a": [1]}


def test_a_reranker_given_as_a_model_object_takes_the_overrides(reranker_dir):
    """LLMEngine(model=...) (a caller-built transformers model): --hf-overrides still name its classifier tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from sluice.service.config import SluiceConfig
    from sluice.service.engine.engine import LLMEngine

    config = SluiceConfig()
    config.model.device, config.model.dtype, config.cache.num_kv_blocks = "cpu", "float32", 32
    config.model.runner, config.model.hf_overrides = "auto", json.dumps(R.HF_OVERRIDES)
    hf = AutoModelForCausalLM.from_pretrained(reranker_dir, dtype=torch.float32)
    engine = LLMEngine(config, model=hf, tokenizer=R.tokenizer(reranker_dir))
    assert engine.runner_type == "pooling" and engine.classifier.token_ids
    ids = R.model_card_ids(reranker_dir, R.QUERY, R.DOCUMENTS[0])
    done = _run(engine, {"a": (ids, SamplingParams(max_tokens=1,
                                                   pooling=ClassifyParams(token_ids=engine.classifier.token_ids)))})
    assert abs(done["a"].embedding[0].item() - R.reference_score(reranker_dir, ids)) <= TOLERANCE
