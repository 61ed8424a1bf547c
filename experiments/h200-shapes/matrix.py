"""Issue 15's cross-evaluation matrix from the committed results: 3 shapes x 5 configs.

    python3 experiments/h200-shapes/matrix.py [--results DIR] [--out DIR]

Reads RESULTS/study-KEY/ (best.json, study.json, step.json) and RESULTS/cross-KEY/ (CFG.json:
`autotune bench --json`, CFG.same: measured once under another config's name, CFG.run.json:
GPU and wall time; cells.py writes them, one config on each shape in turn on one server:
the first cell's JSON holds the start, the later ones say server_reused) and writes
OUT/matrix.md and OUT/matrix.csv. A cell is the shape's objective: output tokens/s with its
95 % interval (closed loop, throughput), or capacity (req/s) with its bracket [highest
passing, lowest failing rate] (open loops, capacity); and its ratio to the same shape's
vLLM defaults measured in the same cross step, with an interval (throughput: delta method
on the two within-run intervals, log scale; capacity: the brackets' extremes). Cells not
measured say why. Standard library only.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import math
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("h200_shapes_steps", HERE / "steps.py")
steps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(steps)  # type: ignore[union-attr]

Z = 1.959964
CSV_FIELDS = [
    "shape",
    "config",
    "status",
    "metric",
    "value",
    "ci_low",
    "ci_high",
    "ratio",
    "ratio_low",
    "ratio_high",
    "same_as",
    "slo_met",
    "output_tokens_per_s",
    "ttft_p99_s",
    "tpot_p99_s",
    "gpu",
    "start_s",
    "warmup_s",
    "measure_s",
    "wall_s",
    "note",
    "server_reused",
]


def _f(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def parse_slo(text: str) -> dict[str, float]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, v = part.split("=", 1)
        out[k.strip()] = float(v)
    return out


def slo_met(m: dict[str, Any], slo: dict[str, float]) -> bool | None:
    """Whether the run's percentiles meet the shape's SLOs (ttft_p99=2 -> ttft_p99_s <= 2)."""
    seen = False
    for k, limit in slo.items():
        v = _f(m.get(f"{k}_s"))
        if v is None:
            continue
        seen = True
        if v > limit:
            return False
    return True if seen else None


def cell(key: str, cfg: str, rdir: Path) -> dict[str, Any]:
    """One cell's row (CSV_FIELDS) without the ratio."""
    sc = steps.shape_cfg(key)
    cap = sc["objective"] == "capacity"
    row: dict[str, Any] = dict.fromkeys(CSV_FIELDS)
    row.update(shape=key, config=cfg, metric="capacity_rps" if cap else "output_tokens_per_s")
    got = steps.cell_result(key, cfg, [rdir])
    if got is None:
        sd = steps.study_dir(cfg[4:], [rdir]) if cfg.startswith("win-") else None
        if cfg.startswith("win-") and sd is None:
            row.update(status="not measured", note=f"study:{cfg[4:]} not run yet")
        elif cfg.startswith("win-") and steps.read_json(sd / "best.json") is None:
            row.update(status="not measured", note=f"study:{cfg[4:]} named no winner")
        elif cfg.startswith("win-") and steps.recheck_pending(
                steps.read_json(sd / "study.json") or {}):
            row.update(status="not measured", note=f"study:{cfg[4:]}'s re-check pending")
        else:
            row.update(status="not measured", note="pending: a later session's cross step")
        return row
    kind, val = got
    if kind == "same":
        other = cell(key, val, rdir)
        other.update(
            config=cfg,
            same_as=val,
            note=f"same flags as {val}: measured once"
            + (f"; {other['note']}" if other.get("note") else ""),
        )
        return other
    d = val
    run = steps.read_json(rdir / f"cross-{key}" / f"{cfg}.run.json") or {}
    w = d.get("warmup") or {}
    row.update(
        gpu=run.get("gpu"),
        wall_s=run.get("wall_s"),
        server_reused=bool(d.get("server_reused")),
        start_s=_f(d.get("start_s")),
        warmup_s=_f(w.get("seconds")),
        measure_s=_f(d.get("measure_s")),
    )
    m = d.get("metrics") or {}
    if not d.get("ok"):
        row.update(status="failed", note=f"{d.get('reason')}: {str(d.get('message', ''))[:160]}")
        return row
    row.update(ttft_p99_s=_f(m.get("ttft_p99_s")), tpot_p99_s=_f(m.get("tpot_p99_s")))
    if cap:
        v = _f(m.get("capacity_rps"))
        row.update(
            value=v,
            ci_low=_f(m.get("capacity_rps_ci_low")) or v,
            ci_high=_f(m.get("capacity_rps_ci_high")),
            output_tokens_per_s=_f(m.get("output_tokens_per_s_at_capacity")),
            slo_met=True if v is not None else None,
        )
        if v is None:
            row.update(status="failed", note="no load level met the SLOs")
            return row
    else:
        row.update(
            value=_f(m.get("output_tokens_per_s")),
            ci_low=_f(m.get("output_tokens_per_s_ci_low")),
            ci_high=_f(m.get("output_tokens_per_s_ci_high")),
            output_tokens_per_s=_f(m.get("output_tokens_per_s")),
            slo_met=slo_met(m, parse_slo(sc.get("slo", ""))),
        )
    row["status"] = "measured"
    if d.get("dry_run"):
        row["note"] = "DRY RUN: made-up numbers"
    return row


