"""What an engine step costs, for the dynamic-verification policy (`dynamic.py`,
docs/dynamic-verification.md).

T(N), the seconds of one engine step whose target forward holds N tokens (scheduler,
target forward, sampling, bookkeeping; the drafter is timed apart), comes from one of:
- `InjectedStepCost`: a line given by the `dspine_verify_cost` option (reproducible
  choices; the tests use it), which also gives the drafter's time per step;
- `MeasuredStepCost`: fitted on the running engine.
The drafter's own time per step, when measured, is an `EWLinear` against the rows it
drafts (requests x rows) or, without a block, the requests whose context it writes.
Each cost model answers `step_seconds(N)` (vectorised over N) and `ready`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class InjectedStepCost:
    """An injected cost model (the `dspine_verify_cost` option): verification step
    `step_s + token_s * N` seconds for N target tokens, the drafter `draft_s` a step."""

    step_s: float
    token_s: float
    draft_s: float

    @classmethod
    def from_option(cls, d: dict) -> "InjectedStepCost":
        return cls(float(d["step_s"]), float(d["token_s"]), float(d["draft_s"]))

    def step_seconds(self, n_tokens):
        return self.step_s + self.token_s * np.asarray(n_tokens, dtype=np.float64)

    @property
    def ready(self) -> bool:
        return True


class MeasuredStepCost:
    """T(N): seconds of one engine step (scheduler, target forward over N tokens,
    sampling, bookkeeping; the drafter is timed separately) as measured on the running
    engine, as T(N) = speed x shape(N).

    shape: samples pooled in quarter-octave bins of N, each in the machine speed of its
    time (seconds / speed): a bin's mean over its first samples, then an exponentially
    weighted mean of small weight (BIN_EW); the piecewise-linear curve through the
    bins as measured, extended past the ends with the slope of the nearest segment
    (never negative). Flat then linear (a GPU below its compute knee), linear, and
    the dips of a CPU's GEMM kernels all fit: the curve is not made monotonic, because
    it is not. On this CPU (oneDNN, one thread, SmolLM2's 30 layers streamed from
    memory) 2 tokens cost more than 5: 52.5 vs 34.7 ms (bench/bench_cpu_ops.py,
    docs/benchmarks.md), so a verification of 4 drafts is cheaper than one of 1, and a
    curve forced non-decreasing hid that from the policy.

    speed: follows every step whatever its N (exponentially weighted, in log space).
    A CPU's speed moves by 1.5-2x within minutes (docs/dynamic-verification.md,
    "2026-12-02"), and the policy visits most N rarely: with one mean per bin, a bin
    filled in a fast phase was compared with another filled in a slow one, and only the
    ratio T(N) / T(R) matters to the choice. A lasting change in the step time of the N
    being visited goes mostly into speed (SPEED_EW >> BIN_EW), so every bin follows it;
    a change of shape alone (one N dearer, the others not) ends in that bin, as steps at
    other N pull speed back (tests/test_dynamic_policy.py).
    Before the curve has two operating points, speed stays 1."""

    BIN_EW = 0.01  # weight of a new sample once a bin has 100
    SPEED_EW = 0.1  # weight of a step in log(speed)
    SPEED_CLIP = 0.5  # |log(seconds / T(N))| counted per step at most (a one-off spike)

    def __init__(self) -> None:
        self._bins: dict[int, list[float]] = {}  # key -> [mean N, mean shape, count]
        self._rejected_in_row = 0
        self._curve: tuple[np.ndarray, np.ndarray] | None = None
        self.speed = 1.0

    @staticmethod
    def _key(n: float) -> int:
        return int(math.floor(4 * math.log2(max(n, 1.0))))

    @property
    def ready(self) -> bool:
        c = self._points()
        return c is not None and c[0][-1] >= 2 * c[0][0]

    def observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens <= 0 or not seconds > 0:
            return
        if self.ready:
            expected = float(self.step_seconds(n_tokens))
            # An idle gap or a step the drafter never saw: not a step of N tokens.
            if seconds > 4 * expected + 0.05 and self._rejected_in_row < 8:
                self._rejected_in_row += 1
                return
            if expected > 0:
                r = math.log(seconds / expected)
                self.speed *= math.exp(self.SPEED_EW * max(-self.SPEED_CLIP,
                                                           min(self.SPEED_CLIP, r)))
        self._rejected_in_row = 0
        x = seconds / self.speed
        b = self._bins.setdefault(self._key(n_tokens), [float(n_tokens), x, 0.0])
        b[2] += 1
        w = max(1.0 / b[2], self.BIN_EW)
        b[0] += w * (n_tokens - b[0])
        b[1] += w * (x - b[1])
        self._curve = None

    def _points(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The shape's points (N, seconds at speed 1), in order of N."""
        if self._curve is None and len(self._bins) >= 2:
            pts = sorted((b[0], b[1]) for b in self._bins.values())
            self._curve = (np.array([p[0] for p in pts]), np.array([p[1] for p in pts]))
        return self._curve

    def step_seconds(self, n_tokens):
        c = self._points()
        if c is None:
            raise RuntimeError("MeasuredStepCost has fewer than two operating points")
        n, t = c
        x = np.asarray(n_tokens, dtype=np.float64)
        y = np.interp(x, n, t)
        lo = max((t[1] - t[0]) / max(n[1] - n[0], 1e-9), 0.0)
        hi = max((t[-1] - t[-2]) / max(n[-1] - n[-2], 1e-9), 0.0)
        y = np.where(x < n[0], np.maximum(t[0] - lo * (n[0] - x), 0.0), y)
        return self.speed * np.where(x > n[-1], t[-1] + hi * (x - n[-1]), y)

    def describe(self) -> str:
        c = self._points()
        if c is None:
            return "no data"
        return ", ".join(f"T({int(round(a))})={1e3 * self.speed * b:.1f}ms"
                         for a, b in zip(*c)) + f" (speed x{self.speed:.2f})"


class EWLinear:
    """seconds ~ a + b * x by exponentially weighted least squares (the drafter's time
    against the number of requests drafted)."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self._s = np.zeros(5)  # sum w, w x, w x^2, w y, w x y

    @property
    def ready(self) -> bool:
        return self._s[0] > 0

    def observe(self, x: float, y: float) -> None:
        self._s *= self.decay
        self._s += np.array([1.0, x, x * x, y, x * y])

    def line(self, min_weight: float = 0.0) -> tuple[float, float] | None:
        """(a, b) of the fit; None before `min_weight` of (decayed) observations or
        where x has not varied (no slope to fit)."""
        w, sx, sxx, sy, sxy = self._s
        det = w * sxx - sx * sx
        if w < max(min_weight, 1e-12) or det <= 1e-9 * max(w * sxx, 1e-30):
            return None
        b = (w * sxy - sx * sy) / det
        return (sy - b * sx) / w, b

    def __call__(self, x: float) -> float:
        w, sx, sxx, sy, sxy = self._s
        if w <= 0:
            return 0.0
        det = w * sxx - sx * sx
        if det <= 1e-9 * max(w * sxx, 1e-30):
            return sy / w
        b = (w * sxy - sx * sy) / det
        a = (sy - b * sx) / w
        return max(a + b * x, 0.0)
