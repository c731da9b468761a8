"""LoRA adapters: greedy output with an adapter equals transformers + peft with the adapter merged, alone and with
rows of other adapters and of the base model in the same steps; checks, slots, scheduling and the API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.executor.lora.adapter import Geometry, LoRAError, read_adapter
from tests.support.lora import call as lora_call
from tests.support.lora import make_adapter
from tests.support.parity import hf_greedy_batch

PROMPTS = ["The capital of France is", "Hello world, how are", "Streaming tokens over", "你好世界"]


def merged_greedy(model_dir: str, adapter: str | None, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy generate on the base model with `adapter` merged (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return hf_greedy_batch(model, prompts, max_new, min_new_tokens=max_new)


def lora_engine(model_dir: str, modules: list[str], max_loras: int = 4, lora_dir: str = "", **scheduler):
    """An fp32 CPU engine on `model_dir` serving `modules` ('name=path'); runtime loads from `lora_dir` if given."""
    from sluice.service.config import SluiceConfig
    from sluice.service.engine.engine import LLMEngine

    config = SluiceConfig()
    config.model.model, config.model.device, config.model.dtype = str(model_dir), "cpu", "float32"
    config.cache.num_kv_blocks = 64
    config.lora.lora_modules, config.lora.max_loras = tuple(modules), max_loras
    config.lora.enable_lora = True
    config.lora.allow_runtime_lora, config.lora.lora_dir = bool(lora_dir), lora_dir
    for name, value in scheduler.items():
        setattr(config.scheduler, name, value)
    return LLMEngine(config)


def run(engine, jobs: list[tuple[list[int], str | None]], max_new: int) -> list[list[int]]:
    """Greedy outputs of (prompt ids, adapter name or None) requests added together (so they share steps)."""
    for i, (ids, name) in enumerate(jobs):
        lora = None if name is None else engine.loras.get(name)
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True,
                                                        lora_request=lora))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done.setdefault(out.request_id, []).extend(out.token_ids)
    return [done[f"r{i}"] for i in range(len(jobs))]


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """Two adapters of the tiny model: one on every projection, one on attention only."""
    root = tmp_path_factory.mktemp("adapters")
    return (make_adapter(model_dir, str(root / "a"), seed=1),
            make_adapter(model_dir, str(root / "b"), seed=2, targets=["q_proj", "v_proj", "o_proj"], r=4))


def test_tiny_parity_alone_and_mixed_with_other_adapters_and_the_base(model_dir, adapters):
    from tests.support.tiny import tokenizer

    tok = tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    max_new = 12
    expected = {name: merged_greedy(model_dir, path, prompts, max_new)
                for name, path in (("a", adapters[0]), ("b", adapters[1]), (None, None))}
    assert expected["a"] != expected[None] and expected["b"] != expected[None]  # the adapters matter
    engine = lora_engine(model_dir, [f"a={adapters[0]}", f"b={adapters[1]}"], max_loras=2)
    assert run(engine, [(prompts[0], "a")], max_new) == [expected["a"][0]]  # batch 1
    steps = spy_steps(engine)
    jobs = [(p, name) for i, p in enumerate(prompts) for name in (("a", "b", None)[i % 3], ("b", None, "a")[i % 3])]
    got = run(engine, jobs, max_new)
    for (ids, name), tokens in zip(jobs, got, strict=True):
        assert tokens == expected[name][prompts.index(ids)], name
    assert any(len(uids) == 2 and base for uids, base in steps)  # two adapters and the base in one step


def spy_steps(engine) -> list[tuple[set[int], bool]]:
    """Records each step's (adapter ids, whether base-model rows ran too)."""
    steps, batch = [], engine.runner.lora_slots.batch

    def spy(requests, rows):
        steps.append(({r.uid for r in requests if r is not None}, None in requests))
        return batch(requests, rows)

    engine.runner.lora_slots.batch = spy
    return steps


