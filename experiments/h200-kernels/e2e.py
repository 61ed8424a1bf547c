"""The end-to-end table: what tuned fused-MoE configs buy a whole server, with intervals.
The benches' plan and arguments (experiments/h200-kernels/README.md), and the table maker.

    python3 e2e.py args BASE STREAMS            a config's `autotune bench` arguments, one a
                                                line (--env K=V lines, then '--', then flags)
    python3 e2e.py plan [--rounds N] STREAMS... -- BASE...
                                                the benches of the step, in order: one line
                                                "STREAMS BASE VARIANT ROUND" each (N: 2)
    python3 e2e.py table RESULTS_DIR            e2e.md and e2e.csv from RESULTS_DIR/e2e/*.json
                                                (e2e.md also: MTP recipe / defaults per tiles)

BASE: `defaults` (vLLM's own: the space's baseline, as a study's trial 0 runs it) or
`recipe` (experiments/h200/recipe.json, the case study's MTP recipe, as a study runs it).
VARIANT: `plain` (no tuned folder: vLLM's built-in default tiles, as on the H200 today) or
`tuned` (VLLM_TUNED_CONFIG_FOLDER = the folder `autotune kernels moe` wrote). Each pair is
measured over rounds (two by default) in alternating order (plain, tuned, then tuned, plain),
every cell's first start before any cell's second, each bench a
fresh server with the trust issue's measurement (segmented warm-up, adaptive stop, the 95 %
interval of output tokens/s); the table's ratio tuned / plain pools the start-to-start
variance of both (autotune.measure.ratio_to_defaults: delta method on log readings), so its
interval covers a start's variation, not only a run's.

A bench's result file: e2e/c<STREAMS>-<BASE>-<VARIANT>-r<ROUND>.json (`autotune bench
--json`). Standard library at import; autotune is imported where a subcommand needs it.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SHAPE = "traffic/casestudy-512x512.json"
SPACE = "search_spaces/hybrid-mtp.yaml"
BASES = ("defaults", "recipe")
VARIANTS = ("plain", "tuned")


def bench_args(base: str, streams: int, gpu_arch: str = "sm90") -> list[str]:
    """`autotune bench` arguments for BASE at STREAMS: --env lines, '--', engine flags, as
    the space renders them for this shape (stand-in flags, derived flags included); the
    space's moe_config knob is left at `default`: the tuned folder is the variant's env."""
    from autotune.space import ModelFacts, load_space
    from autotune.study import _complete_params
    from autotune.traffic import load_shape

    if base not in BASES:
        raise SystemExit(f"unknown base {base!r}; bases: {', '.join(BASES)}")
    shape = load_shape(REPO / SHAPE)
    facts = ModelFacts.from_model_dir(REPO / "experiments" / "h200" / "model", device="cuda",
                                      gpu_arch=gpu_arch)
    sp = load_space(REPO / SPACE, facts=facts.with_traffic(
        streams=streams, prompt_p90=shape.input_tokens.p90))
    if base == "defaults":
        ls = sp.launch_spec(sp.baseline_params(), baseline=True)
    else:
        recipe = json.loads((REPO / "experiments" / "h200" / "recipe.json").read_text())
        ls = sp.launch_spec(_complete_params(sp, {**recipe, "moe_config": "default"}, "recipe"))
    return [f"--env={k}={v}" for k, v in ls.env.items()] + ["--", *ls.flags]


def plan(streams: list[int], bases: list[str], rounds: int = 2) -> list[str]:
    """The step's benches in order, round by round (a budget that ends early leaves every
    cell with one start rather than some cells with two and others with none): in round 1
    each (streams, base) pair runs plain then tuned, in round 2 tuned then plain (a drift
    over the session hits both variants alike), and so on."""
    for b in bases:
        if b not in BASES:
            raise SystemExit(f"unknown base {b!r}; bases: {', '.join(BASES)}")
    if rounds < 1:
        raise SystemExit(f"rounds must be at least 1, got {rounds}")
    out = []
    for r in range(1, rounds + 1):
        order = VARIANTS if r % 2 else VARIANTS[::-1]
        for s in streams:
            for b in bases:
                out += [f"{s} {b} {v} {r}" for v in order]
    return out


def _reading(p: Path) -> dict[str, Any] | None:
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    m = d.get("measurement") or {} if isinstance(d, dict) else {}
    v = m.get("output_tokens_per_s")
    if not d.get("ok") or not isinstance(v, (int, float)) or v <= 0:
        return None
    return {"value": float(v), "low": m.get("output_tokens_per_s_ci_low"),
            "high": m.get("output_tokens_per_s_ci_high"), "start_s": d.get("start_s"),
            "measure_s": d.get("measure_s")}


def _readings(results: Path) -> dict[tuple[int, str], dict[str, list[dict[str, Any]]]]:
    """(streams, base) -> variant -> the readings of its successful benches, by round."""
    found: dict[tuple[int, str], dict[str, list[dict[str, Any]]]] = {}
    for p in sorted((results / "e2e").glob("c*-*-*-r*.json")):
        parts = p.stem.split("-")
        if len(parts) != 4 or parts[2] not in VARIANTS:
            continue
        r = _reading(p)
        if r is None:
            continue
        key = (int(parts[0][1:]), parts[1])
        found.setdefault(key, {v: [] for v in VARIANTS})[parts[2]].append(r)
    return found


def _ratio(num: list[dict[str, Any]], den: list[dict[str, Any]]) -> dict[str, Any]:
    """num / den with its 95 % interval (autotune.measure.ratio_to_defaults: between-start
    variance pooled from two starts on; with one start each, the runs' own intervals)."""
    from autotune.measure import Interval, ratio_to_defaults

    if not num or not den:
        return {"ratio": None, "ci_low": None, "ci_high": None, "method": None}

    def within(rs: list[dict[str, Any]]) -> Interval | None:
        r = rs[0]
        return (Interval(r["value"], r["low"], r["high"])
                if r["low"] is not None and r["high"] is not None else None)
    ratio = ratio_to_defaults([r["value"] for r in num], [r["value"] for r in den],
                              within={"config": within(num), "defaults": within(den)})
    return {"ratio": round(ratio.median, 4), "ci_low": round(ratio.ci_low, 4),
            "ci_high": round(ratio.ci_high, 4), "method": ratio.method}


def rows(results: Path) -> list[dict[str, Any]]:
    """One row per (streams, base) with readings: each variant's readings, and the ratio
    tuned / plain with its 95 % interval (None until both variants have a reading)."""
    return [{"streams": streams, "base": base,
             "plain": [round(r["value"], 1) for r in got["plain"]],
             "tuned": [round(r["value"], 1) for r in got["tuned"]],
             **_ratio(got["tuned"], got["plain"])}
            for (streams, base), got in sorted(_readings(results).items())]


def recipe_rows(results: Path) -> list[dict[str, Any]]:
    """The other comparison the benches hold: the MTP recipe / vLLM's defaults, per stream
    count and tiles variant (each pair from the same session, servers one after the other)."""
    found = _readings(results)
    out = []
    for streams in sorted({s for s, _ in found}):
        d, r = found.get((streams, "defaults")), found.get((streams, "recipe"))
        if not d or not r:
            continue
        for v in VARIANTS:
            if d[v] and r[v]:
                out.append({"streams": streams, "variant": v, **_ratio(r[v], d[v])})
    return out


def table(results: Path) -> str:
    """Write e2e.csv and e2e.md in RESULTS_DIR; returns the markdown."""
    rs = rows(results)
    with open(results / "e2e.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["streams", "base", "plain_tok_s", "tuned_tok_s", "ratio", "ci_low",
                    "ci_high", "method"])
        for r in rs:
            w.writerow([r["streams"], r["base"], " ".join(map(str, r["plain"])),
                        " ".join(map(str, r["tuned"])), r["ratio"], r["ci_low"], r["ci_high"],
                        r["method"]])
    lines = ["| streams | config | out tok/s, vLLM's default tiles | out tok/s, tuned tiles | "
             "tuned / default [95 %] |", "|---:|---|---|---|---|"]
    for r in rs:
        ratio = (f"{r['ratio']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"
                 if r["ratio"] is not None else "not measured")
        lines.append(f"| {r['streams']} | {r['base']} | "
                     f"{', '.join(f'{v:,.0f}' for v in r['plain']) or '-'} | "
                     f"{', '.join(f'{v:,.0f}' for v in r['tuned']) or '-'} | {ratio} |")
    rr = recipe_rows(results)
    if rr:
        lines += ["", "| streams | tiles | MTP recipe / vLLM's defaults [95 %] | method |",
                  "|---:|---|---|---|"]
        lines += [f"| {r['streams']} | {'tuned' if r['variant'] == 'tuned' else 'default'} | "
                  f"{r['ratio']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}] | {r['method']} |"
                  for r in rr]
    text = "\n".join(lines) + "\n"
    (results / "e2e.md").write_text(text)
    return text


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "args":
        print("\n".join(bench_args(argv[1], int(argv[2]))))
        return 0
    if argv and argv[0] == "plan" and "--" in argv:
        rounds, rest = 2, argv[1:]
        if rest[:1] == ["--rounds"]:
            rounds, rest = int(rest[1]), rest[2:]
        i = rest.index("--")
        print("\n".join(plan([int(s) for s in rest[:i]], rest[i + 1:], rounds)))
        return 0
    if len(argv) == 2 and argv[0] == "table":
        print(table(Path(argv[1])), end="")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
