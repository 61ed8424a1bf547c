"""Helpers shared by tests/unit/test_cost.py and tests/integration/test_cost.py."""

from __future__ import annotations

from autotune.cost import (
    Prices,
    TrafficLoad,
)

PRICES = Prices(gpu_hour_usd=2.5, api_input_usd_per_m=0.3, api_output_usd_per_m=1.2, growth=2)


TRAFFIC = TrafficLoad(mean_rps=2.0, peak_rps=3.0, mean_input_tokens=500.0,
                      mean_output_tokens=250.0)
