"""Soak under overload: start `sluice serve`, drive it past capacity with a mixed workload and random
disconnects for a bounded time, then check that every request was answered, nothing is left behind and
resident memory stayed flat. `sluice soak --help`; `python -m sluice.service.bench.soak`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from sluice.cpu import resident_bytes

ROOT = Path(__file__).resolve().parents[2]
# Overload by design: few queue slots and sequences, a small KV pool with swap, so that 429s, preemption by
# swap and its fallback to recompute all happen. Flags given with --serve-flags come after and win.
DEFAULT_SERVE_FLAGS = ["--max-queued-requests", "16", "--max-num-seqs", "16", "--scheduling-policy", "priority",
                       "--preemption-mode", "swap"]
STOPS = ["e", " the", "\n", "."]


@dataclass
class Tally:
    """What happened to the requests, and why the failures failed."""

    sent: int = 0
    completed: int = 0
    rejected: int = 0  # 429 with Retry-After, in OpenAI's error shape
    aborted: int = 0  # the client hung up on purpose
    failed: int = 0
    completion_tokens: int = 0
    failures: list[str] = field(default_factory=list)

    def fail(self, why: str) -> None:
        self.failed += 1
        if len(self.failures) < 20:
            self.failures.append(why[:300])


def make_request(rng: random.Random, max_model_len: int, model: str) -> tuple[str, dict, dict]:
    """(path, body, plan): a random mix of short/long, chat/completion, stream, n, priority, stop, disconnect."""
    long = rng.random() < 0.3
    chat = rng.random() < 0.5
    body: dict = {"model": model, "max_tokens": rng.randint(1, max(1, max_model_len // 4)),
                  "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(2**31),
                  "priority": rng.randint(-2, 2), "stream": rng.random() < 0.5}
    if chat:
        words = rng.randint(max_model_len // 16, max_model_len // 8) if long else rng.randint(1, 6)
        body["messages"] = [{"role": "user", "content": " ".join(rng.choice(["Hello", "world", "Paris", "soak"])
                                                                 for _ in range(max(words, 1)))}]
    else:
        length = rng.randint(max_model_len // 4, max_model_len // 2) if long else rng.randint(1, 8)
        body["prompt"] = [rng.randrange(3, 300) for _ in range(max(length, 1))]
    if rng.random() < 0.3:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.3:
        body["stop"] = rng.choice(STOPS)
    if body["stream"] and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    plan = {"disconnect_after": rng.choice([0, 1, 3, 8]) if rng.random() < 0.15 else None}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, plan


def check_choices(body: dict, texts: dict[int, str], reasons: dict[int, str]) -> str | None:
    """Why a finished answer is wrong, or None: every choice ended properly and no stop string leaked."""
    n = body.get("n", 1)
    if sorted(reasons) != list(range(n)):
        return f"choices {sorted(reasons)} for n={n}"
    if any(r not in ("stop", "length") for r in reasons.values()):
        return f"finish reasons {reasons}"
    stop = body.get("stop")
    if stop and any(stop in t for t in texts.values()):
        return f"stop string {stop!r} leaked into {texts}"
    return None


async def one_request(session: aiohttp.ClientSession, url: str, path: str, body: dict, plan: dict,
                      tally: Tally, timeout: float) -> float:
    """Send one request and classify its outcome; returns a back-off delay (after a 429)."""
    tally.sent += 1
    cut = plan["disconnect_after"]

    async def exchange() -> str | float | None:
        async with session.post(url + path, json=body) as r:
            if r.status == 429:
                err = await r.json(content_type=None)
                if set(err.get("error", {})) != {"message", "type", "param", "code"} or "Retry-After" not in r.headers:
                    return f"429 without OpenAI shape or Retry-After: {err}"
                return float(r.headers["Retry-After"])
            if r.status != 200:
                return f"{path} -> {r.status}: {(await r.text())[:200]}"
            if body["stream"]:
                return await read_stream(r, body, cut, tally)
            return answer_problem(await r.json(), body, tally)

    try:
        # A non-streaming request planned to be abandoned is given up on after a short random wait.
        why = await asyncio.wait_for(exchange(), timeout if cut is None or body["stream"] else 0.05 + 0.1 * cut)
    except asyncio.TimeoutError:
        if cut is not None and not body["stream"]:
            tally.aborted += 1  # we gave up on purpose
            return 0.0
        tally.fail(f"timeout after {timeout}s without an answer: {path}")
        return 0.0
    except aiohttp.ClientError as e:
        tally.fail(f"{path}: {type(e).__name__}: {e}")
        return 0.0
    if isinstance(why, float):  # 429: back off for part of Retry-After
        tally.rejected += 1
        return why * (1 + random.random())  # a polite client waits out Retry-After, with jitter
    if why == "aborted":
        tally.aborted += 1
    elif why:
        tally.fail(f"{path}: {why}")
    else:
        tally.completed += 1
    return 0.0


def answer_problem(resp: dict, body: dict, tally: Tally) -> str | None:
    texts = {c["index"]: c.get("text") if "text" in c else c["message"]["content"] for c in resp["choices"]}
    reasons = {c["index"]: c["finish_reason"] for c in resp["choices"]}
    tally.completion_tokens += resp["usage"]["completion_tokens"]
    if resp["usage"]["completion_tokens"] > body["max_tokens"] * body.get("n", 1):
        return f"usage {resp['usage']} beyond max_tokens {body['max_tokens']}"
    return check_choices(body, texts, reasons)


async def read_stream(r: aiohttp.ClientResponse, body: dict, cut: int | None, tally: Tally) -> str | None:
    """Parse the SSE stream strictly; hang up after `cut` events when the plan says so."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    events = 0
    done = False
    async for line in r.content:
        if line == b"\n":
            continue
        if not line.startswith(b"data: ") or done:
            return f"bad SSE line {line[:100]!r}"
        data = line[6:].strip()
        if data == b"[DONE]":
            done = True
            continue
        ev = json.loads(data)
        if "error" in ev:
            return f"error event {ev['error']}"
        if ev.get("usage"):
            tally.completion_tokens += ev["usage"]["completion_tokens"]
        for c in ev["choices"]:
            delta = c.get("text") if "text" in c else c["delta"].get("content", "")
            texts[c["index"]] = texts.get(c["index"], "") + (delta or "")
            if c["finish_reason"]:
                reasons[c["index"]] = c["finish_reason"]
        events += 1
        if cut is not None and events > cut:
            r.close()  # hang up mid-stream
            return "aborted"
    if not done:
        return "stream ended without [DONE]"
    return check_choices(body, texts, reasons)


