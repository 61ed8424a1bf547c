"""The cost options of ``tune``, ``retune`` and ``bench`` (declared once) and the lines
that print best.json's ``cost``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.cost import (
    cost_from_best,
    cost_line,
    no_price_line,
    parse_api_price,
    prices_of,
    server_gpus,
    traffic_of,
)
from autotune.errors import ConfigError
from autotune.records import BestFile, JsonValue

__all__ = ["COST_OPTIONS", "add_cost_arguments", "cost_lines"]

#: keyword arguments of ``autotune.cli._options.Option``, one per cost option
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


def _api_price_type(text: str) -> list[float] | None:
    """``--api-price`` as an argparse type: a bad value is argparse's usage error (exit 2)."""
    try:
        return parse_api_price(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_cost_arguments(p: argparse.ArgumentParser) -> None:
    """``--gpu-hour-price``, ``--api-price``, ``--growth`` on a parser of its own (bench)."""
    g = p.add_argument_group("what it is worth (docs/cost.md; no price is built in)")
    for opt in COST_OPTIONS:
        g.add_argument(opt["flag"], dest=opt["field"], metavar=opt["metavar"],
                       type=float if "parse" not in opt else _api_price_type,
                       default=1.0 if opt["field"] == "growth" else None, help=opt["help"])


def cost_lines(best: BestFile) -> list[str]:
    """What the summary prints about cost: best.json's ``cost``, or which option adds it."""
    return [cost_line(best.cost) if best.cost else no_price_line()]


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


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``autotune cost``: price a finished study's best.json (at other prices, too)."""
    p = sub.add_parser(
        "cost",
        help="what a study's declared config is worth, at the prices you give",
        description=(
            "Price a finished study's best.json (its declared config and vLLM's defaults, "
            "with the intervals they were measured with) at --gpu-hour-price, and against "
            "--api-price: USD per million output tokens, the GPUs the study's traffic shape "
            "needs at its mean rate and its peak window (with --growth), the monthly bill, "
            "the saving and the break-even utilisation. The same figures a study given "
            "these options writes to best.json's 'cost'. See docs/cost.md."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("best", type=Path, help="a study's best.json or its output folder")
    p.add_argument("--shape", type=Path, default=None,
                   help="the traffic to size for (default: the shape the study was tuned for)")
    p.add_argument("--gpus-per-server", type=int, default=None,
                   help="GPUs one server uses (default: the study's --gpus-per-trial, or 1)")
    add_cost_arguments(p)
    p.add_argument("--json", action="store_true", help="print the cost record as JSON")
    p.set_defaults(func=_cost)


def _gpus_per_server(cost: Mapping[str, JsonValue] | None) -> int | None:
    n = (cost or {}).get("gpus_per_server")
    return int(n) if isinstance(n, (int, float)) else None


def _cost(args: argparse.Namespace) -> int:
    from autotune.traffic import load_shape

    if args.gpu_hour_price is None:
        raise ConfigError("--gpu-hour-price is required: USD per GPU-hour, e.g. 2.5")
    path = args.best / BestFile.FILE_NAME if args.best.is_dir() else args.best
    best = BestFile.load(path)
    if args.shape is None and (best.shape is None or not best.shape.path):
        raise ConfigError(f"{path} names no traffic shape file; give --shape")
    shape_path = args.shape or Path(best.shape.path if best.shape else "")
    device = best.engine.device if best.engine is not None and best.engine.device else "cuda"
    if args.gpus_per_server is not None and args.gpus_per_server < 1:
        raise ConfigError(f"--gpus-per-server {args.gpus_per_server}: give 1 or more")
    n, unit = server_gpus(args.gpus_per_server or _gpus_per_server(best.cost), device)
    prices = prices_of(args)
    if prices is None:  # a price was checked above
        raise ConfigError("--gpu-hour-price is required: USD per GPU-hour, e.g. 2.5")
    cost = cost_from_best(best.to_json(), prices=prices,
                          traffic=traffic_of(load_shape(shape_path)), gpus_per_server=n,
                          unit=unit)
    if args.json:
        print(json.dumps(cost.to_dict(), indent=2))
    else:
        sys.stdout.write(f"study {best.study or '?'} ({path}), traffic {shape_path}:\n"
                         f"{cost_line(cost)}\n")
    return 0
