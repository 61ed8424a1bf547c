"""How far apart are a bench's repeats, and is that more than their segments predict?

    python3 experiments/h200-trust/repeat-spread.py results-c256-jitter/bench-*-gpu0.json

For each ``autotune bench --repeats N --json`` file: each repeat's out tok/s, engine step,
segments, the CV of its segments, its drift (second half of its segments over the first)
and its standard error from its segments (CV / sqrt(n)); then the repeats' range (lowest to
highest over the median) and CV, against the mean standard error: a CV of the repeats well
above it means a new replay adds noise of its own (note 16's climbing replays), about equal
means the segments' interval is honest (note 17). Files of the same flags and output
jitter are then compared server to server (their medians). A file written before ``repeat_segments`` existed is split
into equal parts when its segments divide evenly, else shown pooled.
"""

from __future__ import annotations

import json
import statistics as st
import sys
from pathlib import Path


def _cv(xs: list[float]) -> float:
    return st.stdev(xs) / st.mean(xs) if len(xs) > 1 and st.mean(xs) else float("nan")


def _split(segs: list[float], counts: list[int], repeats: int) -> list[list[float]] | None:
    if counts and sum(counts) == len(segs):
        out, i = [], 0
        for k in counts:
            out.append(segs[i:i + k])
            i += k
        return out
    if repeats and len(segs) % repeats == 0:
        k = len(segs) // repeats
        return [segs[i * k:(i + 1) * k] for i in range(repeats)]
    return None


def report(path: Path) -> tuple[str, float | None]:
    d = json.loads(path.read_text())
    m = d.get("measurement") or {}
    rates = list(m.get("repeat_tokens_per_s") or [])
    srv = list(m.get("repeat_server") or [])
    segs = list(m.get("segment_tokens_per_s") or d.get("segments") or [])
    parts = _split(segs, list(m.get("repeat_segments") or []), len(rates))
    flags = " ".join(d.get("flags") or []) or "(vLLM defaults)"
    print(f"{path}: {flags[:100]}")
    print(f"  jitter {d.get('output_jitter', 'n/a')}, stop {d.get('stop')}, "
          f"interrupted {d.get('interrupted', False)}")
    ses = []
    for i, rate in enumerate(rates):
        step = srv[i].get("step_ms") if i < len(srv) else None
        line = f"  repeat {i + 1}: {rate:9,.1f} out tok/s"
        line += f", step {step:.1f} ms" if step else ""
        if parts is not None and i < len(parts) and len(parts[i]) > 1:
            p = parts[i]
            h = len(p) // 2
            cv = _cv(p)
            se = cv / len(p) ** 0.5
            ses.append(se)
            drift = st.mean(p[len(p) - h:]) / st.mean(p[:h]) - 1
            line += (f", {len(p)} segments (CV {cv:.1%}, drift {drift:+.1%}, "
                     f"standard error {se:.1%}): " + ", ".join(f"{x:,.0f}" for x in p))
        print(line)
    if parts is None and segs:
        print(f"  {len(segs)} segments pooled (CV {_cv(segs):.1%}): not split by repeat")
    if len(rates) > 1:
        med = st.median(rates)
        print(f"  repeats: range {(max(rates) - min(rates)) / med:.1%}, CV {_cv(rates):.1%}"
              + (f"; their segments predict {st.mean(ses):.1%}" if ses else ""))
    key = f"{flags[:60]} (jitter {d.get('output_jitter', 'n/a')})"
    return key, (st.median(rates) if rates else None)


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    medians: dict[str, list[float]] = {}
    for p in paths:
        flags, med = report(Path(p))
        if med is not None:
            medians.setdefault(flags, []).append(med)
    for flags, meds in medians.items():
        if len(meds) > 1:
            print(f"servers of {flags}: medians " + " / ".join(f"{x:,.1f}" for x in meds)
                  + f", {(max(meds) - min(meds)) / st.median(meds):.1%} apart")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
