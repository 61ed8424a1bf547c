"""``watch --prometheus``: watch's windows read from Prometheus, for the whole fleet.

Each window is ``every_s`` long and ends ``lag_s`` before now (so that the replicas' last
scrapes are in). The first window is the one that has just ended, so the first comparison
comes at once; the next ones follow back to back, each as soon as its end is ``lag_s`` in
the past. Prometheus keeps the data while it is down, so after an outage the windows go on
where they stopped (catching up without waiting). See docs/traffic.md section 10.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from autotune.traffic import (
    PrometheusClient,
    PrometheusUnreachableError,
    TrafficShape,
    fit_prometheus,
)
from autotune.watch._watch import EndpointUnreachableError

__all__ = ["PrometheusWindows"]


class PrometheusWindows:
    """A :class:`autotune.watch.WindowSource` over Prometheus ranges (see the module)."""

    def __init__(self, client: PrometheusClient, *, every_s: float, lag_s: float = 30.0,
                 selector: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.client, self.every_s, self.lag_s = client, every_s, lag_s
        self.selector = selector
        self.clock = clock
        self.next_end: float | None = None

    def next_shape(self, name: str, stop: threading.Event) -> TrafficShape | None:
        if self.next_end is None:
            self.next_end = self.clock() - self.lag_s
        end = self.next_end
        while (left := end + self.lag_s - self.clock()) > 0:
            if stop.wait(min(left, 1.0)):
                return None
        try:
            fit = fit_prometheus(self.client, start=end - self.every_s, end=end,
                                 selector=self.selector, name=name)
        except PrometheusUnreachableError as exc:
            raise EndpointUnreachableError(str(exc)) from exc  # the same window next time
        except BaseException:
            self.next_end = end + self.every_s  # an idle window is not read again
            raise
        self.next_end = end + self.every_s
        return fit.shape

    def reset(self) -> None:
        """Nothing to restart: Prometheus kept the data; the next window follows on."""
