"""KV cache events over ZMQ in vLLM's wire format (`--kv-events-config`), for prefix-aware routers.

The KV cache manager appends events to a bounded sink during a step (kvcache/events.py); after the step the engine
calls `end_step()`, which takes them as one batch, gives it the next sequence number and puts it on a bounded
queue: that is all the engine thread does. The publisher thread encodes each batch with msgpack and sends it on a
PUB socket as three frames, `[topic, sequence (8 bytes, big-endian), msgpack([ts, [event, ...], dp_rank])]`, the
sequence counting from 0, and keeps the last `buffer_steps` payloads for the optional ROUTER replay socket: a
client sends a start sequence (8 bytes, big-endian) and gets `[sequence, payload]` for every buffered batch from
there, then `[-1 (8 bytes, signed), b""]`.

A batch that finds the queue full is dropped, never waited for: its sequence number is spent, so a subscriber sees
the gap (and the replay cannot fill it), and `sluice_kv_events_dropped_total` counts its events.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

from sluice.kvcache.events import KVCacheEvent, KVEventSink

logger = logging.getLogger("sluice.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker, as vLLM sends it


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, field for field (`--kv-events-config` takes it as JSON)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; unset: "zmq" when enabled
    endpoint: str = "tcp://*:5557"  # a wildcard host (or ipc://, inproc://) binds; a named host is connected to
    replay_endpoint: str | None = None  # ROUTER socket answering replay requests (always bound)
    buffer_steps: int = 10_000  # batches kept for the replay
    hwm: int = 100_000  # the PUB socket's send high-water mark, in messages
    max_queue_size: int = 100_000  # batches waiting for the publisher thread (and events of one step)
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig | None:
        """The config a `--kv-events-config` value asks for; None when it turns events off. ValueError names
        what is wrong."""
        if not text.strip():
            return None
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--kv-events-config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"--kv-events-config has unknown fields {unknown}; known: {sorted(known)}")
        for name, value in raw.items():
            if name == "enable_kv_cache_events":
                ok = isinstance(value, bool)
            elif name in ("buffer_steps", "hwm", "max_queue_size"):
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            elif name in ("publisher", "replay_endpoint"):
                ok = value is None or isinstance(value, str)
            else:
                ok = isinstance(value, str)
            if not ok:
                raise ValueError(f"--kv-events-config field {name} has a bad value {value!r}")
        cfg = cls(**raw)
        publisher = cfg.publisher or ("zmq" if cfg.enable_kv_cache_events else "null")
        if publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config publisher must be 'zmq' or 'null', not {publisher!r}")
        if not cfg.enable_kv_cache_events or publisher == "null":
            return None
        if not cfg.endpoint:
            raise ValueError("--kv-events-config needs an endpoint")
        return cfg


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address (or a local transport) is bound, any other is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """The sink the KV cache manager fills, and the thread that publishes it. Call end_step() after every engine
    step and close() once at the end."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0,
                 on_drop: Callable[[int], None] | None = None) -> None:
        try:
            import msgpack
            import zmq
        except ImportError as e:
            raise ValueError(f"--kv-events-config needs pyzmq and msgpack ({e.name} is missing): "
                             "pip install 'sluice[kv-events]'") from None
        self.config = config
        self.sink = KVEventSink(config.max_queue_size)
        self.num_dropped_events = 0
        self._on_drop = on_drop
        self._rank = data_parallel_rank
        self._next_seq = 0  # assigned on the engine thread, so a dropped batch leaves a gap
        self._sink_dropped = 0
        self._queue: queue.Queue[tuple[int, float, list[KVCacheEvent]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)  # an exiting server does not wait for slow subscribers
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(config.hwm)
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise ValueError(f"--kv-events-config: cannot open {config.endpoint} / {config.replay_endpoint}: {e}") \
                from None
        self._running = True
        self._thread = threading.Thread(target=self._run, name="sluice-kv-events", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # an exiting server sends what is queued and closes its sockets
        logger.info("KV cache events on %s (topic %r%s)", config.endpoint, config.topic,
                    f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    # --- the engine thread ------------------------------------------------------------------------

    def end_step(self) -> None:
        """Hand the step's events to the publisher thread as one batch: a non-blocking put, nothing more."""
        if self.sink.num_dropped != self._sink_dropped:  # the step made more events than the sink holds
            self._drop(self.sink.num_dropped - self._sink_dropped)
            self._sink_dropped = self.sink.num_dropped
            self._next_seq += 1  # what the batch lacks shows as a gap
        if not self.sink.events:
            return
        events = self.sink.drain()
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self._drop(len(events))

    def _drop(self, n: int) -> None:
        if not self.num_dropped_events:
            logger.warning("KV events dropped: the publisher falls behind (its queue holds %d batches)",
                           self.config.max_queue_size)
        self.num_dropped_events += n
        if self._on_drop is not None:
            self._on_drop(n)

    def close(self, timeout: float = 1.0) -> None:
        """Publish what is queued (within `timeout`), stop the thread and close the sockets."""
        if not self._running:
            return
        self._running = False
        atexit.unregister(self.close)
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._ctx.destroy(linger=0)

    # --- the publisher thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    logger.exception("KV events replay failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, ts, events = item
            try:
                payload = self._pack([ts, [e.wire() for e in events], self._rank])
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:
                logger.exception("publishing KV events batch %d failed", seq)

    def _serve_replay(self) -> None:
        """Answer one replay request: [identity, (b"",) start] from a REQ or DEALER client, replied to in the
        same envelope."""
        frames = self._replay.recv_multipart()
        if len(frames) < 2 or len(frames[-1]) != 8:
            logger.warning("bad KV events replay request (%d frames)", len(frames))
            return
        envelope, start = frames[:-1], int.from_bytes(frames[-1], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((*envelope, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((*envelope, END_SEQ, b""))
