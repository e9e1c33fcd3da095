"""Prometheus metrics of the rollout server (``GET /metrics``).

Each app has its own ``CollectorRegistry`` (several servers, or tests, in one process never
share or collide on the global one). Two kinds of figures:

- **Counters** the server keeps itself, as requests end: requests by finish reason, generated
  / draft / accepted tokens, requests aborted because their client disconnected, and error
  responses by status code. They only go up, so
  Prometheus' ``rate()`` gives tokens per second and the acceptance rate over any window.
- **Gauges** read from the engine at scrape time, on the engine thread between two steps
  (:func:`read_engine`, through ``AsyncSpecEngine.run_in_engine``): running and waiting
  requests, KV blocks in use, the weight version, and ``engine.stats`` of the current busy
  span (or the last one when idle): mean accepted length, acceptance rate per draft
  position and generated tokens per second.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from specengine.engine import SpecEngine
from specengine.outputs import FINISH_REASONS, GenerationOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine state a scrape shows, read in one go on the engine thread."""

    weight_version: int
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_in_use: int
    draft_kv_blocks_total: int
    draft_kv_blocks_in_use: int
    mean_accepted_length: float
    acceptance_rate_per_position: tuple[float, ...]
    tokens_per_second: float


def read_engine(engine: SpecEngine) -> EngineSnapshot:
    """Snapshot ``engine``; call it on the engine thread (``run_in_engine``)."""
    stats = engine.stats
    kv = engine.kv_cache
    draft_kv = getattr(engine.drafter, "kv_cache", None)  # EAGLE-3 / small-LM drafters
    return EngineSnapshot(
        weight_version=engine.weight_version,
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting),
        kv_blocks_total=kv.num_blocks,
        kv_blocks_in_use=kv.num_blocks - kv.num_free_blocks,
        draft_kv_blocks_total=draft_kv.num_blocks if draft_kv is not None else 0,
        draft_kv_blocks_in_use=(draft_kv.num_blocks - draft_kv.num_free_blocks
                                if draft_kv is not None else 0),
        mean_accepted_length=stats.mean_accepted_length,
        acceptance_rate_per_position=stats.acceptance_rate_per_position,
        tokens_per_second=stats.tokens_per_second,
    )


class ServerMetrics:
    """The collectors of one app, in their own registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "specengine_"
        self.requests = Counter(p + "requests", "Requests that ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.generated_tokens = Counter(p + "generated_tokens", "Tokens generated",
                                        registry=r)
        self.draft_tokens = Counter(p + "draft_tokens", "Draft tokens proposed for verify",
                                    registry=r)
        self.accepted_tokens = Counter(p + "accepted_draft_tokens",
                                       "Draft tokens the policy accepted", registry=r)
        self.disconnects = Counter(p + "client_disconnects", "Requests aborted because "
                                   "their client went away before the end", registry=r)
        self.errors = Counter(p + "http_errors", "Error responses, by status code",
                              ["status_code"], registry=r)
        self.unfinished = Gauge(p + "num_requests_unfinished",
                                "Requests the server holds (queued for the engine or in it)",
                                registry=r)
        self.running = Gauge(p + "num_requests_running", "Sequences in the running batch",
                             registry=r)
        self.waiting = Gauge(p + "num_requests_waiting",
                             "Sequences waiting for prefill (new or preempted)", registry=r)
        self.paused_waiting = Gauge(p + "num_requests_paused", "Requests waiting for "
                                    "/continue_generation (generation paused)", registry=r)
        self.weight_version = Gauge(p + "weight_version", "Version of the engine's weights",
                                    registry=r)
        self.kv_total = Gauge(p + "kv_blocks_total", "KV cache blocks", ["cache"], registry=r)
        self.kv_in_use = Gauge(p + "kv_blocks_in_use", "KV cache blocks held by sequences",
                               ["cache"], registry=r)
        self.mean_accepted = Gauge(
            p + "mean_accepted_length", "Tokens kept per sequence per verify step (current "
            "or last busy span)", registry=r)
        self.acceptance = Gauge(
            p + "acceptance_rate", "Accepted / proposed drafts at each draft position "
            "(current or last busy span)", ["position"], registry=r)
        self.tokens_per_second = Gauge(
            p + "generation_tokens_per_second", "Generated tokens per second of the current "
            "or last busy span", registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)  # exported as 0 from the start

    def observe_finished(self, out: GenerationOutput) -> None:
        """Count a request that ended (its handler calls this once)."""
        self.requests.labels(finish_reason=out.finish_reason).inc()
        self.generated_tokens.inc(len(out.token_ids))
        self.draft_tokens.inc(out.num_draft_tokens)
        self.accepted_tokens.inc(out.num_accepted_tokens)

    def observe_error(self, status_code: int) -> None:
        self.errors.labels(status_code=str(status_code)).inc()

    def render(self, snap: EngineSnapshot, num_unfinished: int) -> bytes:
        """The Prometheus text exposition with the gauges set from ``snap``."""
        self.unfinished.set(num_unfinished)
        self.running.set(snap.num_running)
        self.waiting.set(snap.num_waiting)
        self.weight_version.set(snap.weight_version)
        self.kv_total.labels(cache="target").set(snap.kv_blocks_total)
        self.kv_in_use.labels(cache="target").set(snap.kv_blocks_in_use)
        if snap.draft_kv_blocks_total:
            self.kv_total.labels(cache="draft").set(snap.draft_kv_blocks_total)
            self.kv_in_use.labels(cache="draft").set(snap.draft_kv_blocks_in_use)
        self.mean_accepted.set(snap.mean_accepted_length)
        self.acceptance.clear()  # positions of an earlier, deeper k must not linger
        for j, rate in enumerate(snap.acceptance_rate_per_position):
            self.acceptance.labels(position=str(j)).set(rate)
        self.tokens_per_second.set(snap.tokens_per_second)
        return generate_latest(self.registry)


__all__ = ["CONTENT_TYPE", "EngineSnapshot", "ServerMetrics", "read_engine"]