async def get_json(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url) as r:
        return await r.json()


def idle(h: dict) -> bool:
    """Nothing queued, running, swapped or streaming; every device block and host swap slot free."""
    return (h.get("running") == h.get("waiting") == h.get("swapped") == h.get("open_streams") == 0
            and h.get("kv_free_blocks") == h.get("kv_total_blocks")
            and h.get("kv_free_host_blocks") == h.get("kv_total_host_blocks"))


async def drive(url: str, pid: int | None, args: argparse.Namespace) -> dict:
    """The load phase, RSS sampling alongside, then the after-checks; returns the report."""
    tally = Tally()
    rng = random.Random(args.seed)
    samples: list[tuple[float, int]] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = (await get_json(session, url + "/v1/models"))["data"][0]
        started = time.monotonic()
        deadline = started + args.duration

        def more() -> bool:
            return time.monotonic() < deadline and (not args.max_requests or tally.sent < args.max_requests)

        async def worker() -> None:
            while more():
                path, body, plan = make_request(rng, model["max_model_len"], model["id"])
                delay = await one_request(session, url, path, body, plan, tally, args.request_timeout)
                await asyncio.sleep(delay)

        async def sample() -> None:
            while more():
                if pid:
                    samples.append((time.monotonic() - started, resident_bytes(pid) // 1024))
                await asyncio.sleep(0.5)

        await asyncio.gather(sample(), *(worker() for _ in range(args.concurrency)))
        elapsed = time.monotonic() - started
        health = {}
        settle = time.monotonic() + 30
        while time.monotonic() < settle:  # aborts land within an iteration or two
            health = await get_json(session, url + "/health")
            if idle(health):
                break
            await asyncio.sleep(0.1)
        after = resident_bytes(pid) // 1024 if pid else 0
        final = Tally()
        good = {"model": model["id"], "prompt": "Hello", "max_tokens": 4, "n": 2, "stream": False}
        await one_request(session, url, "/v1/completions", good, {"disconnect_after": None}, final, 60)
    return report(tally, samples, health, final, elapsed, after, args)


def report(tally: Tally, samples, health: dict, final: Tally, elapsed: float, after: int, args) -> dict:
    """The JSON report and the verdict."""
    third = (samples[-1][0] if samples else elapsed) / 3  # thirds of the load phase, not of the final drain
    first = [kib for t, kib in samples if t <= third]
    last = [kib for t, kib in samples if t >= 2 * third]
    mib = {"first_third_max": max(first, default=0) / 1024, "last_third_max": max(last, default=0) / 1024,
           "peak": max((k for _, k in samples), default=0) / 1024, "after": after / 1024,
           "limit_growth": args.max_rss_growth_mib}
    mib["growth"] = mib["last_third_max"] - mib["first_third_max"]
    problems = list(tally.failures)
    if tally.failed:
        problems.insert(0, f"{tally.failed} requests failed")
    if not idle(health):
        problems.append(f"not idle after the run: {health}")
    if final.completed != 1:
        problems.append(f"a good request after the run was not answered: {final.failures}")
    if samples and mib["growth"] > args.max_rss_growth_mib:
        problems.append(f"RSS grew {mib['growth']:.1f} MiB between the first and last third")
    return {"duration_s": round(elapsed, 1), "concurrency": args.concurrency, "sent": tally.sent,
            "completed": tally.completed, "rejected": tally.rejected, "aborted": tally.aborted,
            "failed": tally.failed, "completion_tokens": tally.completion_tokens,
            "requests_per_s": round(tally.sent / max(elapsed, 1e-9), 1),
            "rss_mib": {k: round(v, 1) for k, v in mib.items()}, "rss_samples": len(samples),
            "health_after": health, "problems": problems, "ok": not problems}


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`sluice serve` on a free loopback port; waits until /ready (or fails with the log's tail)."""
    port = free_port()
    cmd = [sys.executable, "-m", "sluice.service.cli", "serve", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(port), *DEFAULT_SERVE_FLAGS, *shlex.split(args.serve_flags)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server not ready after {args.start_timeout}s:\n{log_path.read_text()[-3000:]}")


def run(args: argparse.Namespace) -> dict:
    """Start the server (unless --url), soak it, stop it (SIGTERM must exit 0), write and return the report."""
    log_path = Path(args.output).with_suffix(".server.log")
    proc = None
    url = args.url
    if not url:
        proc, url = start_server(args, log_path)
    try:
        result = asyncio.run(drive(url, proc.pid if proc else args.pid, args))
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    if proc is not None:
        result["server_exit_code"] = proc.returncode
        if proc.returncode != 0:
            result["problems"].append(f"server exited with {proc.returncode} after SIGTERM")
        if "Traceback" in log_path.read_text(errors="replace"):
            result["problems"].append(f"a traceback in the server log {log_path}")
        result["ok"] = not result["problems"]
    Path(args.output).write_text(json.dumps(result, indent=2))
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="Model for the server it starts (default: SmolLM2).")
    p.add_argument("--serve-flags", default="", help="Extra `sluice serve` flags, one string (they win).")
    p.add_argument("--url", default="", help="Soak a running server instead of starting one (no RSS check "
                   "unless --pid).")
    p.add_argument("--pid", type=int, default=0, help="With --url: the server's pid, for the RSS figures.")
    p.add_argument("--duration", type=float, default=180.0, help="Seconds of load.")
    p.add_argument("--max-requests", type=int, default=0, help="Stop after this many requests (0: no limit).")
    p.add_argument("--concurrency", type=int, default=64, help="Clients sending back to back.")
    p.add_argument("--request-timeout", type=float, default=120.0, help="A request unanswered after this fails.")
    p.add_argument("--max-rss-growth-mib", type=float, default=64.0,
                   help="Allowed growth of the server's peak RSS from the first to the last third of the run.")
    p.add_argument("--start-timeout", type=float, default=300.0, help="Seconds to wait for the server's /ready.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="soak.json", help="Where the JSON report goes (the server log next to it).")


def _command(args: argparse.Namespace) -> int:
    result = run(args)
    rss = result["rss_mib"]
    print(f"soak: {result['duration_s']}s, sent {result['sent']}, completed {result['completed']}, "
          f"rejected {result['rejected']} (429), aborted {result['aborted']}, failed {result['failed']}; "
          f"{result['completion_tokens']} tokens")
    h = result["health_after"]
    print(f"after: running {h.get('running')}, waiting {h.get('waiting')}, swapped {h.get('swapped')}, KV blocks "
          f"free {h.get('kv_free_blocks')}/{h.get('kv_total_blocks')}, swap slots free "
          f"{h.get('kv_free_host_blocks')}/{h.get('kv_total_host_blocks')}, preemptions {h.get('preemptions')}")
    print(f"server RSS (MiB): first third peak {rss['first_third_max']}, last third peak {rss['last_third_max']}, "
          f"growth {rss['growth']} (limit {rss['limit_growth']}), after {rss['after']}")
    for p in result["problems"]:
        print("PROBLEM:", p)
    print(("PASS" if result["ok"] else "FAIL") + f" (report: {args.output})")
    return 0 if result["ok"] else 1


def add_soak_subcommand(commands) -> None:
    """`sluice soak`."""
    p = commands.add_parser("soak", help="Soak a server under overload and check it leaks nothing.",
                            description=__doc__)
    add_arguments(p)
    p.set_defaults(func=_command)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sluice.service.bench.soak", description=__doc__)
    add_arguments(p)
    return _command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
