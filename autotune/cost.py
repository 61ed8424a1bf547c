"""What a configuration is worth: USD per million output tokens, GPUs for the traffic, the
monthly bill, the saving over vLLM's defaults and the comparison with an API price.

Pure arithmetic on typed records (no I/O): :func:`config_cost` prices one measured
configuration, :func:`study_cost` the winner against the defaults, :func:`cost_from_best`
reads both from the content of a ``best.json``. Every figure carries the interval of the
measurement it rests on: a lower throughput is a higher price and more GPUs, so a low end
of the throughput gives the high end of a cost (docs/cost.md).

A price is per GPU-hour; a server uses ``gpus_per_server`` of them (1 on one GPU, the tensor x
data parallel size where a config spreads over several; a CPU server counts as one unit).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.traffic import TrafficShape

__all__ = [
    "HOURS_PER_MONTH",
    "CapacityNeed",
    "ConfigCost",
    "GpuNeed",
    "Prices",
    "Rate",
    "StudyCost",
    "TrafficLoad",
    "best_cost",
    "capacity_need",
    "config_cost",
    "cost_from_best",
    "cost_line",
    "cost_metrics",
    "no_price_line",
    "parse_api_price",
    "prices_of",
    "rate_of",
    "server_gpus",
    "study_cost",
    "traffic_of",
]

#: hours in a month (365 x 24 / 12): what a GPU-hour price becomes per month
HOURS_PER_MONTH = 730.0
_M = 1_000_000.0


@dataclass(frozen=True)
class Prices:
    """What the user pays: USD per GPU-hour; optionally the API's USD per million input and
    output tokens; ``growth`` multiplies the recorded traffic (2 = it doubles)."""

    gpu_hour_usd: float
    api_input_usd_per_m: float | None = None
    api_output_usd_per_m: float | None = None
    growth: float = 1.0

    def __post_init__(self) -> None:
        # the messages name the options people type, not these fields
        for name, flag in (("gpu_hour_usd", "--gpu-hour-price"), ("growth", "--growth")):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{flag} {v:g}: give a positive number")
        for name, part in (("api_input_usd_per_m", "input"), ("api_output_usd_per_m", "output")):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"--api-price: the {part} price {v:g} must be a number >= 0")

    @property
    def has_api(self) -> bool:
        return self.api_input_usd_per_m is not None and self.api_output_usd_per_m is not None


@dataclass(frozen=True)
class Rate:
    """One server's measured rate and its interval: output tokens/s (``basis``
    "throughput": a closed loop) or requests/s within the SLOs ("capacity": an open loop)
    with the output tokens one request yields there."""

    basis: Literal["throughput", "capacity"]
    value: float
    low: float
    high: float
    output_tokens_per_request: float | None = None  # capacity: out tok/s = req/s x this
    # the measured interval reached 0 (a noisy reading): the low end shown is the lowest
    # reading, and the high end of every cost is unbounded
    open_low: bool = False
    # a capacity whose search found no failing level: the rate is a lower bound (``high``
    # is only the highest reading), so every GPU count and cost is an upper bound
    open_high: bool = False

    def tokens_per_s(self, x: float) -> float | None:
        """Output tokens/s at a value of this rate (None when that cannot be known)."""
        if self.basis == "throughput":
            return x
        return x * self.output_tokens_per_request if self.output_tokens_per_request else None


@dataclass(frozen=True)
class TrafficLoad:
    """The recorded traffic a fleet is sized for: mean and peak-window arrival rates
    (0 where the shape recorded none) and mean tokens per request."""

    mean_rps: float
    peak_rps: float
    mean_input_tokens: float
    mean_output_tokens: float
    peak_window_s: float = 60.0

    @property
    def has_rate(self) -> bool:
        return self.mean_rps > 0


@dataclass(frozen=True)
class GpuNeed:
    """GPUs for a rate of traffic: fractional (the value and its interval) and whole."""

    rps: float
    gpus: float
    gpus_low: float
    gpus_high: float
    whole: int
    whole_low: int
    whole_high: int


@dataclass(frozen=True)
class CapacityNeed:
    """Servers (and GPUs) a recorded rate needs, from a capacity bracket: ``servers`` =
    rate / the highest passing rate, the sizing figure and an upper bound ("at most": the
    server passed that load); ``servers_low`` = rate / the lowest failing rate, the least it
    can be (None when no level failed: then fewer may do, by how much is not measured)."""

    servers: float
    gpus: float
    servers_low: float | None
    gpus_low: float | None


def capacity_need(*, recorded_rps: float, capacity_rps: float, high_rps: float | None,
                  gpus_per_server: float = 1.0) -> CapacityNeed | None:
    """The :class:`CapacityNeed` of ``recorded_rps`` on servers whose capacity is
    ``capacity_rps`` (a bracket's low end, or a median of them) below a lowest failing
    rate ``high_rps`` (None or inf: no level failed). None without a rate or a capacity."""
    if not (recorded_rps > 0 and capacity_rps > 0 and math.isfinite(capacity_rps)):
        return None
    servers = recorded_rps / capacity_rps
    low = (min(servers, recorded_rps / high_rps)
           if high_rps is not None and math.isfinite(high_rps) and high_rps > 0 else None)
    return CapacityNeed(servers=servers, gpus=servers * gpus_per_server, servers_low=low,
                        gpus_low=low * gpus_per_server if low is not None else None)


@dataclass(frozen=True)
class ConfigCost:
    """What one configuration costs. ``usd_per_m_output_tokens``: at full use of its
    servers; ``gpus``: "mean"/"peak" x "now"/"growth" (empty without a recorded rate);
    ``usd_per_month``: the whole GPUs of the peak window, now and with growth."""

    output_tokens_per_s: float | None
    output_tokens_per_s_low: float | None
    output_tokens_per_s_high: float | None
    usd_per_m_output_tokens: float | None
    usd_per_m_output_tokens_low: float | None
    usd_per_m_output_tokens_high: float | None
    usd_per_server_month: float
    gpus: dict[str, dict[str, GpuNeed]]
    usd_per_month: float | None
    usd_per_month_growth: float | None
    usd_per_month_interval: tuple[float, float] | None
    # against the API: 1 - self-hosted / API at full use (< 0: a premium), and the share of
    # the servers' time that must be busy for self-hosting to cost what the API does
    api_discount: float | None = None
    api_discount_low: float | None = None
    api_discount_high: float | None = None
    break_even_utilisation: float | None = None
    # from a capacity (``Rate.basis``): its GPUs and costs rest on a passing level's rate,
    # so they are upper bounds ("at most"); ``open_high``: no level failed, so nothing
    # bounds them below (their low ends are None, or 0 GPUs)
    at_most: bool = False
    open_high: bool = False


@dataclass(frozen=True)
class StudyCost:
    """best.json's ``cost``: the declared config and vLLM's defaults, the saving of the
    one over the other, and the API's price of the same traffic."""

    prices: Prices
    gpus_per_server: int
    unit: str
    basis: str
    traffic: TrafficLoad
    best: ConfigCost
    defaults: ConfigCost | None
    saving: dict[str, float] | None
    api: dict[str, float] | None
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (tuples become lists)."""
        return asdict(self)


def parse_api_price(text: str | Sequence[float] | None) -> list[float] | None:
    """``"0.3,1.2"`` (USD per million input, output tokens) -> ``[0.3, 1.2]``."""
    if text is None or text == "":
        return None
    parts: list[str | float] = (list(text) if not isinstance(text, str)
                        else [p.strip() for p in text.split(",")])
    try:
        values = [float(p) for p in parts]
    except (TypeError, ValueError):
        values = []
    if len(values) != 2 or not all(math.isfinite(v) and v >= 0 for v in values):
        raise ConfigError(f"--api-price {text!r} is not IN,OUT: give the API's USD per million "
                          "input and output tokens, e.g. --api-price 0.3,1.2")
    return values


def _need(rps: float, rate: Rate, gpus_per_server: int) -> GpuNeed:
    def gpus(x: float) -> float:
        return rps / x * gpus_per_server if x > 0 else math.inf

    def whole(g: float) -> int:  # whole servers, in GPUs; 1e-9: 2.0000000001 is 2
        return (math.ceil(g / gpus_per_server - 1e-9) * gpus_per_server
                if math.isfinite(g) else -1)

    g, g_lo, g_hi = gpus(rate.value), gpus(rate.high), gpus(rate.low)
    if rate.open_high:  # no level failed: fewer may do, by how much is not measured
        g_lo = 0.0
    return GpuNeed(rps=rps, gpus=g, gpus_low=g_lo, gpus_high=g_hi, whole=whole(g),
                   whole_low=whole(g_lo), whole_high=whole(g_hi))


def _demand(traffic: TrafficLoad, rps: float, rate: Rate) -> float:
    """The traffic in the rate's unit: requests/s, or output tokens/s for a throughput."""
    return rps if rate.basis == "capacity" else rps * traffic.mean_output_tokens


def api_usd_per_m_output(prices: Prices, traffic: TrafficLoad) -> float | None:
    """The API's price of this traffic per million output tokens (its input tokens
    included: mean input / mean output x the input price)."""
    if not prices.has_api or traffic.mean_output_tokens <= 0:
        return None
    assert prices.api_input_usd_per_m is not None and prices.api_output_usd_per_m is not None
    return (traffic.mean_input_tokens / traffic.mean_output_tokens * prices.api_input_usd_per_m
            + prices.api_output_usd_per_m)


def config_cost(*, rate: Rate, prices: Prices, traffic: TrafficLoad,
                gpus_per_server: int = 1) -> ConfigCost:
    """What one configuration costs (see :class:`ConfigCost`)."""
    if gpus_per_server < 1:
        raise ConfigError(f"gpus_per_server must be >= 1 (got {gpus_per_server})")
    server_hour = prices.gpu_hour_usd * gpus_per_server

    def per_m(tok_s: float | None) -> float | None:
        return server_hour / (tok_s * 3600.0) * _M if tok_s and tok_s > 0 else None

    tok, tok_lo, tok_hi = (rate.tokens_per_s(rate.value), rate.tokens_per_s(rate.low),
                           rate.tokens_per_s(rate.high))
    usd, usd_lo, usd_hi = per_m(tok), per_m(tok_hi), per_m(tok_lo)
    if rate.open_high:  # no failing level: nothing bounds the cost below
        usd_lo = None
    gpus: dict[str, dict[str, GpuNeed]] = {}
    month = month_g = None
    month_iv: tuple[float, float] | None = None
    if traffic.has_rate and rate.value > 0:
        peak = max(traffic.peak_rps, traffic.mean_rps)
        for name, rps in (("mean", traffic.mean_rps), ("peak", peak)):
            gpus[name] = {
                "now": _need(_demand(traffic, rps, rate), rate, gpus_per_server),
                "growth": _need(_demand(traffic, rps * prices.growth, rate), rate,
                                gpus_per_server),
            }
        p = gpus["peak"]
        month = p["now"].whole * prices.gpu_hour_usd * HOURS_PER_MONTH
        month_g = p["growth"].whole * prices.gpu_hour_usd * HOURS_PER_MONTH
        month_iv = (p["now"].whole_low * prices.gpu_hour_usd * HOURS_PER_MONTH,
                    p["now"].whole_high * prices.gpu_hour_usd * HOURS_PER_MONTH)
    api = api_usd_per_m_output(prices, traffic)
    disc = disc_lo = disc_hi = even = None
    if api and usd is not None:
        disc, even = 1.0 - usd / api, usd / api
        disc_lo = 1.0 - usd_hi / api if usd_hi is not None else None
        disc_hi = 1.0 - usd_lo / api if usd_lo is not None else None
    return ConfigCost(
        output_tokens_per_s=tok, output_tokens_per_s_low=tok_lo, output_tokens_per_s_high=tok_hi,
        usd_per_m_output_tokens=usd, usd_per_m_output_tokens_low=usd_lo,
        usd_per_m_output_tokens_high=usd_hi,
        usd_per_server_month=server_hour * HOURS_PER_MONTH, gpus=gpus,
        usd_per_month=month, usd_per_month_growth=month_g, usd_per_month_interval=month_iv,
        api_discount=disc, api_discount_low=disc_lo, api_discount_high=disc_hi,
        break_even_utilisation=even, at_most=rate.basis == "capacity", open_high=rate.open_high,
    )  # fmt: skip


def _saving(best: ConfigCost, defaults: ConfigCost, prices: Prices) -> dict[str, float]:
    out: dict[str, float] = {}
    if best.open_high or defaults.open_high:  # a bound minus a figure is no figure
        return out
    if best.gpus and defaults.gpus:
        for when in ("now", "growth"):
            out[f"gpus_peak_{when}"] = float(defaults.gpus["peak"][when].whole
                                             - best.gpus["peak"][when].whole)
        out["usd_per_month"] = out["gpus_peak_now"] * prices.gpu_hour_usd * HOURS_PER_MONTH
        out["usd_per_month_growth"] = (out["gpus_peak_growth"] * prices.gpu_hour_usd
                                       * HOURS_PER_MONTH)
    if best.usd_per_m_output_tokens and defaults.usd_per_m_output_tokens:
        out["usd_per_m_output_tokens"] = (defaults.usd_per_m_output_tokens
                                          - best.usd_per_m_output_tokens)
        out["fraction"] = 1.0 - best.usd_per_m_output_tokens / defaults.usd_per_m_output_tokens
    return out


def study_cost(*, best: Rate, defaults: Rate | None, prices: Prices, traffic: TrafficLoad,
               gpus_per_server: int = 1, unit: str = "GPU") -> StudyCost:
    """The declared config against vLLM's defaults (see :class:`StudyCost`)."""
    b = config_cost(rate=best, prices=prices, traffic=traffic, gpus_per_server=gpus_per_server)
    d = (config_cost(rate=defaults, prices=prices, traffic=traffic,
                     gpus_per_server=gpus_per_server) if defaults is not None else None)
    notes: list[str] = []
    for who, r in (("the declared config", best), ("vLLM's defaults", defaults)):
        if r is not None and r.open_low:
            notes.append(f"the 95 % interval of {who}'s reading reaches 0 (too noisy a "
                         "measurement): the high ends of its costs are unbounded; those shown "
                         "rest on its lowest reading")
    for who, r in (("the declared config", best), ("vLLM's defaults", defaults)):
        if r is not None and r.open_high:
            notes.append(f"the capacity search of {who} found no failing load level: its "
                         "capacity is a lower bound, so its GPUs and costs are upper bounds "
                         "(fewer may do) and no saving is computed")
    if not traffic.has_rate:
        notes.append("the traffic shape records no arrival rate: GPUs for the traffic and "
                     "the monthly bill need a shape fitted from a timestamped trace")
    if best.basis == "capacity" and b.usd_per_m_output_tokens is None:
        notes.append("no output tokens/s at capacity were measured: USD per million tokens "
                     "is left out")
    api: dict[str, float] | None = None
    per_m = api_usd_per_m_output(prices, traffic)
    if per_m is not None:
        api = {"usd_per_m_output_tokens": per_m}
        if traffic.has_rate:
            month = traffic.mean_rps * 3600.0 * HOURS_PER_MONTH * traffic.mean_output_tokens / _M
            api["usd_per_month"] = month * per_m
            api["usd_per_month_growth"] = month * per_m * prices.growth
    return StudyCost(prices=prices, gpus_per_server=gpus_per_server, unit=unit,
                     basis=best.basis, traffic=traffic, best=b, defaults=d,
                     saving=_saving(b, d, prices) if d is not None else None, api=api,
                     notes=notes)


# -- from best.json ------------------------------------------------------------------------


def _num(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def rate_of(metrics: Mapping[str, Any], readings: Sequence[float], value: float,
            *, capacity: bool, server_gpus: int = 1) -> Rate:
    """A config's :class:`Rate` from its trial's metrics and its readings (one per fresh
    server start): the interval spans the start-to-start spread and the interval of the
    reading (the capacity bracket, or the throughput's 95 % interval). ``server_gpus``:
    the readings and ``value`` are per GPU of a server of that many GPUs (a study's
    objective), the metrics per server."""
    vals = [float(r) for r in readings if (_num(r) or 0) > 0] or [value]
    key = "capacity_rps" if capacity else "output_tokens_per_s"
    n = max(1, int(server_gpus))
    ci_low = _num(metrics.get(f"{key}_ci_low"))
    ci_high = _num(metrics.get(f"{key}_ci_high"))
    lo = [x / n for x in (ci_low,) if x is not None and x > 0]
    hi = [x / n for x in (ci_high,) if x is not None and x > 0]
    low, high = min([*vals, *lo, value]), max([*vals, *hi, value])
    # at capacity: the tokens/s of the busiest stretch a level replays, at the rate it sent
    tok = _num(metrics.get("output_tokens_per_s_at_capacity")) if capacity else None
    rps = _num(metrics.get("capacity_busiest_rps")) or _num(metrics.get(key))
    per_req = tok / rps if tok and rps else None
    return Rate(basis="capacity" if capacity else "throughput", value=value, low=low,
                high=high, output_tokens_per_request=per_req,
                open_low=ci_low is not None and ci_low <= 0,
                open_high=capacity and ci_high is None)


def cost_from_best(best: Mapping[str, Any], *, prices: Prices, traffic: TrafficLoad,
                   gpus_per_server: int = 1, unit: str = "GPU") -> StudyCost:
    """The :class:`StudyCost` of a ``best.json`` (its declared config and its baseline)."""
    capacity = (best.get("objective") or {}).get("name") == "capacity"
    value = float(best["objective"]["value"])
    # a study's objective is per GPU (best.json's gpus.per_server GPUs a server): priced per
    # GPU, so gpus_per_server stays 1 for it
    per_gpu = bool((best.get("objective") or {}).get("per_gpu"))
    n_best = int((best.get("gpus") or {}).get("per_server") or 1) if per_gpu else 1
    rate = rate_of(best.get("metrics") or {}, best.get("readings") or [value], value,
                   capacity=capacity, server_gpus=n_best)
    base = best.get("baseline") or None
    d_rate = (rate_of(base.get("metrics") or {}, base.get("readings") or [], float(base["value"]),
                      capacity=capacity,
                      server_gpus=int(base.get("server_gpus") or 1) if per_gpu else 1)
              if base and _num(base.get("value")) else None)
    if per_gpu:
        gpus_per_server = 1
    return study_cost(best=rate, defaults=d_rate, prices=prices, traffic=traffic,
                      gpus_per_server=gpus_per_server, unit=unit)


def traffic_of(shape: TrafficShape) -> TrafficLoad:
    """A :class:`TrafficLoad` from a :class:`~autotune.traffic.TrafficShape`."""
    arr = shape.arrivals
    return TrafficLoad(mean_rps=float(shape.rate_rps or 0.0),
                       peak_rps=float(arr.peak_rate_rps) if arr is not None else 0.0,
                       mean_input_tokens=float(shape.input_tokens.mean),
                       mean_output_tokens=float(shape.output_tokens.mean),
                       peak_window_s=float(arr.window_s) if arr is not None else 60.0)


# -- lines for people ----------------------------------------------------------------------


def no_price_line() -> str:
    """What the summary says when no price was given."""
    return ("cost: not computed (no price is built in): add --gpu-hour-price USD (and "
            "--api-price IN,OUT, --growth X) for USD per million tokens, GPUs for the "
            "traffic and the comparison with an API")


def _usd(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "not known"
    return f"${x:,.0f}" if abs(x) >= 100 else f"${x:.{digits}g}"


def _span(c: ConfigCost) -> str:
    # from a capacity the range spans each start's bracket and the spread of the starts:
    # its top may pass the figure, an upper bound for the start it rests on
    return "starts and brackets: " if c.at_most else ""


def _whole_iv(n: GpuNeed, c: ConfigCost) -> str:
    if c.open_high:
        return " (fewer may do: no load level failed)"
    return ("" if n.whole_low == n.whole_high == n.whole
            else f" ({_span(c)}{n.whole_low}-{n.whole_high})")


def _config_part(c: ConfigCost, unit: str) -> str:
    """A config's price and fleet; from a capacity "at most" each (a passing level's rate)."""
    most = "at most " if c.at_most else ""
    if c.usd_per_m_output_tokens is None:
        s = "USD per million output tokens not known"
    else:
        lo, hi = c.usd_per_m_output_tokens_low, c.usd_per_m_output_tokens_high
        iv = (f" ({_span(c)}{_usd(lo)}-{_usd(hi)})" if lo is not None and hi is not None
              else f" (up to {_usd(hi)}; nothing bounds it below)" if hi is not None else "")
        s = f"{most}{_usd(c.usd_per_m_output_tokens)}/M out tok{iv}"
    if c.gpus:
        p = c.gpus["peak"]
        now, grown = p["now"], p["growth"]
        s += (f", {most}{now.whole} {unit}(s) at peak{_whole_iv(now, c)}, {most}{grown.whole} "
              f"with growth{_whole_iv(grown, c)}, {most}{_usd(c.usd_per_month)}/month")
    return s


def _api_part(b: ConfigCost) -> str:
    """Discount or premium at full use (with its interval) and the break-even utilisation;
    from a capacity (an upper bound on the cost) a discount is at least, a break-even at
    most what it says."""
    d, lo, hi = b.api_discount or 0.0, b.api_discount_low or 0.0, b.api_discount_high
    if hi is None and not b.open_high:
        hi = 0.0
    even = b.break_even_utilisation or 0.0
    least, most = ("at least ", "at most ") if b.at_most else ("", "")
    if d >= 0:
        top = f"{hi:.0%}" if hi is not None else "more: no load level failed"
        text = f"discount {least}{d:.0%} at full use ({lo:.0%} to {top})"
    else:  # a premium: its interval as premiums, smallest first
        low_end = f"{-hi:.0%}" if hi is not None else "less: no load level failed"
        text = f"premium {most}{-d:.0%} at full use ({low_end} to {-lo:.0%})"
    less = " or less" if most else ""
    return text + (f"; breaks even at {even:.0%} utilisation{less}" if even <= 1 else
                   f"; never breaks even (it would need {even:.0%} utilisation{less})")


def cost_line(cost: Mapping[str, Any] | StudyCost) -> str:
    """best.json's ``cost`` in a few lines (the study's summary, ``autotune best``)."""
    c = cost if isinstance(cost, StudyCost) else _from_dict(cost)
    p = c.prices
    lines = [f"cost at {_usd(p.gpu_hour_usd)}/{c.unit}-hour x {c.gpus_per_server} per server "
             f"({'at capacity' if c.basis == 'capacity' else 'at the measured throughput'}, "
             f"growth x{p.growth:g}): best {_config_part(c.best, c.unit)}"]
    if c.defaults is not None:
        lines.append(f"  vLLM defaults {_config_part(c.defaults, c.unit)}")
    s = c.saving or {}
    if "gpus_peak_now" in s:
        lines.append(f"  saving of the best over the defaults: {s['gpus_peak_now']:g} "
                     f"{c.unit}(s) now, {s['gpus_peak_growth']:g} with growth; "
                     f"{_usd(s['usd_per_month'])}/month "
                     f"({_usd(s['usd_per_month_growth'])} with growth)")
    elif "fraction" in s:
        lines.append(f"  saving of the best over the defaults: {s['fraction']:.0%} per token")
    b = c.best
    if c.api and b.api_discount is not None:
        lines.append(
            f"  vs the API ({_usd(p.api_input_usd_per_m)}/{_usd(p.api_output_usd_per_m)} per M "
            f"in/out = {_usd(c.api['usd_per_m_output_tokens'])}/M out tok for this traffic): "
            + _api_part(b)
            + (f"; the API would bill {_usd(c.api['usd_per_month'])}/month"
               if "usd_per_month" in c.api else ""))
    lines.extend(f"  note: {n}" for n in c.notes)
    return "\n".join(lines)


def _need_from(d: Mapping[str, Any]) -> GpuNeed:
    return GpuNeed(**{k: d[k] for k in GpuNeed.__dataclass_fields__})


def _config_from(d: Mapping[str, Any]) -> ConfigCost:
    kw = dict(d)
    kw["gpus"] = {k: {w: _need_from(n) for w, n in v.items()} for k, v in d["gpus"].items()}
    iv = kw.get("usd_per_month_interval")
    kw["usd_per_month_interval"] = tuple(iv) if iv else None
    return ConfigCost(**kw)


def _from_dict(d: Mapping[str, Any]) -> StudyCost:
    """A :class:`StudyCost` back from its :meth:`StudyCost.to_dict` (best.json, MLflow)."""
    return StudyCost(
        prices=Prices(**d["prices"]), gpus_per_server=int(d["gpus_per_server"]), unit=d["unit"],
        basis=d["basis"], traffic=TrafficLoad(**d["traffic"]), best=_config_from(d["best"]),
        defaults=_config_from(d["defaults"]) if d.get("defaults") else None,
        saving=d.get("saving"), api=d.get("api"), notes=list(d.get("notes") or []))


# -- a study's settings -> best.json's ``cost`` --------------------------------------------


def prices_of(settings: object) -> Prices | None:
    """The :class:`Prices` of a study's or bench's settings (``gpu_hour_price``,
    ``api_price``, ``growth``); None without a GPU-hour price (no price is built in)."""
    gpu = getattr(settings, "gpu_hour_price", None)
    if gpu is None:
        return None
    api = parse_api_price(getattr(settings, "api_price", None))
    growth = getattr(settings, "growth", None)  # 0 is given, and refused: not "unset"
    return Prices(gpu_hour_usd=float(gpu), api_input_usd_per_m=api[0] if api else None,
                  api_output_usd_per_m=api[1] if api else None,
                  growth=float(growth) if growth is not None else 1.0)


def server_gpus(gpus_per_trial: int | None, device: str) -> tuple[int, str]:
    """(GPUs one server uses, the unit a price is per): a CPU server counts as one unit."""
    if device == "cpu" or not gpus_per_trial:
        return 1, ("GPU" if device != "cpu" else "server")
    return int(gpus_per_trial), "GPU"


def best_cost(best: Mapping[str, Any], *, settings: object, shape: TrafficShape,
              device: str) -> dict[str, Any] | None:
    """best.json's ``cost`` (None when the settings give no GPU-hour price)."""
    prices = prices_of(settings)
    if prices is None:
        return None
    n, unit = server_gpus(getattr(settings, "gpus_per_trial", None), device)
    return cost_from_best(best, prices=prices, traffic=traffic_of(shape), gpus_per_server=n,
                          unit=unit).to_dict()


def cost_metrics(cost: Mapping[str, Any]) -> dict[str, float]:
    """Flat ``cost.*`` metrics of best.json's ``cost`` (for the MLflow study run)."""
    out: dict[str, float] = {}

    def put(key: str, v: object) -> None:
        x = _num(v)
        if x is not None:
            out[key] = x

    for who in ("best", "defaults"):
        c = cost.get(who) or {}
        for k in ("usd_per_m_output_tokens", "usd_per_m_output_tokens_low",
                  "usd_per_m_output_tokens_high", "usd_per_month", "usd_per_month_growth",
                  "api_discount", "break_even_utilisation"):
            put(f"cost.{who}.{k}", c.get(k))
        for rate, whens in (c.get("gpus") or {}).items():
            for when, need in whens.items():
                put(f"cost.{who}.gpus_{rate}_{when}", need.get("gpus"))
                put(f"cost.{who}.whole_gpus_{rate}_{when}", need.get("whole"))
    for k, v in (cost.get("saving") or {}).items():
        put(f"cost.saving.{k}", v)
    for k, v in (cost.get("api") or {}).items():
        put(f"cost.api.{k}", v)
    return out
