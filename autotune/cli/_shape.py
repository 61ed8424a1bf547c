"""``autotune shape fit|show|diff|clip``: traffic shapes from recorded traffic."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.cli import _from_prometheus
from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.traffic import SessionStats

_FORMATS = ("openai_log", "azure", "burstgpt", "mooncake", "multi_turn")

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
            "trace, BurstGPT, Mooncake or a multi-turn trace with chat_id/parent_chat_id; gzip "
            "is fine), fit its shape and write it as JSON. Failed or zero-token requests are "
            "counted and left out. Where the trace links turns of one conversation "
            "(session_id, parent_chat_id, or hash_ids that extend an earlier request's), the "
            "shape gets a sessions section: turns, think time, context growth."
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
    _register_from_metrics(ssub)
    _from_prometheus.register(ssub)
    _register_clip(ssub)


def _register_from_metrics(ssub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    fm = ssub.add_parser(
        "from-metrics",
        help="build a shape from a running vLLM server's /metrics",
        description=(
            "Sample a running vLLM server's /metrics for --duration and build the shape of "
            "the traffic it served meanwhile, from histogram and counter deltas: lengths "
            "from the bucket counts of vllm:request_prompt_tokens / "
            "vllm:request_generation_tokens (coarser than a log: the bound is stored in the "
            "shape's 'precision' and 'shape diff' widens its length thresholds by it), "
            "arrival rate and burstiness from request counts per scrape interval, prefix "
            "sharing from the prefix-cache hit counters. Exit 2 when the endpoint is "
            "unreachable, not vLLM, or served no request in the window. See docs/traffic.md."
        ),
    )
    fm.add_argument("url", metavar="URL", help="the server, e.g. http://localhost:8000 "
                    "(or its /metrics URL)")
    fm.add_argument("--duration", default="10m", type=parse_duration,
                    help="how long to sample: 90, 90s, 10m, 1h (default 10m); burstiness "
                    "(dispersion per 60 s) needs at least 2m")
    fm.add_argument("--interval", default=None, type=parse_duration,
                    help="scrape interval (default: duration/20, between 0.5 s and 10 s)")
    fm.add_argument("-o", "--output", metavar="OUT.json", required=True,
                    help="where to write the shape")
    fm.add_argument("--name", default=None, help="the shape's name (default: the file stem)")
    fm.add_argument("--request-log", metavar="LOG", default=None,
                    help="the server's log with --enable-log-requests: arrival times from "
                    "its 'Received request' lines (1 s resolution) instead of per-interval "
                    "counts (gives the inter-arrival CV too)")
    fm.add_argument("--quiet", action="store_true", help="no progress lines")
    fm.set_defaults(func=_from_metrics)


def _register_clip(ssub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
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
    clip.add_argument("--scale-input", type=float, default=1.0, metavar="F",
                      help="multiply only the prompt lengths (and shared-prefix lengths) by F "
                      "before capping, e.g. 0.125 for prompts 8x longer than the context "
                      "serves; outputs keep their lengths (default 1)")
    clip.add_argument("--scale-output", type=float, default=1.0, metavar="F",
                      help="multiply only the output lengths by F before capping (default 1)")
    clip.add_argument("--rate-scale", type=float, default=1.0, metavar="F",
                      help="multiply the open-loop replay rate by F (0.5 = half the rate)")
    clip.add_argument("--name", default=None, help="the copy's name (default NAME-clipped)")
    clip.set_defaults(func=_clip)


def parse_duration(text: str) -> float:
    """'90', '90s', '10m', '1.5h' -> seconds (> 0)."""
    t = str(text).strip().lower()
    mult = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(t[-1:], None)
    num = t[:-1] if mult is not None else t
    try:
        v = float(num) * (mult or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration; write e.g. 90, 90s, 10m or 1h") from None
    if not (v > 0 and v < float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r}: a duration must be > 0")
    return v


def _clock(seconds: float) -> str:
    m, sec = divmod(round(seconds), 60)
    return f"{m}:{sec:02d}"


def progress_printer(
    duration_s: float, *, prefix: str = ""
) -> Callable[[float, int, float], None]:
    """A progress callback printing '[elapsed / total] samples, requests finished' to stderr
    (rewritten in place on a terminal, a line per ~10 % otherwise)."""
    tty = sys.stderr.isatty()
    step = [0]

    def show(elapsed: float, samples: int, finished: float) -> None:
        line = (f"{prefix}[{_clock(elapsed)} / {_clock(duration_s)}] {samples} samples, "
                f"{finished:.0f} requests finished")
        if tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
            if elapsed >= duration_s - 1e-6:
                print(file=sys.stderr)
        elif int(10 * elapsed / duration_s) > step[0] or elapsed >= duration_s - 1e-6:
            step[0] = int(10 * elapsed / duration_s)
            print(line, file=sys.stderr, flush=True)

    return show


def _from_metrics(args: argparse.Namespace) -> int:
    from autotune.traffic import save_shape
    from autotune.watch import metrics_url, sample_shape

    url = metrics_url(args.url)
    out = Path(args.output)
    if args.request_log and not Path(args.request_log).is_file():
        raise ConfigError(f"--request-log {args.request_log}: no such file")
    if not args.quiet:
        print(f"sampling {url} for {_clock(args.duration)} ...", file=sys.stderr)
    shape = sample_shape(
        url=args.url, duration_s=args.duration, interval_s=args.interval,
        name=args.name or out.stem,
        on_progress=None if args.quiet else progress_printer(args.duration),
        request_log=args.request_log,
    )
    save_shape(shape, out)
    prec = shape.precision
    bound = (f"; lengths within W1/mean {prec.input_tokens:.2g} (input) and "
             f"{prec.output_tokens:.2g} (output) of the true ones" if prec else "")
    print(
        f"built from {shape.requests} requests over {shape.duration_s:.0f} s "
        f"({shape.rate_rps:.3g} req/s) at {url} -> {out} [fingerprint {shape.fingerprint}]"
        f"{bound}"
    )
    return 0


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
    if records.links_cut:  # --skip-bad re-rooted turns whose parent is missing
        cut = records.links_cut
        print(f"cut {len(cut)} session link(s): a turn whose parent_chat_id no turn has starts "
              f"a session of its own (--skip-bad); line(s) "
              f"{', '.join(map(str, cut[:5]))}{' ...' if len(cut) > 5 else ''}", file=sys.stderr)
    if records.skipped:
        print(f"skipped {records.skipped} bad line(s):", file=sys.stderr)
        for ex in records.skipped_examples:
            print(f"  line {ex.line}: {ex.reason}", file=sys.stderr)
        if records.skipped > len(records.skipped_examples):
            print(
                f"  ... and {records.skipped - len(records.skipped_examples)} more", file=sys.stderr
            )
    return 0


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _show_sessions(s: SessionStats) -> None:
    print(
        f"  sessions      {s.sessions:,} ({_fmt(s.rate_sps)} /s), turns per session mean "
        f"{_fmt(s.turns.mean)} p99 {_fmt(s.turns.p99)} max {_fmt(s.turns.max)}, "
        f"{s.multi_turn_fraction:.1%} multi-turn ({s.source})"
    )
    if s.new_tokens is None or s.context_growth is None or s.think_time_s is None:
        return
    print(
        f"  turn tokens   first prompt mean {_fmt(s.first_turn_tokens.mean)}, new per turn "
        f"mean {_fmt(s.new_tokens.mean)}, context growth per turn mean "
        f"{_fmt(s.context_growth.mean)}"
    )
    basis = "after the answer" if s.think_time_basis == "answer" else "between arrivals"
    flight = "-" if s.in_flight_fraction is None else f"{s.in_flight_fraction:.1%}"
    print(
        f"  think time    p50 {_fmt(s.think_time_s.p50)} s, mean {_fmt(s.think_time_s.mean)} s, "
        f"p90 {_fmt(s.think_time_s.p90)} s ({basis})"
    )
    quick = "-" if s.quick_chain_fraction is None else f"{s.quick_chain_fraction:.1%}"
    print(
        f"  agents        quick chains (< 1 s) {quick}, sent before the answer {flight}, "
        f"fan-out {s.fanout_fraction:.1%} (max {s.max_fanout})"
    )
    p = s.shared_prefix
    if p is not None:
        print(f"  across sessions  {p.sharing_request_fraction:.1%} of first prompts share a "
              f"prefix with other sessions' ({p.groups} group(s)); "
              f"{p.shared_token_fraction:.1%} of first-prompt tokens a cache serves")


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
            what = ("hit the server's prefix cache" if shape.prefix.source == "server_cache"
                    else "cacheable")
            print(
                f"  prefixes      {shape.prefix.shared_token_fraction:.1%} of prompt tokens "
                f"{what} ({shape.prefix.source})"
            )
        if shape.sessions is not None:
            _show_sessions(shape.sessions)
        if shape.precision is not None:
            print(
                f"  precision     lengths within W1/mean {shape.precision.input_tokens:.2g} "
                f"(input), {shape.precision.output_tokens:.2g} (output) of the true ones "
                f"({shape.source.format if shape.source else 'coarse source'})"
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
        out_cap = int(min(ctx // 2, max(1.0, shape.output_tokens.p99 * args.scale_lengths
                                        * args.scale_output)))
        max_out = min(max_out or out_cap, out_cap)
        max_in = min(max_in or ctx - max_out, ctx - max_out)
    new = clip_shape(shape, max_input_tokens=max_in, max_output_tokens=max_out,
                     scale_lengths=args.scale_lengths, rate_scale=args.rate_scale,
                     name=args.name, scale_input=args.scale_input,
                     scale_output=args.scale_output)
    save_shape(new, args.out)
    i, o = new.input_tokens, new.output_tokens
    print(f"wrote {args.out}: shape {new.name} [fingerprint {new.fingerprint}], prompts p50 "
          f"{_fmt(i.p50)} p99 {_fmt(i.p99)} max {_fmt(i.max)}, outputs p50 {_fmt(o.p50)} "
          f"p99 {_fmt(o.p99)} max {_fmt(o.max)}, replay time scale {_fmt(new.load.time_scale)}")
    p, was = new.prefix, shape.prefix
    if p is not None and was is not None and (p.shared_token_fraction, p.block_tokens) != (
            was.shared_token_fraction, was.block_tokens):
        block = f", hash block {was.block_tokens} -> {p.block_tokens} tokens" if (
            p.block_tokens is not None) else ""
        print(f"  prefixes: {was.shared_token_fraction:.1%} -> {p.shared_token_fraction:.1%} "
              f"of prompt tokens cacheable{block}")
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
        for note in d.notes:
            print(f"  note: {note}")
    return EXIT_DRIFTED if d.verdict == "drifted" else EXIT_SAME
