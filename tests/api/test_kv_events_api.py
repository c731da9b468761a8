"""KV cache events in vLLM's wire format (`--kv-events-config`): the publisher's framing, sequence, replay and
overflow, then `sluice serve` read by a subscriber written from vLLM's example
(examples/online_serving/kv_events_subscriber.py): a SUB socket on the topic, msgpack batches, the sequence
checked, the prompt's blocks rebuilt from BlockStored, the salt in extra_keys, evictions and the replay from 0."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass

import pytest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from sluice.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from sluice.service.bench.soak import free_port  # noqa: E402
from sluice.service.engine.kv_events import END_SEQ, KVEventPublisher, KVEventsConfig  # noqa: E402

BLOCK = 16  # tests/support/server.py runs --block-size 16


# ---- the subscriber's side: vLLM's event structs (array-like, tagged), decoded from plain msgpack ------------

@dataclass
class Stored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list | None = None


@dataclass
class Removed:
    block_hashes: list[int]
    medium: str | None


@dataclass
class Cleared:
    pass


TAGS = {"BlockStored": Stored, "BlockRemoved": Removed, "AllBlocksCleared": Cleared}


def decode_batch(payload: bytes) -> tuple[float, list, int | None]:
    """[ts, events, data_parallel_rank], each event [tag, *fields] as vLLM's msgspec decoder reads it."""
    ts, events, *rank = msgpack.unpackb(payload, raw=False)
    return ts, [TAGS[e[0]](*e[1:]) for e in events], rank[0] if rank else None


class Subscriber:
    """A SUB socket on the events' topic that checks the sequence, and a DEALER for the replay."""

    def __init__(self, ctx, pub: str, replay: str | None, topic: str):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.connect(pub)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.topic = topic.encode()
        self.replay_addr, self.ctx = replay, ctx
        self.batches: dict[int, bytes] = {}
        self.last_seq = -1
        self.gaps_allowed = False

    def poll(self, timeout_s: float) -> int:
        """Take what arrives within `timeout_s`; returns how many batches came."""
        n, deadline = 0, time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sub.poll(int(left * 1000)):
                break
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic.startswith(self.topic) and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            if seq in self.batches:  # already fetched through the replay: the same bytes
                assert self.batches[seq] == payload
                continue
            assert self.gaps_allowed or self.last_seq < 0 or seq == self.last_seq + 1, f"gap: {self.last_seq} -> {seq}"
            self.last_seq, self.batches[seq] = seq, payload
            n += 1
        return n

    def wait_for(self, check, timeout_s: float = 30.0):
        """Poll until check(events so far) is truthy; a while without it, catch up through the replay (what a
        slow-joining SUB socket missed before its subscription took effect)."""
        deadline, catch_up = time.monotonic() + timeout_s, time.monotonic() + 3
        while True:
            found = check(self.events())
            if found or time.monotonic() > deadline:
                return found
            self.poll(0.2)
            if self.replay_addr and time.monotonic() > catch_up:
                for seq, payload in self.replay(0):
                    self.batches.setdefault(seq, payload)
                self.last_seq, catch_up = max(self.batches, default=-1), time.monotonic() + 3

    def events(self) -> list:
        return [e for seq in sorted(self.batches) for e in decode_batch(self.batches[seq])[1]]

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_addr)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        try:
            while dealer.poll(10_000):
                empty, seq_bytes, payload = dealer.recv_multipart()
                assert empty == b""
                if seq_bytes == END_SEQ:
                    assert payload == b""
                    return got
                got.append((int.from_bytes(seq_bytes, "big"), payload))
            raise AssertionError("the replay never ended")
        finally:
            dealer.close(linger=0)


# ---- the publisher alone -----------------------------------------------------------------------------------------

