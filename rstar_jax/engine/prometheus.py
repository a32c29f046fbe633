"""Prometheus text exposition (format 0.0.4) written by hand: `rstar_jax.serve`'s `/metrics` needs
a few gauges, counters and histograms, not a client library."""

from __future__ import annotations

import bisect
import math
import threading
from typing import Mapping, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, str], extra: tuple[str, str] | None = None) -> str:
    items = list(labels.items()) + ([extra] if extra else [])
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in items) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


class Histogram:
    """Cumulative bucket counts, their sum and count; `observe` is thread-safe."""

    def __init__(self, buckets: Sequence[float]):
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # the last one: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    def snapshot(self) -> tuple[list[tuple[float, int]], float, int]:
        """[(upper bound, cumulative count)] ending with +Inf, the sum, the count."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip((*self.buckets, math.inf), counts):
            running += count
            cumulative.append((bound, running))
        return cumulative, total, running


class Exposition:
    """Builds one exposition: families in the order added, each with HELP and TYPE lines."""

    def __init__(self, labels: Mapping[str, str]):
        self.labels = dict(labels)
        self._lines: list[str] = []

    def _header(self, name: str, kind: str, help_text: str) -> None:
        escaped = help_text.replace("\\", "\\\\").replace("\n", "\\n")  # HELP escapes only these two
        self._lines.append(f"# HELP {name} {escaped}")
        self._lines.append(f"# TYPE {name} {kind}")

    def gauge(self, name: str, value: float, help_text: str) -> None:
        self._header(name, "gauge", help_text)
        self._lines.append(f"{name}{_labels(self.labels)} {_number(value)}")

    def counter(self, name: str, value: float, help_text: str) -> None:
        """`name` ends in `_total`, as Prometheus names counters."""
        if not name.endswith("_total"):
            raise ValueError(f"counter {name!r} must end in _total")
        self._header(name, "counter", help_text)
        self._lines.append(f"{name}{_labels(self.labels)} {_number(value)}")

    def histogram(self, name: str, histogram: Histogram, help_text: str) -> None:
        buckets, total, count = histogram.snapshot()
        self._header(name, "histogram", help_text)
        for bound, cumulative in buckets:
            self._lines.append(f"{name}_bucket{_labels(self.labels, ('le', _number(bound)))} {cumulative}")
        self._lines.append(f"{name}_sum{_labels(self.labels)} {_number(total)}")
        self._lines.append(f"{name}_count{_labels(self.labels)} {count}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"
