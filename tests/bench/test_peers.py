"""`bench peers`, workloads D and E: the plan per size and weight format (the float pair by the CPU), its
duration, the commands, the random models, the speculation and prefill figures and the report. Nothing here builds
llama.cpp or a large model."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import orjson
import pytest
from aiohttp import web
from safetensors import safe_open

from sluice.service.bench import peer_plan
from sluice.service.bench.peer_plan import (
    AB_SLOTS,
    C_SLOTS,
    E_SLOT_CTX,
    NAMED_ONLY,
    PAIRS,
    SCALES,
    Launch,
    Line,
    default_pairs,
    estimate_lines,
    estimate_s,
    parse_formats,
    parse_sizes,
    plan,
    workload_s,
    workloads,
)
from sluice.service.bench.peers_report import ratios, table
from sluice.service.bench.repetitive import PASSAGES, edit_prompts
from sluice.service.bench.serve import ServeConfig, run_serve
from sluice.service.bench.stats import RequestRecord, spec_summary
from sluice.service.bench.workloads import Workload, text_prompts

pytestmark = pytest.mark.timeout(120)
ALL = ("135m", "360m", "1.7b")


def test_peers_build_uses_only_the_cpu_features_it_reports():
    from sluice.service.bench.llama_cpp import cmake_isa_options

    opts = cmake_isa_options({"avx", "avx2", "fma", "f16c"})
    assert "-DGGML_NATIVE=OFF" in opts and "-DGGML_AVX2=ON" in opts and "-DGGML_AVX512=OFF" in opts
    assert not any("AMX" in o and o.endswith("ON") for o in opts)
    assert "-DGGML_AVX512=ON" in cmake_isa_options({"avx2", "avx512f"})


def test_sizes_and_formats_parse_by_either_name():
    assert parse_sizes("") == ALL and parse_sizes("1.7b, 135M") == ("135m", "1.7b")
    assert parse_formats("", ["avx512_bf16"]) == default_pairs(["avx512_bf16"])
    assert parse_formats("F32,int4") == (("fp32", "F32"), ("int4", "Q4_1"))
    assert parse_formats("fp32") == (("fp32", "F32"),)
    assert parse_formats("fp32,f16") == parse_formats("F32,F16") == (("fp32", "F32"), ("f16", "F16"))
    assert parse_formats("gguf") == parse_formats("q4_k_m") == (("Q4_K", "Q4_K_M"),)
    assert parse_formats("q4_0") == (("Q4_0", "Q4_0"),)  # one name, both sides
    assert parse_formats("iq4_xs,Q5_K") == (("Q5_K", "Q5_K_M"), ("IQ4_XS", "IQ4_XS"))  # only where named
    assert parse_formats("q3_k_m") == parse_formats("Q3_K") == (("Q3_K", "Q3_K_M"),)
    assert parse_formats("q2_k") == (("Q2_K", "Q2_K"),)
    assert not set(NAMED_ONLY) & set(default_pairs([]) + default_pairs(["avx512_bf16"]))
    with pytest.raises(ValueError, match="unknown sizes"):
        parse_sizes("7b")
    with pytest.raises(ValueError, match="unknown weight formats"):
        parse_formats("fp32,q8_0")


def test_plan_pairs_every_format_at_the_same_kv_capacity_and_fits_every_request():
    lines = plan(ALL)
    names = [line.name for line in lines]
    assert len(names) == len(set(names))
    for size in ALL:
        ws = workloads(size)
        for ours, theirs in PAIRS:
            sluice = next(x for x in lines if x.name == f"{size} Sluice {ours}")
            peer = next(x for x in lines if x.name == f"{size} llama.cpp {theirs}")
            ab, c, e = peer.launches
            assert (ab.slots, c.slots) == (AB_SLOTS, C_SLOTS) and set(ab.workloads) == {"A", "B"}
            # one Sluice server holds as many KV tokens as the larger of llama.cpp's two layouts; E has a server
            # of its own on both sides, one slot of 4,096 tokens
            assert [x.kv_tokens for x in sluice.launches] == [max(ab.kv_tokens, c.kv_tokens), E_SLOT_CTX]
            assert set(sluice.launches[0].workloads) == set(ab.workloads) | set(c.workloads)
            assert sluice.launches[1] == e == Launch(1, 4096, ("E",))
            for launch in peer.launches:  # every request fits its slot, with room for tokenization drift
                for name in launch.workloads:
                    prompt = 620 if name == "D" else ws[name].input_len
                    assert prompt + ws[name].output_len + 8 <= launch.slot_ctx, (size, name)
        w = ws["E"]  # one long prompt at a time, within Sluice's --max-model-len 2048
        assert w.max_concurrency == 1 and w.output_len == 16 and 1900 <= w.input_len <= 2048 - 16 - 16
        assert w.num_prompts >= 1 and w.seed not in {x.seed for n, x in ws.items() if n != "E"}
    assert len([x for x in lines if x.name == "135m Sluice fp32"]) == 1  # paired with F32 and F16, run once
    assert [x.name for x in lines if x.spec] == ["135m Sluice bf16 ngram", "135m llama.cpp BF16 ngram k4",
                                                 "135m llama.cpp BF16 ngram"]
    assert all(any("D" in launch.workloads for launch in x.launches) for x in lines if x.size == "135m")
    assert not any("D" in launch.workloads for x in lines if x.size != "135m" for launch in x.launches)


def test_plan_without_bf16_with_a_baseline_and_other_layouts():
    lines = plan(("360m",), parse_formats("bf16,fp32"), d_sizes=("360m",), bf16=False, baseline="0123abcd" * 5,
                 shapes=("qwen3-135m",))
    names = [x.name for x in lines]
    assert names[:3] == ["360m Sluice@0123abcd fp32", "360m Sluice fp32", "360m llama.cpp F32"]
    assert "360m Sluice bf16" not in names and "360m llama.cpp BF16" in names
    assert "360m Sluice fp32 ngram" in names  # D's pair falls back to fp32 where bf16 does not run
    assert names[-2:] == ["135m Sluice@0123abcd fp32 qwen3", "135m Sluice fp32 qwen3"]
    with pytest.raises(ValueError, match="unknown shape"):
        plan(("135m",), shapes=("gpt2-135m",))


def test_run_estimate_fits_the_time_budget_and_bounds_every_server_run():
    lines = plan(ALL, tuple(p for p in PAIRS if p not in NAMED_ONLY))
    total = sum(estimate_s(x) for x in lines)
    assert 40 * 60 <= total <= 75 * 60  # every pair named or not: both float pairs, Sluice fp32 and f16 each a server
    assert sum(estimate_s(x) for x in plan(ALL, NAMED_ONLY)) <= 60 * 60  # Q5_K_M, IQ4_XS, Q3_K_M and Q2_K, when named
    for flags in ([], ["amx_bf16"]):  # a run with the CPU's own float pairs takes about an hour
        assert 30 * 60 <= sum(estimate_s(x) for x in plan(ALL, default_pairs(flags), bf16=bool(flags))) <= 65 * 60
    assert max(workload_s(x, w) for x in lines for launch in x.launches for w in launch.workloads) <= 95
    assert estimate_lines(lines)[0].startswith(f"{len(lines)} server lines; expected duration about ")
    # B keeps enough single-stream decode steps for a stable p50 at every size, C keeps 16 in flight
    for size in ALL:
        ws = workloads(size)
        assert ws["B"].num_prompts * ws["B"].output_len >= 96 and ws["C"].num_prompts >= C_SLOTS
        assert ws["A"].num_prompts == AB_SLOTS and ws["C"].input_len >= 3 * ws["A"].input_len


def test_estimate_grows_with_the_model_and_the_weight_format():
    b = {size: workload_s(Line(size, "llama.cpp", "F32", launches=(Launch(1, 1, ("B",)),)), "B") / workloads(size)["B"]
         .num_prompts / workloads(size)["B"].output_len for size in ALL}
    assert b["135m"] < b["360m"] < b["1.7b"]
    f32, q4 = (Line("1.7b", "Sluice", f, launches=(Launch(1, 1, ("A",)),)) for f in ("fp32", "int4"))
    assert workload_s(f32, "A") > workload_s(q4, "A")


def test_commands_carry_format_kv_capacity_and_speculation(tmp_path):
    from sluice.service.bench.peers import command, sluice_command

    hf, q4k = tmp_path / "hf", tmp_path / "m-Q4_K_M.gguf"
    cmd = sluice_command("py", "Q4_K", hf, q4k, 4096, spec=True)
    assert cmd[cmd.index("--model") + 1] == str(q4k) and cmd[cmd.index("--quantization") + 1] == "gguf"
    assert cmd[cmd.index("--num-kv-blocks") + 1] == "256" and cmd[-4:] == list(peer_plan.SPEC_SLUICE)
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "float16"  # as llama.cpp's f16 cache
    q4_0 = Line("360m", "Sluice", "Q4_0", launches=(Launch(1, 8192, ("A",)),))
    cmd = command(q4_0, q4_0.launches[0], {("360m", "hf"): hf, ("360m", "Q4_0"): tmp_path / "m-Q4_0.gguf"},
                  tmp_path / "srv", {"Sluice": sys.executable}, "2")  # llama.cpp's own Q4_0 file, as stored
    assert cmd[cmd.index("--model") + 1] == str(tmp_path / "m-Q4_0.gguf")
    assert cmd[cmd.index("--quantization") + 1] == "gguf"
    cmd = sluice_command("py", "bf16", hf, q4k, 32768)
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and "--quantization" not in cmd
    assert "--kv-cache-dtype" not in cmd  # 16 bits already
    assert "--kv-cache-dtype" not in sluice_command("py", "fp32", hf, q4k, 4096, kv16=False)  # an older baseline
    line = Line("135m", "llama.cpp", "BF16", "ngram k4", (Launch(16, 1024, ("B", "D")),))
    cmd = command(line, line.launches[0], {("135m", "BF16"): tmp_path / "b.gguf"}, tmp_path / "srv", {}, "2")
    assert cmd[cmd.index("--parallel") + 1] == "16" and cmd[cmd.index("-c") + 1] == "16384"
    assert "--no-kv-unified" in cmd and cmd[cmd.index("--spec-ngram-simple-size-m") + 1] == "4"
    e_plan = plan(("135m",), (("f16", "F16"),))
    peer, ours = (next(x for x in e_plan if x.engine == e) for e in ("llama.cpp", "Sluice"))
    cmd = command(peer, peer.launches[-1], {("135m", "F16"): tmp_path / "h.gguf"}, tmp_path / "srv", {}, "2")
    assert cmd[cmd.index("-m") + 1] == str(tmp_path / "h.gguf")  # E: llama.cpp's one slot of 4,096
    assert cmd[cmd.index("--parallel") + 1] == "1" and cmd[cmd.index("-c") + 1] == "4096"
    cmd = command(ours, ours.launches[-1], {("135m", "hf"): hf}, tmp_path / "srv", {"Sluice": sys.executable}, "2")
    assert cmd[cmd.index("--num-kv-blocks") + 1] == "256" and cmd[cmd.index("--max-model-len") + 1] == "2048"
    assert cmd[cmd.index("--quantization") + 1] == "f16" and cmd[cmd.index("--dtype") + 1] == "float32"


@pytest.mark.slow  # SmolLM2's tokenizer (and config)
def test_workload_d_prompts_are_passages_to_copy_with_an_edit(smollm2_dir):
    from transformers import AutoTokenizer

    prompts = edit_prompts(5)
    assert len(set(prompts[:4])) == 4 and prompts[4] == prompts[0]
    assert PASSAGES[0][1] in prompts[0] and PASSAGES[1][1] in prompts[1]  # both kinds among the first two
    w = Workload("D", num_prompts=4, input_len=1, output_len=256, max_concurrency=1, dataset="repetitive")
    w.validate()
    rows = text_prompts(w, AutoTokenizer.from_pretrained(smollm2_dir))
    assert [r[0] for r in rows] == prompts[:4] and all(400 <= n <= 700 and m == 256 for _, n, m in rows)
    assert all(n == len(t) // 4 for t, n, _ in text_prompts(w))  # no tokenizer: a guess from the length
    with pytest.raises(ValueError, match="dataset"):
        Workload(dataset="sharegpt").validate()


def test_spec_summary_from_timings_or_counters():
    def record(out, drafted=None, accepted=None):
        return RequestRecord(10, out, output_tokens=out, ok=True, draft_tokens=drafted, accepted_tokens=accepted)

    s = spec_summary([record(65, 48, 32), record(65, 16, 0)])
    assert (s["source"], s["accepted_tokens"], s["acceptance_rate"]) == ("timings", 32, 0.5)
    assert s["tokens_per_forward"] == pytest.approx(128 / 96)
    counters = {"sluice_spec_decode_num_draft_tokens_total": 64.0, "sluice_spec_decode_num_accepted_tokens_total": 64.0}
    s = spec_summary([record(65), record(65)], counters)
    assert s["source"] == "metrics" and s["tokens_per_forward"] == 2.0
    assert spec_summary([record(65)], {}) == {}


def spec_app(metrics: list[str]) -> web.Application:
    """llama.cpp-like: timings with drafts on the last chunk; and a /metrics page that counts accepted drafts."""

    async def models(request):
        return web.json_response({"data": [{"id": "m"}]})

    async def chat(request):
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for i in range(n):
            await resp.write(b"data: " + orjson.dumps({"choices": [{"delta": {"content": f" t{i}"}}]}) + b"\n\n")
        last = {"choices": [], "usage": {"completion_tokens": n}, "timings": {"draft_n": 8, "draft_n_accepted": 6}}
        await resp.write(b"data: " + orjson.dumps(last) + b"\n\ndata: [DONE]\n\n")
        metrics.append(body["messages"][0]["content"][:20])
        return resp

    async def prometheus(request):
        text = ("# TYPE sluice_spec_decode_num_accepted_tokens_total counter\n"  # as prometheus_client writes it
                f"sluice_spec_decode_num_accepted_tokens_total {6 * len(metrics)}\n"
                "# TYPE sluice_spec_decode_num_accepted_tokens_created gauge\n"
                "sluice_spec_decode_num_accepted_tokens_created 1.7e9\n"
                "# TYPE sluice_spec_decode_num_accepted_tokens_per_pos_total counter\n"
                f'sluice_spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {99 * len(metrics)}\n'
                "# TYPE sluice_spec_decode_accepted_per_step histogram\n"
                f'sluice_spec_decode_accepted_per_step_bucket{{le="+Inf"}} {len(metrics)}\n'
                f"sluice_spec_decode_accepted_per_step_count {len(metrics)}\n"
                f"sluice_spec_decode_accepted_per_step_sum {50 * len(metrics)}\n")
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", prometheus)
    return app


def test_serve_client_reads_draft_figures_of_a_repetitive_run():
    seen: list[str] = []

    async def main():
        runner = web.AppRunner(spec_app(seen))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            w = Workload("D", num_prompts=2, output_len=9, max_concurrency=1, dataset="repetitive")
            return await run_serve(ServeConfig(w, base, "/v1/chat/completions", progress=False, num_warmups=1))
        finally:
            await runner.cleanup()

    result = asyncio.run(main())
    assert result.completed == 2 and seen[1].startswith("Here is a")
    assert result.spec["source"] == "timings" and result.spec["accepted_tokens"] == 12
    assert result.spec["tokens_per_forward"] == pytest.approx(16 / 4)
    # per-position series and histograms stay out of the counters; the warm-up's came before the run began
    assert result.spec["counters"] == {"sluice_spec_decode_num_accepted_tokens_total": 12.0}


def test_report_pairs_formats_per_size_against_the_best_peer_and_d():
    def line(a=None, b=None, c=None, rss=1000.0, d=None, tpf=None, e=None, rss_e=None):
        s = {"rss_mib": rss, "peak_rss_mib": 2 * rss}
        for w, field, v in (("A", "output_tok_s", a), ("B", "tpot_p50_ms", b), ("C", "ttft_p50_ms", c),
                            ("D", "tpot_p50_ms", d), ("E", "ttft_p50_ms", e)):
            if v is not None:
                s[w] = {field: v, "failed": 0, "spec": {"tokens_per_forward": tpf} if w == "D" else {}}
        if e is not None:
            s["E"].update(rss_mib=rss_e, prompt_tokens=2000.0, prefill_tok_s=2000 / e * 1000,
                          prefill_gflop_s=500 / e * 1000)
        return s

    servers = {"360m Sluice fp32": line(200, 30, 1000, 1500, e=4000, rss_e=900),
               "360m llama.cpp F32": line(100, 20, 4000, e=5000, rss_e=600),
               "360m Sluice bf16": line(300, 10, 500, 1200), "360m llama.cpp BF16": line(150, 10, 4000, 1000),
               "360m llama.cpp Q4_1": line(60, 15, 9000, 800, e=10000, rss_e=500),
               "135m Sluice bf16": line(400, 12, 900, d=12.0, tpf=1.0),
               "135m llama.cpp BF16": line(300, 12, 4000, d=11.0),
               "135m Sluice bf16 ngram": line(b=12.6, d=5.0, tpf=2.5),
               "135m llama.cpp BF16 ngram k4": line(b=12, d=6.0),
               "135m llama.cpp BF16 ngram": line(b=12, d=8.0),
               "135m Sluice@0123abcd bf16": line(200, 24, 900, 1100)}
    r = ratios(servers, ["135m", "360m"])
    assert r["360m fp32 / F32"] == {"A": 2.0, "B": 1.5, "C": 0.25, "E": 0.8, "rss": 1.5, "rss_E": 1.5}
    assert r["360m bf16 / BF16"]["A"] == 2.0 and "360m int4 / Q4_1" not in r
    assert r["360m Sluice fp32 A / best llama.cpp"] == {"A": 200 / 150, "best": "llama.cpp BF16"}
    assert r["135m Sluice bf16 / Sluice@0123abcd bf16"]["A"] == 2.0
    d = r["135m D"]
    assert d["D_tpot_off_over_on"] == 12 / 5 and d["D_tokens_per_forward"] == 2.5
    assert d["D_tpot_on_over_llama_best_on"] == 5 / 6 and d["B_tpot_on_over_off"] == pytest.approx(1.05)
    servers["1.7b Sluice bf16 ngram"] = {"skipped": "no flag"}
    meta = {"cpu_flags": ["avx2"], "sizes": ["135m", "360m", "1.7b"], "threads": "2",
            "peak_gflop_s": {"float32": 250.0, "bfloat16": 125.0, "int8": 1000.0}}
    text = table({"meta": meta, "servers": servers, "ratios": ratios(servers, ["135m", "360m", "1.7b"])})
    assert ("| fp32 / F32 | 200.0 / 100.0 | 2.00 | 30.0 / 20.0 | 1.50 | 1000 / 4000 | 0.25 | 4000 / 5000 | 0.80 | "
            "1500 / 1000 | 1.50 | 900 / 600 | 1.50 |") in text
    assert "| bf16 / BF16 | 300.0 / 150.0 | 2.00 | 10.0 / 10.0 | 1.00 | 500 / 4000 | 0.12 | - / - | - |" in text
    # E's prefill: 2,000 tokens in 4 s is 500 tok/s; 125 GFLOP/s of fp32's 250 is half the machine's rate
    assert ("on 2 threads, torch.mm and for int8 torch._int_mm: bfloat16 125 GFLOP/s, float32 250 GFLOP/s, "
            "int8 1000 GOP/s;") in text
    assert "| llama.cpp Q4_1 | 10000 | 2000 | 200 | 50.0 | 5% |" in text  # a quantized format against int8's rate
    assert "| Sluice fp32 | 4000 | 2000 | 500 | 125.0 | 50% |" in text
    assert "| llama.cpp F32 | 5000 | 2000 | 400 | 100.0 | 40% |" in text
    assert "| 360m Sluice fp32 | 200.0 | 30.0 | - | 1000 | - | - | 4000 | 1500 | E 900 | 3000 | 0/0/0/0 |" in text
    assert "A against llama.cpp's best (llama.cpp BF16): fp32 1.33×, bf16 2.00×." in text
    assert "| Sluice bf16 ngram | 5.0 | 2.50 | - | 12.6 |" in text and "D TPOT 2.40× lower" in text
    assert "| 1.7b Sluice bf16 ngram | skipped: no flag |" in text
    assert json.loads(json.dumps(r)) == r  # the results file holds them as they are


def test_rounds_alternate_the_order_and_report_each_lines_median():
    from sluice.service.bench.peers import median_of_rounds, round_order, run_peers

    lines = plan(("360m",), parse_formats("bf16"), ())
    order = round_order(lines, 3)
    names = [line.name for line in lines]
    assert [(line.name, turn) for line, turn in order] == [
        *((n, 0) for n in names), *((n, 1) for n in reversed(names)), *((n, 2) for n in names)]
    assert round_order(lines, 1) == [(line, 0) for line in lines]

    def run(a, tpot, rss, failed=0, ttft_e=4000.0):
        return {"plan": {"p": 1}, "rss_mib": rss, "A": {"output_tok_s": a, "tpot_p50_ms": 1.0, "ttft_p50_ms": 9.0,
                                                        "duration_s": 3.0, "completed": 64, "failed": failed},
                "B": {"output_tok_s": 10.0, "tpot_p50_ms": tpot, "ttft_p50_ms": 5.0, "duration_s": 2.0,
                      "completed": 4, "failed": 0, "spec": {}},
                "E": {"output_tok_s": 4.0, "tpot_p50_ms": 9.0, "ttft_p50_ms": ttft_e, "duration_s": 12.0,
                      "completed": 3, "failed": 0, "rss_mib": rss / 2, "prefill_tok_s": 2e6 / ttft_e}}

    runs = [run(300.0, 11.0, 1000.0), run(250.0, 13.0, 1020.0, failed=1, ttft_e=5000.0),
            run(280.0, 12.5, 990.0, ttft_e=3000.0)]
    merged = median_of_rounds(runs)
    assert merged["E"]["ttft_p50_ms"] == 4000.0 and merged["E"]["rss_mib"] == 500.0  # RSS after E, too
    assert merged["E"]["prefill_tok_s"] == 500.0 and merged["E"]["completed"] == 9
    assert "rss_mib" not in merged["A"]  # figures a round did not measure stay absent
    assert merged["A"]["output_tok_s"] == 280.0 and merged["B"]["tpot_p50_ms"] == 12.5 and merged["rss_mib"] == 1000.0
    assert merged["A"]["failed"] == 1 and merged["A"]["completed"] == 192 and merged["rounds"] == runs
    assert median_of_rounds(runs[:1]) is runs[0]  # one round: as measured
    assert runs[2]["A"]["output_tok_s"] == 280.0 and "rounds" not in runs[2]  # the rounds themselves untouched
    text = table({"meta": {"cpu_flags": [], "sizes": ["360m"], "rounds": 3},
                  "servers": {"360m Sluice bf16": merged}, "ratios": {}})
    assert "the median of 3 rounds" in text and "| 360m Sluice bf16 | 280.0 |" in text
    with pytest.raises(ValueError, match="--resume"):
        run_peers(Path("unused.json"), ("360m",), resume=True, rounds=2)
    with pytest.raises(ValueError, match="at least 1"):
        run_peers(Path("unused.json"), ("360m",), rounds=0)


@pytest.mark.slow  # SmolLM2's tokenizer (and config)
def test_random_checkpoint_of_a_tiny_shape_is_seeded_bf16_with_sharper_attention(tmp_path):
    from sluice.service.bench.shapes import Shape, config_of, random_checkpoint

    shape = Shape(64, 128, 2, 4, 2)
    first = random_checkpoint("llama", shape, tmp_path / "a", name="tiny")
    again = random_checkpoint("llama", shape, tmp_path / "b", name="tiny")
    assert (first.name == "llama-tiny-r2" and (first / "tokenizer.json").is_file()
            and (first / "chat_template.jinja").is_file())
    with safe_open(first / "model.safetensors", "pt") as a, safe_open(again / "model.safetensors", "pt") as b:
        assert "lm_head.weight" not in a.keys()  # tied to the embeddings
        for key in a.keys():
            assert a.get_tensor(key).dtype.is_floating_point and a.get_tensor(key).equal(b.get_tensor(key)), key
        q = a.get_tensor("model.layers.0.self_attn.q_proj.weight")
        up = a.get_tensor("model.layers.0.mlp.up_proj.weight")
        assert str(q.dtype) == "torch.bfloat16" and tuple(q.shape) == (64, 64) and tuple(up.shape) == (128, 64)
        assert 0.015 < up.float().std().item() < 0.025 and 0.08 < q.float().std().item() < 0.12
    config = json.loads((first / "config.json").read_text())
    assert (config["hidden_size"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (64, 2, True)
    assert config_of("llama", "1.7b").rope_parameters["rope_theta"] == 130000.0


def test_cli_estimate_prints_the_plan_and_rejects_unknown_formats(capsys):
    import argparse

    from sluice.service.bench import add_bench_subcommands

    parser = argparse.ArgumentParser()
    add_bench_subcommands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "peers", "--estimate", "--sizes", "360m", "--formats", "int4"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "360m Sluice int4\n360m llama.cpp Q4_1\n" in out and "expected duration" in out
    args = parser.parse_args(["bench", "peers", "--estimate", "--sizes", "360m", "--formats", "int4", "--d-sizes",
                              "none", "--rounds", "2"])
    assert args.func(args) == 0
    out = capsys.readouterr().out  # both rounds, the second reversed, in the plan and in the time
    assert "360m Sluice int4\n360m llama.cpp Q4_1\n360m llama.cpp Q4_1\n360m Sluice int4\n4 server lines" in out
    args = parser.parse_args(["bench", "peers", "--estimate", "--formats", "q8"])
    assert args.func(args) == 2
    for refused in (["--rounds", "0"], ["--rounds", "2", "--resume"]):  # refused as run_peers refuses them
        args = parser.parse_args(["bench", "peers", "--estimate", "--sizes", "360m", "--formats", "int4", *refused])
        assert args.func(args) == 2
        assert "--rounds must be at least 1" in capsys.readouterr().err
    args = parser.parse_args(["bench", "serve", "--dataset-name", "repetitive"])
    assert args.dataset_name == "repetitive"
    assert SCALES["1.7b"].d[1] > 0
