"""``autotune shape fit|show|diff|clip``: traffic shapes from recorded traffic."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError

_FORMATS = ("openai_log", "azure", "burstgpt", "mooncake")

EXIT_SAME = 0
EXIT_DRIFTED = 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    shape = sub.add_parser(
        "shape",
        help="fit, show and compare traffic shapes from recorded traffic",
        description=(
            "A traffic shape is the statistics of recorded traffic (length distributions, "
            "their correlation, arrival rate and burstiness, concurrency, prefix sharing) "
            "plus a default replay load. See docs/traffic.md."
        ),
    )
    ssub = shape.add_subparsers(dest="shape_command", metavar="SUBCOMMAND", required=True)

    fit = ssub.add_parser(
        "fit",
        help="fit a shape from a trace file and save it as JSON",
        description=(
            "Read a recorded-traffic file (an OpenAI-style request log, an Azure LLM inference "
            "trace, BurstGPT or Mooncake; gzip is fine), fit its shape and write it as JSON. "
            "Failed or zero-token requests are counted and left out."
        ),
    )
    fit.add_argument("trace", metavar="FILE", help="the trace file (CSV or JSONL)")
    fit.add_argument(
        "-o",
        "--output",
        metavar="OUT.json",
        help="where to write the shape (default: traffic/<FILE stem>.json)",
    )
    fit.add_argument(
        "--format",
        choices=_FORMATS,
        default=None,
        help="the trace format (default: detected from the first line)",
    )
    fit.add_argument(
        "--skip-bad",
        action="store_true",
        help="leave out malformed lines (and report how many) instead of stopping at the first",
    )
    fit.add_argument("--name", help="the shape's name (default: the file stem)")
    fit.add_argument(
        "--mode",
        choices=("open", "closed"),
        default="open",
        help="default replay: open loop (recorded arrivals; default) or closed loop (streams)",
    )
    fit.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="default replay streams (closed loop; required with --mode closed) or the cap "
        "on requests in flight (open loop)",
    )
    fit.add_argument(
        "--requests",
        type=int,
        default=None,
        help="how many requests a replay sends by default (default: min(records, 1000))",
    )
    fit.add_argument(
        "--rate",
        type=float,
        default=None,
        help="default open-loop rate in requests/s (default: the recorded rate)",
    )
    fit.set_defaults(func=_fit)

    show = ssub.add_parser(
        "show",
        help="print a shape's statistics",
        description="Print the headline statistics of a shape file (or traffic/<NAME>.json).",
    )
    show.add_argument("shape", metavar="SHAPE", help="a shape JSON file, or a name in traffic/")
    show.add_argument("--json", action="store_true", help="print JSON instead of text")
    show.add_argument(
        "--plots",
        metavar="DIR",
        default=None,
        help="also write PNG plots (length histograms, arrival rate over time) to DIR",
    )
    show.set_defaults(func=_show)

    diff = ssub.add_parser(
        "diff",
        help="compare two shapes: same or drifted",
        description=(
            "Compare shape A (e.g. the one the current config was tuned for) with shape B "
            "(e.g. today's traffic), dimension by dimension, against the thresholds in "
            "docs/traffic.md. Exit status: 0 = same, 1 = drifted, 2 = error."
        ),
    )
    diff.add_argument("a", metavar="A", help="the reference shape (file or name in traffic/)")
    diff.add_argument("b", metavar="B", help="the shape to compare with it")
    diff.add_argument("--json", action="store_true", help="print JSON instead of text")
    diff.set_defaults(func=_diff)

    clip = ssub.add_parser(
        "clip",
        help="clip or scale a shape's lengths, or scale its replay rate",
        description=(
            "Write a copy of SHAPE whose prompt/output lengths are multiplied by "
            "--scale-lengths and then capped (--max-input-tokens, --max-output-tokens), "
            "and/or whose open-loop replay rate is multiplied by --rate-scale. Use it when "
            "the traffic does not fit the model's context or the server's capacity (the "
            "tuner says so before or during trial 0). Changed lengths give the copy a new "
            "fingerprint and name; a rate scale changes only its replay load."
        ),
    )
    clip.add_argument("shape", metavar="SHAPE", help="a shape JSON file, or a name in traffic/")
    clip.add_argument("-o", "--out", required=True, type=Path, help="where to write the copy")
    clip.add_argument("--max-input-tokens", type=int, default=None,
                      help="cap every prompt at this many tokens")
    clip.add_argument("--max-output-tokens", type=int, default=None,
                      help="cap every output at this many tokens")
    clip.add_argument("--max-total-tokens", type=int, default=None, metavar="CONTEXT",
                      help="fit a context: cap outputs at their p99 (at most CONTEXT/2) and "
                      "prompts at CONTEXT minus that")
    clip.add_argument("--scale-lengths", type=float, default=1.0, metavar="F",
                      help="multiply every length by F before capping (default 1)")
    clip.add_argument("--rate-scale", type=float, default=1.0, metavar="F",
                      help="multiply the open-loop replay rate by F (0.5 = half the rate)")
    clip.add_argument("--name", default=None, help="the copy's name (default NAME-clipped)")
    clip.set_defaults(func=_clip)


def _resolve(ref: str) -> Path:
    """A shape path; a bare name falls back to traffic/<name>.json."""
    p = Path(ref)
    if not p.exists() and p.suffix == "" and len(p.parts) == 1:
        candidate = Path("traffic") / f"{ref}.json"
        if candidate.exists():
            return candidate
    return p


def _fit(args: argparse.Namespace) -> int:
    from autotune.traffic import LoadSpec, fit_shape, read_trace, save_shape

    if args.mode == "closed" and args.concurrency is None:
        raise ConfigError("--mode closed needs --concurrency N (the number of streams)")
    for opt, v in (("--concurrency", args.concurrency), ("--requests", args.requests)):
        if v is not None and v < 1:
            raise ConfigError(f"{opt} must be >= 1 (got {v})")
    if args.rate is not None and not args.rate > 0:
        raise ConfigError(f"--rate must be > 0 (got {args.rate})")
    records = read_trace(args.trace, format=args.format, skip_bad=args.skip_bad)
    load = LoadSpec(
        mode=args.mode,
        concurrency=args.concurrency,
        rate_rps=args.rate,
        requests=args.requests or min(len(records), 1000),
    )
    shape = fit_shape(records, name=args.name, load=load)
    out = Path(args.output) if args.output else Path("traffic") / f"{Path(args.trace).stem}.json"
    save_shape(shape, out)
    print(
        f"fitted {shape.requests} requests over {shape.duration_s:.1f} s "
        f"({shape.rate_rps:.3g} req/s) from {args.trace} ({records.format}) -> {out} "
        f"[fingerprint {shape.fingerprint}]"
    )
    if records.failed:
        print(f"left out {records.failed} failed or zero-token request(s)")
    if records.skipped:
        print(f"skipped {records.skipped} bad line(s):", file=sys.stderr)
        for ex in records.skipped_examples:
            print(f"  line {ex.line}: {ex.reason}", file=sys.stderr)
        if records.skipped > len(records.skipped_examples):
            print(
                f"  ... and {records.skipped - len(records.skipped_examples)} more", file=sys.stderr
            )
    return 0


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _show(args: argparse.Namespace) -> int:
    from autotune.traffic import load_shape, write_plots

    shape = load_shape(_resolve(args.shape))
    summary = shape.summary()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"shape {shape.name}  [fingerprint {shape.fingerprint}]")
        if shape.rate_rps > 0:
            print(
                f"  requests      {shape.requests:,} over {_fmt(shape.duration_s)} s, "
                f"{_fmt(shape.rate_rps)} req/s (peak {_fmt(summary['peak_rate_rps'])})"
            )
        else:
            print(
                f"  requests      {shape.requests:,} (no arrival times: replay it closed "
                "loop or give an open-loop rate)"
            )
        for key in ("input_tokens", "output_tokens"):
            d = summary[key]
            print(
                f"  {key:<13} mean {_fmt(d['mean'])}  p50 {_fmt(d['p50'])}  "
                f"p90 {_fmt(d['p90'])}  p99 {_fmt(d['p99'])}  max {_fmt(d['max'])}"
            )
        if shape.correlation is not None:
            print(
                f"  correlation   spearman {_fmt(summary['correlation_spearman'])} "
                "(input vs output length)"
            )
        if shape.arrivals is not None:
            print(
                f"  burstiness    inter-arrival CV {_fmt(summary['interarrival_cv'])}, "
                f"dispersion per 60 s {_fmt(summary['dispersion_60s'])} (1 = Poisson)"
            )
        if shape.concurrency is not None:
            print(
                f"  concurrency   ~{_fmt(shape.concurrency.mean)} in flight "
                f"({shape.concurrency.method})"
            )
        if shape.prefix is not None:
            print(
                f"  prefixes      {shape.prefix.shared_token_fraction:.1%} of prompt tokens "
                f"cacheable ({shape.prefix.source})"
            )
        ld = shape.load
        target = (
            f"{ld.concurrency} streams"
            if ld.mode == "closed"
            else (f"{_fmt(ld.rate_rps)} req/s" if ld.rate_rps else "recorded rate")
        )
        print(f"  replay        {ld.mode} loop, {target}, {ld.requests} requests")
    if args.plots:
        for path in write_plots(shape, args.plots):
            print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _clip(args: argparse.Namespace) -> int:
    from autotune.traffic import clip_shape, load_shape, save_shape

    shape = load_shape(_resolve(args.shape))
    max_in, max_out = args.max_input_tokens, args.max_output_tokens
    if args.max_total_tokens is not None:
        ctx = args.max_total_tokens
        if ctx < 2:
            raise ConfigError(f"--max-total-tokens must be >= 2 (got {ctx})")
        out_cap = int(min(ctx // 2, max(1.0, shape.output_tokens.p99 * args.scale_lengths)))
        max_out = min(max_out or out_cap, out_cap)
        max_in = min(max_in or ctx - max_out, ctx - max_out)
    new = clip_shape(shape, max_input_tokens=max_in, max_output_tokens=max_out,
                     scale_lengths=args.scale_lengths, rate_scale=args.rate_scale,
                     name=args.name)
    save_shape(new, args.out)
    i, o = new.input_tokens, new.output_tokens
    print(f"wrote {args.out}: shape {new.name} [fingerprint {new.fingerprint}], prompts p50 "
          f"{_fmt(i.p50)} p99 {_fmt(i.p99)} max {_fmt(i.max)}, outputs p50 {_fmt(o.p50)} "
          f"p99 {_fmt(o.p99)} max {_fmt(o.max)}, replay time scale {_fmt(new.load.time_scale)}")
    return 0


def _diff(args: argparse.Namespace) -> int:
    from autotune.traffic import diff_shapes, load_shape

    a = load_shape(_resolve(args.a))
    b = load_shape(_resolve(args.b))
    d = diff_shapes(a, b)
    if args.json:
        print(json.dumps(d.to_dict(), indent=2))
    else:
        print(
            f"{d.verdict}: {a.name} -> {b.name} (distance {d.distance:.3g}; "
            f"<= 1 on every dimension is 'same')"
        )
        for name, dim in d.dimensions.items():
            dist = "n/a" if dim.distance is None else f"{dim.distance:.4g}"
            flag = "DRIFTED" if dim.drifted else ("ok" if dim.distance is not None else "-")
            print(
                f"  {name:<15} {dim.metric:<32} {dist:>9} (threshold {dim.threshold:.3g})  {flag}"
            )
    return EXIT_DRIFTED if d.verdict == "drifted" else EXIT_SAME
