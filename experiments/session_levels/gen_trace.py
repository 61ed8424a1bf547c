"""A synthetic multi-turn trace with think times of minutes (README.md): the
``multi_turn`` format (chat_id, parent_chat_id, timestamp in s, input_length,
output_length), written to the path given."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

#: think time between a turn's arrival and the next: lognormal, median 90 s, sigma 0.93
#: (p99 about 780 s), capped at 900 s
THINK_MEDIAN_S, THINK_SIGMA, THINK_MAX_S = 90.0, 0.93, 900.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hours", type=float, default=1.0)
    p.add_argument("--rate-sps", type=float, default=2.0, help="new sessions per second")
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    span = a.hours * 3600.0
    n = rng.poisson(a.rate_sps * span)
    starts = np.sort(rng.uniform(0.0, span, n))
    rows = []
    chat = 0
    for t0 in starts:
        # 40 % of sessions have 2 or more turns: 2 + geometric(0.5) - 1 (mean 3)
        turns = 1 if rng.random() >= 0.4 else 1 + int(rng.geometric(0.5))
        t, prompt, parent = float(t0), 0, -1
        for k in range(turns):
            new = (min(700, int(rng.lognormal(np.log(256), 0.5))) if k == 0
                   else min(300, int(rng.lognormal(np.log(48), 0.5))))
            out = max(2, min(128, int(rng.lognormal(np.log(32), 0.5))))
            prompt += new
            if prompt + out > 2000 or t > span:  # the context; the recording's end
                break
            rows.append({"chat_id": chat, "parent_chat_id": parent, "timestamp": round(t, 3),
                         "input_length": prompt, "output_length": out})
            parent, chat = chat, chat + 1
            prompt += out
            t += min(THINK_MAX_S, float(rng.lognormal(np.log(THINK_MEDIAN_S), THINK_SIGMA)))
    rows.sort(key=lambda r: r["timestamp"])
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} turns of {n} sessions -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
