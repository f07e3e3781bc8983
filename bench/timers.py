"""Wall-clock timers for the parts of an engine step, by wrapping live callables (the engine is
not modified). Shared by ``quant.py``'s per-format step split and ``step.py``'s phases; only
calls made while ``StepTimers.active`` is set are counted. ``best_us``: a kernel call's best time,
for the per-call benchmarks (``kquant.py``, ``blockq.py``, ``attention.py``)."""
from __future__ import annotations

import time
from collections import defaultdict


def best_us(fn, budget_s: float = 0.3) -> float:
    """The best of repeated ``fn()`` calls over about ``budget_s`` seconds (after one untimed), in µs."""
    fn()
    best, end = float("inf"), time.perf_counter() + budget_s
    while True:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > end:
            return best * 1e6


class StepTimers:
    """Seconds per part, summed over the calls made while ``active``."""

    def __init__(self) -> None:
        self.total = defaultdict(float)
        self.active = False

    def wrap(self, obj, attr: str, part: str) -> None:
        """Replace ``obj.attr`` (a method, or a class's classmethod) by a timed call of it."""
        inner = getattr(obj, attr)

        def timed(*args, **kwargs):
            if not self.active:
                return inner(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total[part] += time.perf_counter() - t0

        setattr(obj, attr, timed)


class TimedCall:
    """Stands in for a callable object (the sampler), timing its calls; attributes pass through."""

    def __init__(self, inner, timers: StepTimers, part: str) -> None:
        self._inner, self._timers, self._part = inner, timers, part

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            if self._timers.active:
                self._timers.total[self._part] += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._inner, name)


class TimedForward(TimedCall):
    """The same for an object called through ``forward`` (the C++ layer stack, a pybind object
    whose methods cannot be replaced)."""

    def forward(self, *args, **kwargs):
        return TimedCall(self._inner.forward, self._timers, self._part)(*args, **kwargs)
