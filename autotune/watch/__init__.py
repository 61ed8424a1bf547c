"""Watch: sample live traffic (vLLM's /metrics or Prometheus), fit its shape and say
when it drifted from the shape the deployed config was tuned for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune import lazy_exports

if TYPE_CHECKING:
    from autotune.watch._prometheus import (
        PrometheusWindows,
    )
    from autotune.watch._watch import (
        JsonlLog,
        MlflowWatchLog,
        WatchEvent,
        WatchSummary,
        fetch_metrics,
        metrics_url,
        run_command,
        sample_shape,
        served_model,
        watch,
    )

__all__ = [
    "JsonlLog",
    "MlflowWatchLog",
    "PrometheusWindows",
    "WatchEvent",
    "WatchSummary",
    "fetch_metrics",
    "metrics_url",
    "run_command",
    "sample_shape",
    "served_model",
    "watch",
]

# Each name is imported from its module on first use: importing the package (or one
# of its modules) loads nothing else.
__getattr__ = lazy_exports(__name__, {
    "autotune.watch._prometheus": ("PrometheusWindows",),
    "autotune.watch._watch": (
        "JsonlLog",
        "MlflowWatchLog",
        "WatchEvent",
        "WatchSummary",
        "fetch_metrics",
        "metrics_url",
        "run_command",
        "sample_shape",
        "served_model",
        "watch",
    ),
})