def test_config_is_vllms_json_and_refuses_mistakes():
    assert KVEventsConfig.parse("") is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false}') is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "kv@p@m", "replay_endpoint": "tcp://*:1"}')
    assert (cfg.endpoint, cfg.topic, cfg.buffer_steps, cfg.hwm, cfg.replay_endpoint) == (
        "tcp://*:5557", "kv@p@m", 10_000, 100_000, "tcp://*:1")
    for bad, words in (("{", "not valid JSON"), ("[1]", "JSON object"), ('{"enable": true}', "unknown fields"),
                       ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
                       ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm"),
                       ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher")):
        with pytest.raises(ValueError, match=words):
            KVEventsConfig.parse(bad)


def test_frames_sequence_replay_and_a_dropped_batch_leaves_a_gap():
    port, replay_port = free_port(), free_port()
    cfg = KVEventsConfig(True, "zmq", f"tcp://*:{port}", f"tcp://*:{replay_port}", buffer_steps=3,
                         max_queue_size=1, topic="kv@pod@m")
    drops = []
    pub = KVEventPublisher(cfg, on_drop=drops.append)
    ctx = zmq.Context()
    try:
        sub = Subscriber(ctx, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", "kv@")
        time.sleep(0.3)  # the slow joiner: the subscription must reach the publisher first
        pub.end_step()  # nothing happened: no batch, no sequence number spent
        pub.sink.append(BlockStored([1], None, list(range(16)), 16, None, "GPU", None))
        pub.end_step()
        assert sub.poll(2.0) == 1 and list(sub.batches) == [0]
        ts, events, rank = decode_batch(sub.batches[0])
        assert rank == 0 and abs(ts - time.time()) < 5
        assert events == [Stored([1], None, list(range(16)), 16, None, "GPU", None)]

        release, pack = threading.Event(), pub._pack
        pub._pack = lambda obj: release.wait(10) and pack(obj)  # the publisher thread falls behind

        def step(*hashes):
            pub.sink.append(BlockRemoved(list(hashes), "GPU"))
            pub.end_step()

        step(1)  # seq 1: taken by the thread, which stalls on it
        for _ in range(200):
            if pub._queue.empty():
                break
            time.sleep(0.01)
        step(2)  # seq 2: fills the queue
        t0 = time.perf_counter()
        step(3, 4)  # seq 3: dropped at once, never waited for
        assert time.perf_counter() - t0 < 0.5 and drops == [1] and pub.num_dropped_events == 1  # one event
        release.set()
        for _ in range(200):
            if pub._queue.empty():
                break
            time.sleep(0.01)
        step(5)  # seq 4
        sub.gaps_allowed = True  # the gap is what this test is about
        deadline = time.monotonic() + 5
        while 4 not in sub.batches and time.monotonic() < deadline:
            sub.poll(0.2)
        assert sorted(sub.batches) == [0, 1, 2, 4]  # the gap tells the subscriber it missed batch 3
        replayed = sub.replay(0)
        assert [s for s, _ in replayed] == [1, 2, 4]  # buffer_steps=3: batch 0 is gone
        assert all(sub.batches[s] == p for s, p in replayed)
        assert sub.replay(10**6) == []
    finally:
        pub.close()
        ctx.destroy(linger=0)


def test_a_named_host_is_connected_to_not_bound():
    port = free_port()
    ctx = zmq.Context()
    collector = ctx.socket(zmq.SUB)  # a central collector binds; each replica's publisher connects (llm-d's mode)
    collector.bind(f"tcp://127.0.0.1:{port}")
    collector.setsockopt(zmq.SUBSCRIBE, b"")
    pub = KVEventPublisher(KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{port}", topic="t"))
    try:
        deadline = time.monotonic() + 10
        while not collector.poll(100):
            assert time.monotonic() < deadline, "nothing reached the collector"
            pub.sink.append(AllBlocksCleared())
            pub.end_step()
        topic, _, payload = collector.recv_multipart()
        assert topic == b"t" and decode_batch(payload)[1] == [Cleared()]
    finally:
        pub.close()
        ctx.destroy(linger=0)


# ---- through `sluice serve` -------------------------------------------------------------------------------------

def complete(url: str, prompt: list[int], **extra) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def chain(stored: list[Stored], tokens: list[int]) -> list[Stored] | None:
    """The BlockStored events that together hold `tokens` (whole blocks, from the first), each the parent of the
    next; None while they have not all arrived."""
    want, got, parent = len(tokens) // BLOCK, [], None
    for ev in stored:
        n = len(ev.block_hashes)
        start = sum(len(e.block_hashes) for e in got)
        if ev.parent_block_hash == parent and ev.token_ids == tokens[start * BLOCK:(start + n) * BLOCK]:
            got.append(ev)
            parent = ev.block_hashes[-1]
            if start + n == want:
                return got
    return None


def test_a_subscriber_rebuilds_prompts_sees_salt_evictions_and_replays(model_dir, tmp_path):
    from tests.support.server import Server

    pub_port, replay_port = free_port(), free_port()
    topic = "kv@10.0.0.7@tiny"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub_port}",
              "topic": topic, "replay_endpoint": f"tcp://*:{replay_port}", "buffer_steps": 10_000}
    # 8 blocks of 16 tokens: the third prompt below needs 7, so it must evict what the first two left cached.
    srv = Server(model_dir, tmp_path, "--num-kv-blocks", "8", "--kv-events-config", json.dumps(config)).wait_ready()
    ctx = zmq.Context()
    try:
        sub = Subscriber(ctx, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", "kv@")
        time.sleep(0.5)  # the slow joiner; whatever it misses, the replay below still has
        prompt = [(7 * i) % 300 + 5 for i in range(40)]  # 2 full blocks and 8 tokens

        def stored_events(evs):
            return [e for e in evs if isinstance(e, Stored)]

        complete(srv.url, prompt)
        plain = sub.wait_for(lambda evs: chain(stored_events(evs), prompt))
        assert plain, f"the prompt's blocks never arrived: {sub.events()}"
        assert [t for e in plain for t in e.token_ids] == prompt[:32]  # the prompt's full blocks, in order
        assert all(e.block_size == BLOCK and e.medium == "GPU" and e.lora_id is None for e in plain)
        assert plain[0].parent_block_hash is None
        plain_hashes = [h for e in plain for h in e.block_hashes]
        assert all(0 <= h < 2**64 for h in plain_hashes)

        complete(srv.url, prompt, cache_salt="tenant-a")
        salted = sub.wait_for(lambda evs: [e for e in stored_events(evs) if e.extra_keys
                                           and e.extra_keys[0] == ["tenant-a"]])
        assert salted, f"no BlockStored carries the salt: {sub.events()}"
        assert salted[0].parent_block_hash is None and salted[0].token_ids[:BLOCK] == prompt[:BLOCK]
        salted_hashes = {h for e in stored_events(sub.events()) if e.extra_keys for h in e.block_hashes}
        assert not salted_hashes & set(plain_hashes)  # one tenant's blocks never match another's

        stored_before = {h for e in stored_events(sub.events()) for h in e.block_hashes}
        other = [(11 * i) % 300 + 3 for i in range(100)]
        complete(srv.url, other)
        removed = sub.wait_for(lambda evs: [h for e in evs if isinstance(e, Removed) for h in e.block_hashes])
        assert removed, f"nothing was evicted: {sub.events()}"
        assert set(removed) <= stored_before  # only what was reported stored is reported removed
        assert sub.wait_for(lambda evs: chain(stored_events(evs), other))

        sub.poll(0.5)
        replayed = sub.replay(0)
        seqs = [s for s, _ in replayed]
        assert seqs == list(range(len(seqs))) and seqs[-1] >= max(sub.batches)  # consecutive from 0
        assert all(sub.batches[s] == p for s, p in replayed if s in sub.batches)  # the same bytes as live
        assert [e for _, p in replayed for e in decode_batch(p)[1]][:len(plain)] == plain  # the first events
    finally:
        ctx.destroy(linger=0)
        code = srv.stop()
    assert code == 0 and "Traceback" not in srv.log(), srv.log()[-3000:]