def ratio(row: dict[str, Any], base: dict[str, Any], capacity: bool) -> None:
    """Fill row's ratio to the defaults' row and its interval."""
    if row["status"] != "measured" or base["status"] != "measured":
        return
    v, d = row["value"], base["value"]
    if not v or not d:
        return
    row["ratio"] = v / d
    if capacity:
        lo, hi = row["ci_low"], row["ci_high"]
        dlo, dhi = base["ci_low"], base["ci_high"]
        row["ratio_low"] = lo / dhi if lo and dhi else None  # no upper end: defaults capped
        row["ratio_high"] = hi / dlo if hi and dlo else None
        return
    ses = []
    for r in (row, base):
        lo, hi = r["ci_low"], r["ci_high"]
        if not (lo and hi and lo > 0):
            return
        ses.append((math.log(hi) - math.log(lo)) / (2 * Z))
    se = math.hypot(*ses)
    row["ratio_low"] = row["ratio"] * math.exp(-Z * se)
    row["ratio_high"] = row["ratio"] * math.exp(Z * se)


def build(rdir: Path) -> list[dict[str, Any]]:
    rows = []
    for key, sc in steps.SHAPES["shapes"].items():
        cells = {cfg: cell(key, cfg, rdir) for cfg in steps.CONFIGS}
        for cfg in steps.CONFIGS:
            ratio(cells[cfg], cells["defaults"], sc["objective"] == "capacity")
            rows.append(cells[cfg])
    return rows


def _n(x: float | None, unit: str = "") -> str:
    if x is None:
        return "?"
    return f"{x:,.0f}{unit}" if x >= 100 else f"{x:,.2f}{unit}"


def cell_text(r: dict[str, Any]) -> str:
    if r["status"] == "not measured":
        return f"not yet measured: {r['note']}"
    if r["status"] == "failed":
        return f"failed ({r['note']})"
    cap = r["metric"] == "capacity_rps"
    hi = _n(r["ci_high"]) if r["ci_high"] is not None else "capped"
    t = (
        f"{_n(r['value'])} req/s [{_n(r['ci_low'])}-{hi}]"
        if cap
        else f"{_n(r['value'])} tok/s [{_n(r['ci_low'])}-{hi}]"
    )
    if r["slo_met"] is False:
        t += " (over SLO)"
    if r["config"] == "defaults":
        t += ", x1"
    elif r["ratio"] is not None:
        lo = f"{r['ratio_low']:.2f}" if r["ratio_low"] is not None else "?"
        rh = f"{r['ratio_high']:.2f}" if r["ratio_high"] is not None else "open"
        t += f", x{r['ratio']:.2f} [{lo}-{rh}]"
    if r["same_as"]:
        t += f" (= {r['same_as']})"
    if r["note"] and "DRY RUN" in r["note"]:
        t += " DRY RUN"
    return t


def _slot_text(slot: str, g: dict[str, float]) -> str:
    """One GPU slot's account: start / warm-up / measuring / idle seconds, share measuring."""
    total = sum(v for k, v in g.items() if k != "compile_s")  # compile_s is part of start_s
    share = 100 * g.get("measure_s", 0) / total if total else 0.0
    return (
        f"{slot} {g.get('start_s', 0):.0f}/{g.get('warmup_s', 0):.0f}/"
        f"{g.get('measure_s', 0):.0f}/{g.get('idle_s', 0):.0f} s ({share:.0f} % measuring)"
    )


