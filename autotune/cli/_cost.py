"""The cost options of ``tune``, ``retune`` and ``bench`` (declared once) and the lines
that print best.json's ``cost``."""

from __future__ import annotations

from typing import Any

from autotune.cost import parse_api_price

__all__ = ["COST_OPTIONS", "add_cost_arguments", "cost_lines"]

#: keyword arguments of ``autotune.cli._tune.Option``, one per cost option
COST_OPTIONS: tuple[dict[str, Any], ...] = (
    {"flag": "--gpu-hour-price", "field": "gpu_hour_price", "group": "cost", "metavar": "USD",
     "help": "USD per GPU-hour (a CPU server counts as one unit): adds to the summary, "
             "best.json's 'cost', MLflow and the report USD per million output tokens (at "
             "the measured throughput, or at capacity for --objective capacity) with its "
             "interval, the GPUs the recorded traffic needs at its mean rate and at its peak "
             "window, the monthly bill and the saving over vLLM's defaults; without it cost "
             "is left out"},
    {"flag": "--api-price", "field": "api_price", "group": "cost", "metavar": "IN,OUT",
     "parse": parse_api_price,
     "help": "USD per million input and output tokens of the API you would otherwise call, "
             "e.g. 0.3,1.2: adds the discount (or premium) of self-hosting at full use and "
             "the utilisation at which it breaks even"},
    {"flag": "--growth", "field": "growth", "group": "cost", "metavar": "X",
     "help": "traffic growth to size the fleet for as well (2 = the traffic doubles)"},
)


def add_cost_arguments(p: Any) -> None:
    """``--gpu-hour-price``, ``--api-price``, ``--growth`` on a parser of its own (bench)."""
    g = p.add_argument_group("what it is worth (docs/cost.md; no price is built in)")
    for opt in COST_OPTIONS:
        g.add_argument(opt["flag"], dest=opt["field"], metavar=opt["metavar"],
                       type=float if "parse" not in opt else opt["parse"],
                       default=1.0 if opt["field"] == "growth" else None, help=opt["help"])


def cost_lines(best: dict[str, Any]) -> list[str]:
    """What the summary prints about cost: best.json's ``cost``, or which option adds it."""
    from autotune.cost import cost_line, no_price_line

    return [cost_line(best["cost"]) if best.get("cost") else no_price_line()]


def bench_cost(args: Any, metrics: dict[str, Any], *, capacity: bool) -> dict[str, Any] | None:
    """``autotune bench``'s cost of the one config it measured (None without a price)."""
    from autotune.cost import best_cost
    from autotune.engine import detect_engine
    from autotune.traffic import load_shape

    if getattr(args, "gpu_hour_price", None) is None:
        return None
    key = "capacity_rps" if capacity else "output_tokens_per_s"
    value = metrics.get(key)
    if not isinstance(value, (int, float)) or value <= 0:
        return None
    best = {"objective": {"name": "capacity" if capacity else "throughput", "value": value},
            "readings": [value], "metrics": metrics}
    return best_cost(best, settings=args, shape=load_shape(args.shape),
                     device=detect_engine().device)