# ---- checks on the adapter files ----------------------------------------------------------------------------

def _geometry(model_dir: str) -> Geometry:
    from transformers import AutoConfig

    return Geometry.of(AutoConfig.from_pretrained(model_dir))


def test_adapter_checks_name_what_is_wrong(model_dir, adapters, tmp_path):
    geometry = _geometry(model_dir)
    weights = read_adapter(adapters[0], geometry, 16, torch.float32)
    assert weights.rank == 8 and len(weights.modules) == 2 * 7
    with pytest.raises(LoRAError, match=r"rank \(r in adapter_config.json\) is above --max-lora-rank 4"):
        read_adapter(adapters[0], geometry, 4, torch.float32)
    with pytest.raises(LoRAError, match="not a peft LoRA directory"):
        read_adapter(str(tmp_path / "nowhere"), geometry, 16, torch.float32)
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads(open(f"{adapters[0]}/adapter_config.json").read())
    (bad / "adapter_model.safetensors").write_bytes(open(f"{adapters[0]}/adapter_model.safetensors", "rb").read())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "lm_head"]}))
    with pytest.raises(LoRAError, match="target modules the model does not have; supported: down_proj") as e:
        read_adapter(str(bad), geometry, 16, torch.float32)
    assert "lm_head" not in str(e.value) and "lm_head" in e.value.detail  # the client is told ours, the log theirs
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoRAError, match="use_dora"):
        read_adapter(str(bad), geometry, 16, torch.float32)
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))  # the tensors are rank 8
    with pytest.raises(LoRAError, match="shape does not fit") as e:
        read_adapter(str(bad), geometry, 16, torch.float32)
    assert "layers" not in str(e.value) and "has shape" in e.value.detail
    (bad / "adapter_config.json").write_text(json.dumps(config))
    (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(LoRAError, match="cannot be read") as e:
        read_adapter(str(bad), geometry, 16, torch.float32)
    assert "header" not in str(e.value)  # safetensors' own words (which may quote the file) go to the log only
    (bad / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"], oops')
    with pytest.raises(LoRAError, match="not valid JSON$"):
        read_adapter(str(bad), geometry, 16, torch.float32)
    for value in ({"target_modules": 5}, {"lora_alpha": float("nan")}, {"lora_alpha": 10 ** 400}):
        (bad / "adapter_config.json").write_text(json.dumps({**config, **value}))
        with pytest.raises(LoRAError):
            read_adapter(str(bad), geometry, 16, torch.float32)


def test_adapter_for_another_model_shape_is_refused(model_dir, tmp_path):
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.hidden_size, config.intermediate_size = 32, 64
    other = str(tmp_path / "other")
    LlamaForCausalLM(config).save_pretrained(other)
    adapter = make_adapter(other, str(tmp_path / "adapter"), seed=3)
    with pytest.raises(LoRAError, match="shape does not fit the base model") as e:
        read_adapter(adapter, _geometry(model_dir), 16, torch.float32)
    assert "the base model needs" in e.value.detail


def test_an_operator_adapter_cannot_take_the_served_models_name(model_dir, adapters):
    from sluice.service.engine.engine import _default_served_name

    with pytest.raises(ValueError, match="cannot take the served model's name"):
        lora_engine(model_dir, [f"{_default_served_name(str(model_dir))}={adapters[0]}"])


def test_lora_module_specs():
    from sluice.service.config import lora_name_problem
    from sluice.service.executor.lora.manager import parse_lora_module

    assert parse_lora_module("sql=/a/b") == ("sql", "/a/b")
    for good in ("sql", "a.b_c-D9", "x" * 64):
        assert lora_name_problem(good) is None
    for bad in ("", "x,opA", "a b", "a/b", "é", "x" * 65, 'a"b', "a\nb", None):
        assert lora_name_problem(bad) is not None, bad
    assert lora_name_problem("tiny", "tiny") is not None and lora_name_problem("tiny", "other") is None
    assert parse_lora_module('{"name": "sql", "path": "/a", "base_model_name": "x"}') == ("sql", "/a")
    for bad in ("sql", "=/a", '{"name": 1}', "{oops"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)


# ---- scheduling, slots and the prefix cache ---------------------------------------------------------------

def test_a_step_never_holds_more_adapters_than_slots_and_cached_prefixes_never_mix(model_dir, adapters):
    """max_loras 1 with two adapters: every step's adapter rows share one slot; the base, each adapter and a
    reload under the same name hash their prefixes apart."""
    engine = lora_engine(model_dir, [f"a={adapters[0]}", f"b={adapters[1]}"], max_loras=1)
    steps = spy_steps(engine)
    from tests.support.tiny import tokenizer

    ids = tokenizer().encode(PROMPTS[0] * 4)
    jobs = [(ids, "a"), (ids, "b"), (ids, None), (ids, "a")]
    outs = run(engine, jobs, 6)
    seen = [uids for uids, _ in steps]
    assert max(len(s) for s in seen) == 1
    assert len({frozenset(s) for s in seen if s}) == 2  # both adapters ran, one at a time
    assert outs[0] == outs[3] and outs[0] != outs[2] and outs[1] != outs[2]
    from sluice.scheduling.request import Request

    a, b = engine.loras.get("a"), engine.loras.get("b")
    hashes = {name: Request("x", ids, SamplingParams(lora_request=lora)) for name, lora in
              (("a", a), ("b", b), ("base", None))}
    for r in hashes.values():
        r.update_block_hashes(16)
    assert len({r.block_hashes[0] for r in hashes.values()}) == 3
    with pytest.raises(LoRAError, match="cannot be unloaded"):
        engine.loras.unload("a")  # the operator's
    assert engine.loras.get("a") is a


def test_a_reload_under_the_same_name_gets_a_new_id(model_dir, adapters, tmp_path):
    """A runtime adapter unloaded and loaded again under its name hashes its prefixes apart from before."""
    import shutil

    shutil.copytree(adapters[0], tmp_path / "c")
    engine = lora_engine(model_dir, [], max_loras=1, lora_dir=str(tmp_path))
    c = engine.loras.load_runtime("c", "c")  # relative to the root
    engine.loras.unload("c")
    again = engine.loras.load_runtime("c", str(tmp_path / "c"))
    assert again.uid != c.uid and again.hash_key != c.hash_key


def test_lora_requests_info_reports_the_adapters_of_running_and_waiting_requests():
    from prometheus_client import CollectorRegistry

    from sluice.metrics.prometheus import SluiceMetrics, render_latest
    from sluice.metrics.vllm_names import CacheConfigInfo
    from sluice.scheduling.output import SchedulerStats

    reg = CollectorRegistry()
    m = SluiceMetrics("m", reg, vllm_names=CacheConfigInfo(16, True))
    m.observe_step(SchedulerStats(running_lora_adapters=("a", "b"), waiting_lora_adapters=("c",), max_loras=2))
    m.observe_step(SchedulerStats(running_lora_adapters=("a",), max_loras=2))
    lines = [x for x in render_latest(reg)[0].decode().splitlines() if "lora_requests_info{" in x]
    assert len(lines) == 2  # Sluice's and vLLM's name, the earlier label set gone
    for line in lines:
        assert 'running_lora_adapters="a"' in line and 'waiting_lora_adapters=""' in line and 'max_lora="2"' in line


@pytest.mark.slow
def test_smollm2_parity_with_two_adapters_and_the_base_in_one_batch(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    a = make_adapter(smollm2_dir, str(tmp_path / "a"), seed=1, scale=0.05)
    b = make_adapter(smollm2_dir, str(tmp_path / "b"), seed=2, targets=["q_proj", "v_proj", "down_proj"], r=4,
                     scale=0.05)
    max_new = 8
    expected = {name: merged_greedy(smollm2_dir, path, prompts, max_new) for name, path in
                (("a", a), ("b", b), (None, None))}
    assert expected["a"] != expected[None] and expected["b"] != expected[None]
    engine = lora_engine(smollm2_dir, [f"a={a}", f"b={b}"], max_loras=2)
    assert run(engine, [(prompts[0], "a")], max_new) == [expected["a"][0]]  # batch 1
    steps = spy_steps(engine)
    jobs = [(p, name) for p in prompts for name in ("a", "b", None)]
    for (ids, name), tokens in zip(jobs, run(engine, jobs, max_new), strict=True):
        assert tokens == expected[name][prompts.index(ids)], name
    assert any(len(uids) == 2 and base for uids, base in steps)


# ---- through `sluice serve` --------------------------------------------------------------------------------

KEY = {"Authorization": "Bearer k"}


def call(srv, path: str, body=None, headers=KEY) -> tuple[int, str]:
    """(status, body text) of a GET (body None) or a JSON POST, with the key unless told otherwise."""
    return lora_call(srv, path, body, headers)


def prefix_hits(srv) -> float:
    """sluice_prefix_cache_hit_tokens_total of the server."""
    text = call(srv, "/metrics", headers={})[1]
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("sluice_prefix_cache_hit_tokens_total{"))


def test_serve_with_adapters_load_unload_models_requests_metrics_and_cache(model_dir, adapters, tmp_path):
    from tests.support.server import MODEL, Server

    root = str(Path(adapters[0]).parent)
    srv = Server(model_dir, tmp_path, "--lora-modules", f"a={adapters[0]}", "--max-loras", "2", "--api-key", "k",
                 "--vllm-metric-names", "--allow-runtime-lora", "--lora-dir", root).wait_ready()
    try:
        assert call(srv, "/v1/models", headers={})[0] == 401
        assert call(srv, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": adapters[1]}, headers={})[0] == 401
        cards = {c["id"]: c for c in json.loads(call(srv, "/v1/models")[1])["data"]}
        assert cards["a"]["parent"] == MODEL and cards["a"]["root"] == "a" and cards[MODEL]["parent"] is None

        prompt = " ".join(PROMPTS) * 2  # several full blocks

        def complete(model: str) -> tuple[int, dict]:
            status, text = call(srv, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8,
                                                         "temperature": 0, "ignore_eos": True})
            return status, json.loads(text)

        hits = prefix_hits(srv)
        base = complete(MODEL)[1]
        status, with_a = complete("a")
        assert status == 200 and with_a["model"] == "a"
        assert with_a["choices"][0]["text"] != base["choices"][0]["text"]
        assert prefix_hits(srv) == hits  # the adapter's prompt found none of the base model's blocks
        assert complete("a")[1]["choices"][0]["text"] == with_a["choices"][0]["text"]
        assert prefix_hits(srv) > hits  # …but its own

        status, text = call(srv, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": root})  # no adapter
        assert status == 400 and json.loads(text)["error"]["param"] == "lora_path" and root not in text
        status, text = call(srv, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": adapters[1]})
        assert status == 200, text
        status, text = call(srv, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": adapters[1]})
        assert status == 400 and json.loads(text)["error"]["param"] == "lora_name"
        assert "b" in {c["id"] for c in json.loads(call(srv, "/v1/models")[1])["data"]}
        assert complete("b")[0] == 200
        info = [line for line in call(srv, "/metrics", headers={})[1].splitlines()
                if line.startswith("vllm:lora_requests_info{")]
        assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0]

        assert call(srv, "/v1/unload_lora_adapter", {"lora_name": "b"})[0] == 200
        status, text = complete("b")
        assert status == 404 and text["error"]["code"] == "model_not_found" and text["error"]["param"] == "model"
        assert call(srv, "/v1/unload_lora_adapter", {"lora_name": "b"})[0] == 404
        assert complete("nope")[0] == 404
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
