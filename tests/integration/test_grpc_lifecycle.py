"""The engine's life cycle, on an engine process of its own (the tiny random-weight SmolLM2,
``--mode interactive`` with ``max_num_sequence=2;max_waiting=1``, ``--grace 3``): UNAVAILABLE and health NOT_SERVING while
the model loads; RESOURCE_EXHAUSTED when the waiting queue is full; on SIGTERM health goes
NOT_SERVING, new requests get UNAVAILABLE, a short in-flight request finishes, a long one is
aborted when the grace period ends, and the process exits with code 0."""
from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from sluice.engine.client import Choice, EngineClient, EngineRpcError
from tests.integration.conftest import launch_engine, wait_for_idle, wait_serving

GRACE_S = 3.0
# Long enough to outlive the grace period many times over: the tiny model runs a step in 1-5 ms,
# so 8000 tokens take 8 s or more.
LONG = dict(max_tokens=8000, ignore_eos=True, temperature=0.0)


# The tiny model loads in a fraction of a second and the packaged MiniLM beside it in about one:
# the observer must not sit out gRPC's default reconnect backoff (1 s and growing) after finding
# the port still closed.
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 20), ("grpc.min_reconnect_backoff_ms", 20),
                  ("grpc.max_reconnect_backoff_ms", 50)]


def _observe_loading(engine, timeout: float = 120.0) -> dict:
    """Until health answers SERVING: the first NOT_SERVING answer, and what Generate says then."""
    seen: dict = {}
    deadline = time.monotonic() + timeout
    with EngineClient(engine.target, timeout=5.0, options=FAST_RECONNECT) as client:
        while time.monotonic() < deadline and "error" not in seen and engine.proc.poll() is None:
            try:
                status = client.health()
            except EngineRpcError:   # not listening yet
                time.sleep(0.05)
                continue
            if status == "SERVING":
                break
            seen["health"] = status
            try:
                client.generate("too early", max_tokens=1).collect()
            except EngineRpcError as err:
                seen["error"] = err
    return seen


@pytest.fixture(scope="module")
def small_engine(tmp_path_factory, tiny_smollm2):
    engine = launch_engine(tmp_path_factory.mktemp("small") / "engine.log", "--mode", "interactive",
                           "--overrides", "max_num_sequence=2;max_waiting=1;max_total_seq_length=8192",
                           "--grace", str(GRACE_S), model=tiny_smollm2)
    try:
        loading = _observe_loading(engine)
        wait_serving(engine)
        yield engine, loading
    finally:
        engine.stop()


def test_unavailable_and_not_serving_while_loading(small_engine) -> None:
    _, loading = small_engine
    assert loading.get("health") == "NOT_SERVING"
    err = loading["error"]
    assert err.code == grpc.StatusCode.UNAVAILABLE and "loading" in err.message


def test_resource_exhausted_when_the_waiting_queue_is_full(small_engine) -> None:
    engine, _ = small_engine
    with EngineClient(engine.target, timeout=120.0) as client:
        running = []
        for i in range(2):    # one at a time: with max_waiting=1 two queued at once would not fit
            running.append(client.generate(f"Runner {i}:", **LONG))
            next(running[-1])                    # scheduled: it holds one of the two sequence slots
        waiting = client.generate("Waiter:", **LONG)
        deadline = time.monotonic() + 30
        while client.load().num_waiting != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.load().num_waiting == 1
        with pytest.raises(EngineRpcError) as info:
            client.generate("One too many:", max_tokens=2).collect()
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "waiting queue is full" in info.value.message
        for s in (*running, waiting):
            s.cancel()
        load = wait_for_idle(client)
        assert (load.num_running, load.num_waiting, load.kv_blocks_used) == (0, 0, 0)


def _consume(stream, out: dict, key: str) -> None:
    choice = Choice(0)
    try:
        choice.add(next(stream))
        out[key + "_started"] = True
        for d in stream:
            choice.add(d)
    except EngineRpcError as err:
        out[key + "_error"] = err
    out[key] = choice


def test_sigterm_drains_in_flight_requests_and_exits_zero(small_engine) -> None:
    engine, _ = small_engine
    results: dict = {}
    with EngineClient(engine.target, timeout=120.0) as client:
        assert client.health() == "SERVING" and client.health("sluice.v1.EngineService") == "SERVING"
        threads = []
        for key, kwargs in (("long", LONG), ("short", dict(max_tokens=4, ignore_eos=True, temperature=0.0))):
            stream = client.generate(f"The {key} one:", **kwargs)
            threads.append(threading.Thread(target=_consume, args=(stream, results, key)))
            threads[-1].start()
            deadline = time.monotonic() + 60   # scheduled before the next is sent (max_waiting=1)
            while f"{key}_started" not in results and time.monotonic() < deadline:
                time.sleep(0.01)
            assert f"{key}_started" in results, results
        sent = time.monotonic()
        engine.proc.send_signal(signal.SIGTERM)

        deadline = sent + 3.0
        while client.health() != "NOT_SERVING" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.health() == "NOT_SERVING"
        with pytest.raises(EngineRpcError) as info:
            client.generate("after the signal", max_tokens=1).collect()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.message
        for t in threads:
            t.join(GRACE_S + 30)

    assert engine.proc.wait(GRACE_S + 30) == 0
    assert time.monotonic() - sent >= GRACE_S - 0.5          # the long request had its grace period
    assert results["short"].finish_reason == "length" and len(results["short"].token_ids) == 4
    assert results["long"].finish_reason == "abort" and 0 < len(results["long"].token_ids) < 8000
    assert "long_error" not in results and "short_error" not in results
