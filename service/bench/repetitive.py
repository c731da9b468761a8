"""Workload D's prompts: return a long passage with small edits, as code-editing and extraction replies do.

Most of such a reply copies its prompt, which is what n-gram speculation (proposals looked up in the request's
own text) turns into fewer forward passes. Two passages of a few hundred tokens, a Python module and a JSON
document, each with a few edit instructions; request i takes edit i of passage i in turn.
"""

from __future__ import annotations

CODE = '''import json
import time
from dataclasses import dataclass, field


@dataclass
class RetryPolicy:
    attempts: int = 3
    backoff_s: float = 0.5
    retry_on: tuple[int, ...] = (429, 500, 502, 503)


@dataclass
class Client:
    base_url: str
    timeout_s: float = 30.0
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    sent: int = 0

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + "/" + path.lstrip("/")

    def parse_row(self, line: str) -> dict:
        record = json.loads(line)
        record["received_at"] = time.time()
        if "id" not in record:
            raise ValueError("record without an id")
        return record

    def fetch(self, session, path: str) -> list[dict]:
        delay = self.policy.backoff_s
        for attempt in range(self.policy.attempts):
            self.sent += 1
            response = session.get(self.url(path), timeout=self.timeout_s)
            if response.status_code not in self.policy.retry_on:
                response.raise_for_status()
                return [self.parse_row(line) for line in response.text.splitlines() if line]
            time.sleep(delay)
            delay *= 2
        raise TimeoutError(f"{path}: no answer after {self.policy.attempts} attempts")


def summarize(records: list[dict]) -> dict:
    by_kind: dict[str, int] = {}
    for record in records:
        by_kind[record.get("kind", "unknown")] = by_kind.get(record.get("kind", "unknown"), 0) + 1
    return {"count": len(records), "by_kind": by_kind}
'''

DOCUMENT = '''{
  "service": "inventory",
  "version": "2.4.1",
  "region": "eu-west-1",
  "owners": ["platform-team", "storage-team"],
  "limits": {"requests_per_minute": 1200, "burst": 200, "max_body_bytes": 1048576},
  "endpoints": [
    {"path": "/items", "method": "GET", "auth": "token", "cache_s": 30, "timeout_ms": 800},
    {"path": "/items", "method": "POST", "auth": "token", "cache_s": 0, "timeout_ms": 1500},
    {"path": "/items/{id}", "method": "GET", "auth": "token", "cache_s": 60, "timeout_ms": 800},
    {"path": "/items/{id}", "method": "DELETE", "auth": "admin", "cache_s": 0, "timeout_ms": 1500},
    {"path": "/health", "method": "GET", "auth": "none", "cache_s": 0, "timeout_ms": 200}
  ],
  "database": {
    "engine": "postgres",
    "host": "db.internal.example.com",
    "port": 5432,
    "pool": {"min": 4, "max": 32, "idle_timeout_s": 300},
    "replicas": [
      {"host": "db-replica-1.internal.example.com", "port": 5432, "weight": 2},
      {"host": "db-replica-2.internal.example.com", "port": 5432, "weight": 1}
    ]
  },
  "alerts": [
    {"name": "HighErrorRate", "expr": "error_ratio > 0.05", "for": "5m", "severity": "page"},
    {"name": "SlowRequests", "expr": "p99_latency_ms > 1200", "for": "10m", "severity": "ticket"},
    {"name": "PoolExhausted", "expr": "pool_in_use / pool_max > 0.9", "for": "2m", "severity": "page"}
  ]
}
'''

PASSAGES = (
    ("Python code", CODE, ("the method parse_row is renamed to parse_record everywhere",
                           "the default timeout_s is 60.0 instead of 30.0 and attempts is 5")),
    ("JSON document", DOCUMENT, ("the version is 2.5.0 and the region is eu-central-1",
                                 "every timeout_ms of 800 becomes 1000")),
)


def edit_prompts(n: int) -> list[str]:
    """`n` prompts, each asking for one passage back with one edit; cycles through every (passage, edit)."""
    pairs = [(kind, text, edit) for kind, text, edits in PASSAGES for edit in edits]
    # interleave passages so that any n >= 2 sees both kinds
    pairs = [pairs[i] for i in (0, 2, 1, 3)] if len(pairs) == 4 else pairs
    out = []
    for i in range(n):
        kind, text, edit = pairs[i % len(pairs)]
        out.append(f"Here is a {kind}. Return it in full, exactly as it is, except that {edit}. "
                   f"Reply with the {kind} only, no explanation.\n\n{text}")
    return out
