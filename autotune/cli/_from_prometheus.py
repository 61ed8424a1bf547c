"""``autotune shape from-prometheus``: a shape from vLLM's series in Prometheus; the
options ``watch --prometheus`` shares with it (range, selector, credentials)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.traffic import PrometheusClient, PrometheusFit

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def _duration(text: str) -> float | None:
    t = text.strip().lower()
    mult = _UNITS.get(t[-1:])
    try:
        v = float(t[:-1]) * mult if mult is not None else None
    except ValueError:
        return None
    return v if v is not None and v > 0 and math.isfinite(v) else None


def parse_time(text: str, *, now: float, what: str) -> float:
    """``now``, a unix time, an ISO 8601 time (``2026-12-01T00:00:00Z``; no zone = UTC), or
    a duration before ``now`` (``90s``, ``10m``, ``6h``, ``7d``, ``2w``) -> unix seconds."""
    t = str(text).strip()
    if t.lower() == "now":
        return now
    ago = _duration(t)
    if ago is not None:
        return now - ago
    try:
        return float(t)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(
            f"{what} {text!r} is not a time; write a duration back from now (7d, 6h, 30m), "
            "an ISO 8601 time (2026-12-01T00:00:00Z) or a unix time") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def add_connection_args(p: argparse.ArgumentParser) -> None:
    """--selector, the credential files and --timeout (shape from-prometheus, watch)."""
    p.add_argument("--selector", default=None, metavar="'{LABEL=\"VALUE\",...}'",
                   help="PromQL label matchers choosing the replicas, e.g. "
                   "'{model_name=\"llama\",namespace=\"prod\"}' (=, !=, =~, !~); their "
                   "series are summed (default: every vLLM series)")
    p.add_argument("--bearer-token-file", metavar="FILE", default=None,
                   help="a file whose first line is the bearer token (else env "
                   "AUTOTUNE_PROMETHEUS_BEARER_TOKEN or AUTOTUNE_PROMETHEUS_BEARER_TOKEN_FILE)")
    p.add_argument("--basic-auth-file", metavar="FILE", default=None,
                   help="a file whose first line is 'user:password' (else env "
                   "AUTOTUNE_PROMETHEUS_USERNAME and AUTOTUNE_PROMETHEUS_PASSWORD(_FILE)); "
                   "credentials are never taken on the command line")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds to wait for each query (default 60)")


def client_from_args(url: str, args: argparse.Namespace) -> PrometheusClient:
    from autotune.traffic import PrometheusClient as Client
    from autotune.traffic import auth_from_env, normalize_selector

    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 (got {args.timeout})")
    normalize_selector(args.selector)  # a bad selector is an error before any query
    auth = auth_from_env(bearer_token_file=args.bearer_token_file,
                         basic_auth_file=args.basic_auth_file)
    return Client(url, auth=auth, timeout_s=args.timeout)


def register(ssub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    fp = ssub.add_parser(
        "from-prometheus",
        help="fit a shape from vLLM's series stored in Prometheus (every replica, any range)",
        description=(
            "Fit the shape of the traffic that the vLLM servers matching --selector served "
            "between --since and --until, from their series in Prometheus (or anything that "
            "speaks its HTTP query API: Thanos, Mimir, VictoriaMetrics, a Grafana data "
            "source proxy), summed over the replicas: lengths from the increase of the "
            "prompt/generation token histograms (with the precision their buckets allow), "
            "rate and burstiness from the request counter per 60 s window, concurrency, "
            "prefix-cache sharing. Counter resets (a replica restarted) and gaps (a replica "
            "down, scrapes missed) are reported. The shape records the URL, the selector, "
            "the range and the queries. Credentials: a bearer token or basic auth from the "
            "environment or a file, never on the command line. Exit 2 when Prometheus is "
            "unreachable, the selector matches nothing, or the range has no data. See "
            "docs/traffic.md section 10."
        ),
    )
    fp.add_argument("url", metavar="URL", help="Prometheus' base URL, e.g. "
                    "http://prometheus:9090 (its API is URL/api/v1/...)")
    fp.add_argument("--since", default="7d",
                    help="range start: a duration back from --until (7d, 6h, 30m), an ISO "
                    "8601 time or a unix time (default 7d)")
    fp.add_argument("--until", default="now",
                    help="range end: now, a duration back from now, an ISO 8601 time or a "
                    "unix time (default now)")
    add_connection_args(fp)
    fp.add_argument("-o", "--output", metavar="OUT.json", required=True,
                    help="where to write the shape")
    fp.add_argument("--name", default=None, help="the shape's name (default: the file stem)")
    fp.add_argument("--json", action="store_true",
                    help="print the shape's summary and the fit's report as JSON")
    fp.add_argument("--quiet", action="store_true", help="no progress lines")
    fp.set_defaults(func=_from_prometheus)


def resolve_range(since: str, until: str, *, now: float | None = None) -> tuple[float, float]:
    """--since/--until -> (start, end) unix seconds; a duration --since counts back from
    --until."""
    now = time.time() if now is None else now
    end = parse_time(until, now=now, what="--until")
    ago = _duration(since)
    start = end - ago if ago is not None else parse_time(since, now=now, what="--since")
    if not end > start:
        raise ConfigError(f"--since ({since}) must be before --until ({until})")
    return start, end


def report_lines(fit: PrometheusFit) -> list[str]:
    """What the user should know about a fit: burstiness, restarts, gaps, clipping."""
    a = fit.shape.arrivals
    lines = []
    if a is not None:
        disp = (f"dispersion per 60 s {a.dispersion_60s:.3g} (1 = Poisson)"
                if a.dispersion_60s is not None else "no dispersion (needs 2 full 60 s "
                "windows)")
        lines.append(f"  arrivals: {disp}, peak {a.peak_rate_rps:.3g} req/s over "
                     f"{fit.windows} window(s) of {a.window_s:g} s ({fit.window_arrivals:.0f} "
                     f"of {fit.arrivals:.0f} arrivals in full windows)")
    for note in fit.clipped:
        lines.append(f"  range: {note}")
    for r in fit.resets:
        lines.append(f"  restart: {r} (handled: increase() counts across it)")
    if fit.gaps:
        lines.append(f"  gaps: {len(fit.gaps)} window(s) where a replica was missing or "
                     "scrapes were missed (their counts are what was scraped):")
        lines += [f"    {g}" for g in fit.gaps[:10]]
        if len(fit.gaps) > 10:
            lines.append(f"    ... and {len(fit.gaps) - 10} more")
    if fit.failed_requests:
        lines.append(f"  {fit.failed_requests} request(s) ended aborted or with an error "
                     "(vllm:request_success_total)")
    return lines


def _from_prometheus(args: argparse.Namespace) -> int:
    import json

    from autotune.traffic import fit_prometheus, save_shape

    out = Path(args.output)
    client = client_from_args(args.url, args)
    start, end = resolve_range(args.since, args.until)
    sel = args.selector or "{}"
    if not args.quiet:
        print(f"querying {client.url} for vLLM series {sel} from "
              f"{datetime.fromtimestamp(start, UTC):%Y-%m-%d %H:%M:%S} to "
              f"{datetime.fromtimestamp(end, UTC):%Y-%m-%d %H:%M:%S} UTC ...", file=sys.stderr)
    fit = fit_prometheus(client, start=start, end=end, selector=args.selector,
                         name=args.name or out.stem)
    shape = fit.shape
    save_shape(shape, out)
    if args.json:
        print(json.dumps({"shape": shape.summary(), "output": str(out),
                          "replicas": fit.replicas, "resets": fit.resets, "gaps": fit.gaps,
                          "range_clipped": fit.clipped, "windows": fit.windows,
                          "scrape_interval_s": fit.scrape_interval_s,
                          "failed_requests": fit.failed_requests}, indent=2))
        return 0
    p = shape.precision
    rate_prec = f", rate within {p.rate:.1%}" if p is not None and p.rate is not None else ""
    prec = (f"; lengths within W1/mean {p.input_tokens:.2g} (input) and {p.output_tokens:.2g}"
            f" (output) of the true ones{rate_prec}" if p is not None else "")
    print(f"fitted {shape.requests} requests over {shape.duration_s:.0f} s "
          f"({shape.rate_rps:.3g} req/s) from {len(fit.replicas)} replica series at "
          f"{client.url} {sel} -> {out} [fingerprint {shape.fingerprint}]{prec}")
    i, o = shape.input_tokens, shape.output_tokens
    print(f"  prompt tokens mean {i.mean:.4g} p50 {i.p50:.4g} p99 {i.p99:.4g}; output tokens "
          f"mean {o.mean:.4g} p50 {o.p50:.4g} p99 {o.p99:.4g}")
    for line in report_lines(fit):
        print(line)
    return 0
