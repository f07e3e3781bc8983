"""Prometheus metrics of one facade (a registry per app: no process-global state).

Load gauges (running / waiting / KV usage / prefix-cache hit rate) are read from the engine's
GetLoad at scrape time; latencies and token counts are observed by the routes as clients see
them.
"""
from __future__ import annotations

import asyncio

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade.generation import RequestTimer

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _live_tasks() -> int:
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:     # no running loop (rendered outside the app)
        return 0


class FacadeMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.engine_up = Gauge("sluice_engine_up", "1 when the engine answered GetLoad at this scrape", registry=r)
        self.running = Gauge("sluice_num_requests_running", "sequences the engine is running", registry=r)
        self.waiting = Gauge("sluice_num_requests_waiting", "sequences waiting in the engine's queue", registry=r)
        self.in_flight = Gauge("sluice_num_requests_in_flight", "client streams open on the engine", registry=r)
        self.kv_usage = Gauge("sluice_kv_cache_usage_ratio", "fraction of KV blocks in use", registry=r)
        self.kv_used = Gauge("sluice_kv_cache_blocks_used", "KV blocks in use", registry=r)
        self.kv_total = Gauge("sluice_kv_cache_blocks_total", "KV blocks in the pool", registry=r)
        self.prefix_hit = Gauge("sluice_prefix_cache_hit_rate", "prefix-cache hit rate", registry=r)
        # Per engine (``--engine`` repeated): the gauges above are the sums over the engines.
        self.engine_state = Gauge("sluice_engine_serving", "1 when the engine is in the routing pool",
                                  ["engine"], registry=r)
        self.engine_running = Gauge("sluice_engine_num_requests_running", "sequences the engine is running",
                                    ["engine"], registry=r)
        self.engine_waiting = Gauge("sluice_engine_num_requests_waiting", "sequences waiting in the engine's queue",
                                    ["engine"], registry=r)
        self.engine_kv_usage = Gauge("sluice_engine_kv_cache_usage_ratio", "fraction of the engine's KV blocks in use",
                                     ["engine"], registry=r)
        self.engine_open = Gauge("sluice_engine_open_streams", "this facade's streams open on the engine",
                                 ["engine"], registry=r)
        self.engine_routed = Gauge("sluice_engine_routed_requests", "requests routed to the engine since start",
                                   ["engine"], registry=r)
        # Speculative decoding: the engine's running totals since start-up, read at scrape time
        # (gauges that only grow while the engine lives; they restart with it).
        self.spec_drafts = Gauge("sluice_spec_decode_drafts", "request-steps that carried draft tokens", registry=r)
        self.spec_draft_tokens = Gauge("sluice_spec_decode_draft_tokens", "draft tokens verified", registry=r)
        self.spec_accepted = Gauge("sluice_spec_decode_accepted_tokens", "draft tokens accepted", registry=r)
        self.spec_accepted_at = Gauge("sluice_spec_decode_accepted_tokens_per_position",
                                      "draft tokens accepted at each draft position (0-based)", ["position"],
                                      registry=r)
        # What clients saw, per served model name (the name a request used: an alias of
        # --served-model-name, or the model's own).
        self.ttft = Histogram("sluice_time_to_first_token_seconds", "request arrival to first token", ["model"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("sluice_inter_token_latency_seconds", "time between generated tokens", ["model"],
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("sluice_e2e_request_latency_seconds", "request arrival to its last byte", ["model"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("sluice_prompt_tokens", "prompt tokens processed", ["model"], registry=r)
        self.generation_tokens = Counter("sluice_generation_tokens", "tokens generated", ["model"], registry=r)
        self.requests = Counter("sluice_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        # The facade process itself (RSS, open fds, CPU) and its event loop's live tasks: what a
        # leak shows in first. Read at scrape time, inside the loop's own thread.
        ProcessCollector(registry=r)
        self.tasks = Gauge("sluice_facade_asyncio_tasks", "asyncio tasks alive in the facade's event loop",
                           registry=r)
        self.tasks.set_function(_live_tasks)

    def set_loads(self, loads: list[tuple[str, pb.GetLoadResponse | None]],
                  routing: list[tuple[str, int, int, bool]]) -> None:
        """Each engine's load (None: it did not answer) and routing counts; the unlabelled
        gauges get the sums over the engines that answered."""
        answered = [load for _, load in loads if load is not None]
        total = pb.GetLoadResponse()
        for load in answered:
            for name in ("num_running", "num_waiting", "num_in_flight", "kv_blocks_used", "kv_blocks_total",
                         "spec_num_drafts", "spec_draft_tokens", "spec_accepted_tokens"):
                setattr(total, name, getattr(total, name) + getattr(load, name))
        if answered:
            total.prefix_cache_hit_rate = sum(x.prefix_cache_hit_rate for x in answered) / len(answered)
            width = max(len(x.spec_accepted_per_position) for x in answered)
            total.spec_accepted_per_position.extend(
                sum(x.spec_accepted_per_position[i] for x in answered if i < len(x.spec_accepted_per_position))
                for i in range(width))
        self.set_load(total if answered else None)
        for address, load in loads:
            self.engine_running.labels(engine=address).set(load.num_running if load else 0)
            self.engine_waiting.labels(engine=address).set(load.num_waiting if load else 0)
            usage = load.kv_blocks_used / load.kv_blocks_total if load and load.kv_blocks_total else 0.0
            self.engine_kv_usage.labels(engine=address).set(usage)
        for address, routed, open_streams, up in routing:
            self.engine_state.labels(engine=address).set(1 if up else 0)
            self.engine_open.labels(engine=address).set(open_streams)
            self.engine_routed.labels(engine=address).set(routed)

    def set_load(self, load: pb.GetLoadResponse | None) -> None:
        if load is None:
            self.engine_up.set(0)
            return
        self.engine_up.set(1)
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.in_flight.set(load.num_in_flight)
        self.kv_used.set(load.kv_blocks_used)
        self.kv_total.set(load.kv_blocks_total)
        self.kv_usage.set(load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0)
        self.prefix_hit.set(load.prefix_cache_hit_rate)
        self.spec_drafts.set(load.spec_num_drafts)
        self.spec_draft_tokens.set(load.spec_draft_tokens)
        self.spec_accepted.set(load.spec_accepted_tokens)
        for position, accepted in enumerate(load.spec_accepted_per_position):
            self.spec_accepted_at.labels(position=str(position)).set(accepted)

    def observe(self, timer: RequestTimer) -> None:
        model = timer.model or "unknown"
        if timer.ttft is not None:
            self.ttft.labels(model=model).observe(timer.ttft)
        itl = self.itl.labels(model=model)
        for gap in timer.gaps:
            itl.observe(gap)
        self.e2e.labels(model=model).observe(timer.elapsed())
        self.prompt_tokens.labels(model=model).inc(timer.prompt_tokens)
        self.generation_tokens.labels(model=model).inc(timer.completion_tokens)

    def count(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