def studies_table(rdir: Path) -> list[str]:
    out = [
        "| shape | objective, SLOs | verdict | winner (trial) | value | ratio to defaults [95 %]"
        " | knobs changed from the defaults"
        " | study wall, GPU time (start / warm-up / measuring / idle) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, sc in steps.SHAPES["shapes"].items():
        s = steps.study_dir(key, [rdir])
        if s is None:
            out.append(f"| {key} | {sc['objective']}, {sc['slo']} | not run yet | | | | | |")
            continue
        b = steps.read_json(s / "best.json") or {}
        st = steps.read_json(s / "study.json") or {}
        sj = steps.read_json(s / "step.json") or {}
        rt = b.get("ratio_to_defaults") or {}
        r = (
            f"{rt['median']:.3f} [{rt.get('ci_low') or 0:.3f}, {rt.get('ci_high') or 0:.3f}]"
            if rt.get("median")
            else "-"
        )
        params = b.get("params") or {}
        changed = (
            ", ".join(f"{k}={v}" for k, v in params.items() if k in _DEFAULTS and _DEFAULTS[k] != v)
            or "none (vLLM's defaults)"
        )
        rc = steps.read_json(s / "recheck-step.json") or {}
        mo = steps.read_json(s / "more-step.json") or {}
        gt = st.get("gpu_time") or {}
        acct = "; ".join(_slot_text(slot, g) for slot, g in sorted(gt.items()))
        wall = f"{sj.get('wall_s', '?')} s" + (
            f" + re-check {rc['wall_s']} s" if rc.get("wall_s") else "") + (
            f" + resumed {mo['wall_s']} s" if mo.get("wall_s") else "")
        val = (b.get("objective") or {}).get("value")
        verdict = b.get("verdict") or "no winner: " + str(st.get("explanation", ""))[:80]
        if steps.recheck_pending(st):
            verdict += " (provisional: searched without its re-check, `recheck:" + key + "` next)"
        out.append(
            f"| {key} | {sc['objective']}, {sc['slo']} | {verdict} | "
            f"{'defaults' if b.get('is_baseline') else 'trial'} {b.get('trial')} | "
            f"{_n(_f(val))} | {r} | {changed} | {wall}; {acct} |"
        )
    return out


# the space's knob defaults (for "knobs changed"; omp_threads has none: vLLM sets its own)
_DEFAULTS: dict[str, Any] = {
    "mtp_depth": 0,
    "async_scheduling": True,
    "mamba_backend": "triton",
    "mamba_ssm_cache_dtype": "float32",
    "stochastic_rounding": False,
    "max_num_seqs": 1024,
    "max_num_batched_tokens": 8192,
    "cudagraph_cover_drafts": False,
    "cudagraph_cover_prefill": False,
    "gpu_memory_utilization": 0.92,
    "kv_cache_dtype": "auto",
    "enable_chunked_prefill": True,
    "enable_prefix_caching": False,
    "performance_mode": "balanced",
    "moe_backend": "auto",
}


def render(rdir: Path) -> tuple[str, str]:
    rows = build(rdir)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    cfgs = steps.CONFIGS
    md = [
        "# Each shape's winner, vLLM's defaults and the recipe on every shape",
        "",
        "Generated by `python3 experiments/h200-shapes/matrix.py` from `results/`. Cells: one "
        "fresh server per config, measuring each shape in turn as `autotune bench` would (each "
        "warmed up on its own; `cells.py`), one server per GPU (two at a time on two "
        "GPUs). Closed loop (casestudy): output "
        "tok/s [95 % interval over segments]; open loops (azure, mooncake): capacity, req/s one "
        "server sustains with 99 % of requests within the shape's SLOs [bracket: highest passing, "
        "lowest failing rate]. `xR [lo-hi]`: ratio to that shape's defaults (throughput: delta "
        "method on the two within-run intervals; capacity: the brackets' extremes). One start per "
        "cell: the start-to-start spread (18-20 % for a capacity, 3-8 % for throughput at 256 "
        "streams) is not in these intervals; experiments/README.md (question 4) pools every start.",
        "",
        "| shape | " + " | ".join(cfgs) + " |",
        "|---|" + "---|" * len(cfgs),
    ]
    by = {(r["shape"], r["config"]): r for r in rows}
    for key, sc in steps.SHAPES["shapes"].items():
        md.append(
            f"| **{key}** ({sc['objective']}; {sc['slo']}) | "
            + " | ".join(cell_text(by[(key, c)]) for c in cfgs)
            + " |"
        )
    n_meas = sum(r["status"] == "measured" for r in rows)
    md += ["", f"{n_meas} of {len(rows)} cells measured.", "", "## The studies", ""]
    md += studies_table(rdir)
    return "\n".join(md) + "\n", buf.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=HERE / "results")
    ap.add_argument("--out", type=Path, default=HERE)
    a = ap.parse_args()
    md, csv_text = render(a.results)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "matrix.md").write_text(md)
    (a.out / "matrix.csv").write_text(csv_text)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
