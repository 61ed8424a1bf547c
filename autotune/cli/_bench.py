"""``autotune bench``: measure one configuration carefully (start, warm up, repeats, stop)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "bench",
        help="measure one vLLM configuration under a traffic shape (repeats, noise estimate)",
        description=(
            "Start a vLLM server with the given flags, warm it up, replay the traffic shape "
            "REPEATS times on the same server, and report the median with its dispersion "
            "(CV across repeats), latency percentiles and the server's own figures. Engine "
            "flags go after '--' or in --flag (repeatable): "
            "autotune bench --model M --shape S --repeats 3 -- --max-num-seqs 64"
        ),
    )
    p.add_argument("--model", required=True, type=Path, help="local model directory")
    p.add_argument("--shape", required=True, type=Path, help="traffic shape JSON")
    p.add_argument("--flag", action="append", default=[], metavar="FLAGS",
                   help="engine flag(s), e.g. --flag='--max-num-seqs 64' (repeatable)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the server, e.g. OMP_NUM_THREADS=1")
    p.add_argument("--repeats", type=int, default=3,
                   help="measured replays on the same server (default 3)")
    p.add_argument("--warmup-requests", type=int, default=None,
                   help="warm-up requests first (default 2 x concurrency)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per replay (default: the shape's load.requests)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="closed-loop streams (default: the shape's)")
    p.add_argument("--api", choices=("completions", "chat"), default="completions")
    p.add_argument("--slo", default=None, help="goodput thresholds, e.g. ttft_p99=2,tpot_p99=0.05")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--log", type=Path, default=None, help="keep the server log here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-kv-cache-gib", type=float, default=1.0)
    p.add_argument("--json", action="store_true", help="print the measurement as JSON")
    p.add_argument("engine_flags", nargs=argparse.REMAINDER,
                   help="engine flags after '--'")
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from autotune.config import parse_slo
    from autotune.errors import ConfigError
    from autotune.study import goodput_slo
    from autotune.traffic import load_shape
    from autotune.trial import TrialSpec, run_trial

    flags: list[str] = []
    for f in args.flag:
        flags += shlex.split(f)
    rest = list(args.engine_flags)
    if rest and rest[0] == "--":
        rest = rest[1:]
    flags += rest
    env: dict[str, str] = {}
    for item in args.env:
        if "=" not in item:
            raise ConfigError(f"--env {item!r} is not KEY=VALUE")
        k, v = item.split("=", 1)
        env[k] = v
    if args.repeats < 1:
        raise ConfigError("--repeats must be >= 1")
    if not (args.model / "config.json").exists():
        raise ConfigError(f"--model {args.model}: no config.json there")
    shape = load_shape(args.shape)
    log_dir = None
    if args.log is not None:
        args.log.parent.mkdir(parents=True, exist_ok=True)
        log_dir = str(args.log.parent)
    spec = TrialSpec(
        number=0, model=str(args.model.resolve()), flags=tuple(flags), env=env, shape=shape,
        seed=args.seed, warmup_requests=args.warmup_requests, repeats=args.repeats,
        slo=goodput_slo(parse_slo(args.slo)), api=args.api,
        num_requests=args.num_requests, concurrency=args.concurrency,
        start_timeout_s=args.start_timeout, log_dir=log_dir,
        cpu_kv_cache_gib=args.cpu_kv_cache_gib,
    )  # fmt: skip
    print(f"benchmarking: {' '.join(flags) or '(vLLM defaults)'} x {args.repeats} repeats",
          file=sys.stderr)
    outcome = run_trial(spec)
    if args.log is not None and outcome.log_path and Path(outcome.log_path) != args.log:
        Path(outcome.log_path).replace(args.log)
    if args.json:
        print(json.dumps({"ok": outcome.ok, "reason": outcome.reason, "flags": flags,
                          "env": env, "start_s": outcome.start_s,
                          "measurement": outcome.measurement, "metrics": outcome.metrics,
                          "message": outcome.message if not outcome.ok else ""}, indent=2))
        return 0 if outcome.ok else 1
    if not outcome.ok:
        print(f"failed ({outcome.reason}): {outcome.message}", file=sys.stderr)
        return 1
    m = outcome.metrics
    print(f"started in {outcome.start_s:.1f} s; {int(m.get('n_requests', 0))} requests per "
          f"repeat, {int(m.get('n_errors', 0))} failed")
    print(f"output tokens/s  {m['output_tokens_per_s']:,.1f}  (CV {m.get('cv', float('nan')):.1%}"
          f" across {'repeats' if args.repeats > 1 else 'sub-windows'})")
    print(f"requests/s       {m.get('requests_per_s', float('nan')):,.2f}   goodput "
          f"{m.get('goodput_rps', float('nan')):,.2f}")
    if "server_prompt_tokens" in m:
        print(f"prompt tokens    server {int(m['server_prompt_tokens']):,} / shape "
              f"{int(m['shape_prompt_tokens']):,} per replay ({args.api} API)")
    for name in ("ttft", "tpot", "itl", "e2e"):
        p50, p99 = m.get(f"{name}_p50_s"), m.get(f"{name}_p99_s")
        if p50 is not None and p99 is not None:
            print(f"{name.upper():<5} p50 {p50 * 1000:9.1f} ms   p99 {p99 * 1000:9.1f} ms")
    return 0
