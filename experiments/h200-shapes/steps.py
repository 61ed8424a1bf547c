"""The shape studies' planner (experiments/h200-shapes, one or two GPUs): what a step needs to know
from shapes.json and from the results already there (the commands: README.md).

    python3 steps.py get KEY FIELD                  a field of shapes.json's shape KEY
    python3 steps.py tune-args KEY                  the shape's tune arguments, one a line
    python3 steps.py study-args KEY GPUS            the study's --trials, --enqueue and
                                                    --recheck (shapes.json's one_gpu), one a line
    python3 steps.py done study KEY DIR...          exit 0 when a DIR holds study-KEY/DONE
    python3 steps.py start-seconds                  a server start's expected seconds
    python3 steps.py cell-seconds KEY               a measurement's expected seconds (shape KEY)
    python3 steps.py recheck-starts KEY DIR...      'K NEW': the --recheck-starts a done study's
                                                    verdict asked for, and the trials it adds
    python3 steps.py more KEY DIR...                why a done study's search goes on (exit 0),
                                                    else why not (exit 1)
    python3 steps.py plan RES RUN KEY... -- DIR...  the cross-evaluation cells still to
                                                    measure, grouped by server (cells.py)
    python3 steps.py bench-args CELL.json           a planned cell's bench arguments, one a line
    python3 steps.py has-study DB NAME              exit 0 when the Optuna store holds NAME
    python3 steps.py backup SRC.db DST.db           a consistent copy of a SQLite file

Result folders (DIR: this session's RES, a staged RESUME_FROM, the committed results) are
searched in the order given; the first that has a result wins. Only the standard library at
import time (optuna and autotune are imported where a subcommand needs them), so matrix.py
and the tests can import this file on any machine.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHAPES = json.loads((HERE / "shapes.json").read_text())
CONFIGS: list[str] = SHAPES["configs"]
SPACE = "experiments/h200-trust/space-no-moe.yaml"
RECIPE = "experiments/h200/recipe.json"


def shape_cfg(key: str) -> dict[str, Any]:
    try:
        return SHAPES["shapes"][key]
    except KeyError:
        raise SystemExit(
            f"unknown shape key {key!r}; keys: {', '.join(SHAPES['shapes'])}"
        ) from None


def read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


# -- what is already there ----------------------------------------------------------------------


def study_dir(key: str, dirs: list[Path]) -> Path | None:
    """The first study-KEY folder that finished (DONE: tune exited 0; a study that found no
    feasible config has no best.json, and is done all the same)."""
    for d in dirs:
        s = d / f"study-{key}"
        if (s / "DONE").exists():
            return s
    return None


def cell_result(key: str, cfg: str, dirs: list[Path]) -> tuple[str, Any] | None:
    """('json', bench output) or ('same', other config) for a measured cell, else None.

    A bench JSON counts when it parses and says ok true or false (a failed start is a
    result: the config does not serve that shape); a timed-out bench left no JSON. A
    winner's cell counts only while its study still names the flags it was measured with,
    and CFG.same only while CFG's flags still equal the other config's: a study judged
    again (a recheck: step, rejudge.py) may name another config, whose cells are then
    still to measure."""
    for d in dirs:
        c = d / f"cross-{key}"
        j = read_json(c / f"{cfg}.json")
        if isinstance(j, dict) and "ok" in j:
            found, measured = ("json", j), j
        elif (c / f"{cfg}.same").exists():
            other = (c / f"{cfg}.same").read_text().strip()
            got = cell_result(key, other, dirs) if other != cfg else None
            if got is None:
                continue
            found, measured = ("same", other), _measured_json(key, got, dirs)
        else:
            continue
        if cfg.startswith("win-") and "flags" in measured and _ident(
                config_of(key, cfg, dirs)) not in (None, _ident(measured)):
            continue  # measured with flags its study no longer names
        return found
    return None


def _measured_json(key: str, got: tuple[str, Any], dirs: list[Path]) -> dict[str, Any]:
    """The bench JSON a cell_result rests on, following CFG.same to the cell measured."""
    while got[0] == "same":
        got = cell_result(key, got[1], dirs) or ("json", {})
    return got[1]


def recheck_pending(study_json: dict[str, Any]) -> bool:
    """A study searched without its re-check (shapes.json one_gpu ``"recheck": "later"``)
    that the recheck:KEY step has not re-checked yet: its verdict is provisional."""
    return (study_json.get("settings") or {}).get("recheck") == 0


def _ident(conf: dict[str, Any]) -> str | None:
    """A config's flags and env as one comparable string (None: no config)."""
    if "flags" not in conf:
        return None
    return json.dumps([list(conf["flags"]), dict(conf.get("env") or {})], sort_keys=True)


# -- configs ------------------------------------------------------------------------------------


def _space_for(shape_path: str, gpu_arch: str):
    from autotune.space import ModelFacts, load_space
    from autotune.study import _traffic_streams
    from autotune.traffic import load_shape

    shape = load_shape(shape_path)
    facts = ModelFacts.from_model_dir(
        HERE.parent / "h200" / "model", device="cuda", gpu_arch=gpu_arch
    ).with_traffic(streams=_traffic_streams(shape, None), prompt_p90=shape.input_tokens.p90)
    return load_space(SPACE, facts=facts)


def config_of(key: str, cfg: str, dirs: list[Path], gpu_arch: str = "") -> dict[str, Any]:
    """{'flags', 'env', 'source'} of config CFG for shape KEY, or {'missing': why}.

    defaults and recipe come from the space (as the study's trial 0 and its enqueued recipe
    run them: fixed flags, stand-in flags, derived flags for this shape); win-K is what
    study-K's best.json names, flags as that study ran them (its CUDA-graph capture size is
    derived from shape K's traffic: a winner is deployed as tuned)."""
    if cfg.startswith("win-"):
        k = cfg[4:]
        s = study_dir(k, dirs)
        if s is None:
            return {
                "missing": f"study:{k} not run yet: its winner's cell is left for a later session"
            }
        b = read_json(s / "best.json")
        st = read_json(s / "study.json") or {}
        if not isinstance(b, dict):
            why = st.get("explanation") or "no best.json"
            return {"missing": f"study:{k} named no winner: {why}"}
        if recheck_pending(st):
            return {"missing": f"study:{k}'s re-check is pending (recheck:{k}, a later "
                               "session): its winner may change"}
        return {
            "flags": list(b.get("flags") or []),
            "env": dict(b.get("env") or {}),
            "source": f"{s.name}/best.json trial {b.get('trial')} ({b.get('verdict')})",
        }
    if not gpu_arch:
        try:
            from autotune.hardware import gpu_arch as _arch

            gpu_arch = _arch() or "sm90"
        except Exception:  # noqa: BLE001 - no GPU here: the H200's
            gpu_arch = "sm90"
    from autotune.study import _complete_params

    sp = _space_for(shape_cfg(key)["shape"], gpu_arch)
    if cfg == "defaults":
        ls = sp.launch_spec(sp.baseline_params(), baseline=True)
        return {"flags": list(ls.flags), "env": dict(ls.env), "source": f"{SPACE} baseline"}
    if cfg == "recipe":
        params = _complete_params(
            sp, json.loads((HERE.parent / "h200" / "recipe.json").read_text()), "recipe"
        )
        ls = sp.launch_spec(params)
        return {"flags": list(ls.flags), "env": dict(ls.env), "source": RECIPE}
    raise SystemExit(f"unknown config {cfg!r}; configs: {', '.join(CONFIGS)}")


def capacity_start(key: str, dirs: list[Path]) -> float:
    """The first load level of the cross benches of shape KEY: 0.75 x the defaults' capacity
    scale in study-KEY (one level below it, so that a level passes, doubles and fails,
    then three bisections), the same for all five configs; shapes.json's value before the
    study has run."""
    cfg = shape_cfg(key)
    s = study_dir(key, dirs)
    if s is not None:
        b = read_json(s / "best.json") or {}
        base = (b.get("baseline") or {}).get("value")
        rec = (b.get("capacity") or {}).get("recorded_rps")
        if base and rec:
            return round(max(0.25, 0.75 * float(base) / float(rec)), 2)
    return float(cfg.get("capacity_start", 1.0))


# -- arguments ----------------------------------------------------------------------------------


def _measure_args(c: dict[str, Any], cap_start: float) -> list[str]:
    """Shape, SLOs and how each config is measured: the same for tune and bench."""
    a = ["--shape", c["shape"], "--slo", c["slo"], "--warmup-max-s", str(c.get("warmup_max_s", 60))]
    if c["objective"] == "capacity":
        return [*a, "--capacity-start", str(cap_start),
                "--capacity-level-s", str(c["capacity_level_s"]),
                "--capacity-tolerance", str(c["capacity_tolerance"]),
                "--capacity-max-levels", str(c["capacity_max_levels"])]  # fmt: skip
    return [*a, "--precision", str(c.get("precision", 0.02)),
            "--measure-max-s", str(c.get("measure_max_s", 90))]  # fmt: skip


def tune_args(key: str) -> list[str]:
    c = shape_cfg(key)
    return ["--objective", c["objective"], *_measure_args(c, c.get("capacity_start", 1.0))]


COVER_PREFILL = '{"cudagraph_cover_prefill": true}'
ENQUEUE = {"cover_prefill": COVER_PREFILL, "recipe": "@" + RECIPE}


def study_args(key: str, gpus: int, trials: str = "") -> list[str]:
    """A study's trials, queued configs and re-check: by default 4 trials (vLLM's defaults,
    then ``cudagraph_cover_prefill``, the case study's recipe, one TPE sample) and a re-check
    of the leader and the defaults on one fresh start each. On one GPU a shape's ``one_gpu``
    (shapes.json) may ask for fewer trials, another queue order and ``"recheck": "later"``:
    the study then runs without its re-check (``--recheck 0``) and the next session's
    ``recheck:KEY`` step adds it (``tune --resume --recheck 1``): a session holds the search
    or the re-check of a shape whose cold trials take ~700 s, not both. ``trials``: the
    TRIALS environment, which wins when set."""
    one = (shape_cfg(key).get("one_gpu") or {}) if gpus == 1 else {}
    n = trials or str(one.get("trials", 4))
    out = ["--trials", n]
    for name in one.get("enqueue", ["cover_prefill", "recipe"]):
        out += ["--enqueue", ENQUEUE[name]]
    return [*out, "--recheck", "0" if one.get("recheck") == "later" else "1"]


def bench_args(key: str, cap_start: float) -> list[str]:
    c = shape_cfg(key)
    a = _measure_args(c, cap_start)
    return ["--capacity", *a] if c["objective"] == "capacity" else a


START_LIMIT = 330  # a start of flags new to this machine's caches (two cold starts at once)


def start_seconds() -> int:
    """Expected seconds of one server start: flags the caches know (START_EST, default
    100; measured on the H200 with the compile caches restored (scripts/gpu/caches.sh):
    57-75 s in a study, 89 s a fresh machine's first start)."""
    import os

    return int(os.environ.get("START_EST", "100"))


def cell_seconds(key: str) -> tuple[int, int]:
    """(expected, limit) seconds of one cross cell on a server already up (its start is
    counted once per server: start_seconds, START_LIMIT). Limit: the warm-up cap, every load
    level (plus a 20-s drain) or the measurement cap. Expected: the warm-up cap, five load
    levels (the usual bracketing from a start below capacity) or the measurement cap."""
    c = shape_cfg(key)
    warm = int(c.get("warmup_max_s", 60))
    if c["objective"] == "capacity":
        # levels last 3 of the shape's requests (autotune.trial.fit_level): mooncake's ~45 s
        level = int(c.get("capacity_level_s_expected", c["capacity_level_s"]))
        body_max = c["capacity_max_levels"] * (level + 20)
        body = 5 * (level + 15)
    else:
        body_max = body = int(c.get("measure_max_s", 90))
    return int(warm + body + 20), int(warm + body_max + 40)


def cell_bench_args(spec: dict[str, Any]) -> list[str]:
    """A planned cell's bench arguments: the shape's options, --env, then the flags."""
    out = list(spec["args"])
    for k, v in spec["env"].items():
        out += ["--env", f"{k}={v}"]
    return [*out, "--", *spec["flags"]]


def group_cells(cells: list[dict[str, Any]], start_s: int) -> list[dict[str, Any]]:
    """The planned cells by server: cells whose flags and env are equal share one server
    start and are measured on it in turn (cells.py). Groups in the order of their first
    cell, cells in plan order. Each group: label (its configs), cells, and seconds:
    start_expected_s, expected_s (start + every cell), limit_s (START_LIMIT + every cell's
    limit), first_s (start + its first cell: what must be left to begin it)."""
    groups: dict[str, dict[str, Any]] = {}
    for c in cells:
        ident = _ident(c)
        g = groups.setdefault(ident, {"configs": [], "cells": []})
        if c["config"] not in g["configs"]:
            g["configs"].append(c["config"])
        g["cells"].append(c)
    out = []
    for g in groups.values():
        cs = g["cells"]
        out.append({
            "label": "+".join(g["configs"]),
            "cells": cs,
            "start_expected_s": start_s,
            "expected_s": start_s + sum(c["expected_s"] for c in cs),
            "limit_s": START_LIMIT + sum(c["limit_s"] for c in cs),
            "first_s": start_s + cs[0]["expected_s"],
        })  # fmt: skip
    return out


def fit_cells(expected: list[int], start_s: int, left_s: float, margin: int = 30) -> int:
    """How many of a group's cells (in order) fit in ``left_s``: the start, then each
    cell's expected seconds, ``margin`` to spare. The rest wait for a later session."""
    used, n = start_s + margin, 0
    for e in expected:
        used += e
        if used > left_s:
            break
        n += 1
    return n


def checks_verdict(key: str, cfg: str, dirs: list[Path]) -> bool:
    """Whether cell (KEY, CFG) re-measures study:KEY's verdict: the study is done and CFG
    is its winner or vLLM's defaults (issue 14's independent re-measure on fresh servers)."""
    return cfg in ("defaults", f"win-{key}") and study_dir(key, dirs) is not None


def plan(res: Path, run: Path, keys: list[str], dirs: list[Path]) -> list[str]:
    """Write one spec per cell still to measure under RUN/cells/ (shape by shape, configs
    in shapes.json's order; the cells that check a done study's verdict first:
    checks_verdict), group them by server (group_cells: one start per config) into
    RUN/cells/gNN-LABEL.json, and return one line per group 'group-file<TAB>label<TAB>
    cells<TAB>expected-s<TAB>limit-s<TAB>first-s'. A config whose flags and env equal
    another config's of the same shape (a study whose verdict kept the defaults, two
    studies with one winner) is measured once: RES/cross-KEY/CFG.same names the one
    measured. Notes go to stderr (run.sh appends them to progress.txt)."""
    cells_dir = run / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    cells: list[dict[str, Any]] = []
    for key in keys:
        cap = capacity_start(key, dirs)
        seen: dict[str, str] = {}  # flags+env -> config measured (or planned) for them
        for cfg in CONFIGS:
            conf = config_of(key, cfg, dirs)
            if "missing" in conf:
                print(f"cross:{key} {cfg}: {conf['missing']}", file=sys.stderr)
                continue
            ident = _ident(conf)
            have = cell_result(key, cfg, dirs)
            if have is not None:
                seen.setdefault(ident, cfg)
                print(f"cross:{key} {cfg}: measured already", file=sys.stderr)
                continue
            if ident in seen:
                out = res / f"cross-{key}"
                out.mkdir(parents=True, exist_ok=True)
                (out / f"{cfg}.same").write_text(seen[ident] + "\n")
                print(
                    f"cross:{key} {cfg}: same flags as {seen[ident]}, measured once",
                    file=sys.stderr,
                )
                continue
            seen[ident] = cfg
            expect, limit = cell_seconds(key)
            spec = {
                "key": key,
                "config": cfg,
                **conf,
                "args": bench_args(key, cap),
                "expected_s": expect,
                "limit_s": limit,
                "prefix": str(res / f"cross-{key}" / cfg),
            }
            f = cells_dir / f"{len(cells):02d}-{key}-{cfg}.json"
            f.write_text(json.dumps(spec, indent=1))
            cells.append({**spec, "file": str(f)})
    # the cells that check a finished study's verdict on fresh servers (its winner and the
    # defaults on its shape) first: when a session's time runs short, they are what it keeps
    cells.sort(key=lambda c: 0 if checks_verdict(c["key"], c["config"], dirs) else 1)
    lines = []
    for i, g in enumerate(group_cells(cells, start_seconds())):
        f = cells_dir / f"g{i:02d}-{g['label']}.json"
        f.write_text(json.dumps({**g, "cells": [
            {k: c[k] for k in ("file", "prefix", "key", "config", "expected_s", "limit_s")}
            for c in g["cells"]]}, indent=1))  # fmt: skip
        shapes = ", ".join(c["key"] for c in g["cells"])
        n = len(g["cells"])
        print(f"cross server {g['label']}: {n} cell{'' if n == 1 else 's'} on one start ({shapes})",
              file=sys.stderr)
        lines.append(f"{f}\t{g['label']}\t{len(g['cells'])}\t{g['expected_s']}\t"
                     f"{g['limit_s']}\t{g['first_s']}")
    return lines


# -- stores -------------------------------------------------------------------------------------


def has_study(db: str, name: str) -> bool:
    if not Path(db).exists():
        return False
    con = sqlite3.connect(db)
    try:
        return (
            con.execute("SELECT 1 FROM studies WHERE study_name = ?", (name,)).fetchone()
            is not None
        )
    except sqlite3.Error:
        return False
    finally:
        con.close()


def backup(src: str, dst: str) -> None:
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(dst + ".tmp")
    tmp.unlink(missing_ok=True)
    s, d = sqlite3.connect(src), sqlite3.connect(tmp)
    with d:
        s.backup(d)
    s.close()
    d.close()
    tmp.replace(dst)


def recheck_starts(key: str, dirs: list[Path]) -> tuple[int, int] | str:
    """For a ``recheck:KEY`` step: the ``--recheck-starts`` a done study's verdict asked for
    (``starts_needed``: the defaults kept only because its starts could not show a gain)
    and how many fresh-server trials that adds (its two configs, up to that many fresh
    starts each); else why there is nothing to run. Once per study: asking again after
    that would be looking at the same question until it answers (docs/measurement.md,
    section 9)."""
    for d in dirs:
        if (d / f"study-{key}" / "RECHECKED").exists():
            return f"re-checked already ({d / f'study-{key}'})"
    s = study_dir(key, dirs)
    if s is None:
        return "the study is not done yet"
    best = read_json(s / "best.json") or {}
    v = best.get("verdict_detail") or {}
    need = (v.get("starts_needed") or {}).get("recheck_starts")
    st = read_json(s / "study.json") or {}
    if not need and recheck_pending(st):
        # searched without its re-check (shapes.json one_gpu "recheck": "later"): one fresh
        # start of the leader and of the defaults; none when only the defaults were feasible
        if v.get("candidate_number") is None and v.get("winner_number") is None:
            return "its re-check was left for later, but no config but the defaults was feasible"
        return 1, 2
    if not need:
        return f"its verdict ({best.get('verdict')}) asks for no more starts"
    have = v.get("readings") or {}
    new = sum(max(0, int(need) - len(have.get(k) or [])) for k in ("candidate", "defaults"))
    return int(need), new


def more_needed(key: str, dirs: list[Path]) -> tuple[bool, str]:
    """For a ``more:KEY`` step: (True, why) when a done study measured no config but vLLM's
    defaults because its time budget ended the search first (queued configs not started:
    a cold first start can take most of a one-GPU budget), so ``tune --resume`` runs
    them; else (False, why not). Once per study (``SEARCHED_MORE``), like a re-check."""
    for d in dirs:
        if (d / f"study-{key}" / "SEARCHED_MORE").exists():
            return False, f"searched more already ({d / f'study-{key}'})"
    s = study_dir(key, dirs)
    if s is None:
        return False, "the study is not done yet"
    st = read_json(s / "study.json") or {}
    skipped = int((st.get("failures_by_reason") or {}).get("budget") or 0)
    v = st.get("verdict") or {}
    if v.get("candidate_number") is not None or v.get("winner_number") is not None:
        return False, "it measured configs besides vLLM's defaults"
    if not skipped:
        return False, "its budget left no queued config unstarted"
    return True, (f"it measured only vLLM's defaults: the budget left {skipped} queued "
                  "config(s) unstarted")


def main(argv: list[str]) -> int:
    cmd, rest = argv[0], argv[1:]
    if cmd == "get":
        v = shape_cfg(rest[0]).get(rest[1], "")
        print(v)
    elif cmd == "tune-args":
        print("\n".join(tune_args(rest[0])))
    elif cmd == "study-args":
        import os

        print("\n".join(study_args(rest[0], int(rest[1]), os.environ.get("TRIALS", ""))))
    elif cmd == "done":
        what, key, dirs = rest[0], rest[1], [Path(d) for d in rest[2:]]
        assert what == "study"
        s = study_dir(key, dirs)
        if s is None:
            return 1
        print(s)
    elif cmd == "start-seconds":
        print(start_seconds())
    elif cmd == "cell-seconds":
        print(cell_seconds(rest[0])[0])
    elif cmd == "recheck-starts":
        got = recheck_starts(rest[0], [Path(d) for d in rest[1:]])
        if isinstance(got, str):
            print(got)
            return 1
        print(*got)
    elif cmd == "more":
        ok, why = more_needed(rest[0], [Path(d) for d in rest[1:]])
        print(why)
        return 0 if ok else 1
    elif cmd == "plan":
        i = rest.index("--")
        res, run, keys = Path(rest[0]), Path(rest[1]), rest[2:i]
        print("\n".join(plan(res, run, keys, [Path(d) for d in rest[i + 1 :]])))
    elif cmd == "bench-args":
        print("\n".join(cell_bench_args(json.loads(Path(rest[0]).read_text()))))
    elif cmd == "has-study":
        return 0 if has_study(rest[0], rest[1]) else 1
    elif cmd == "backup":
        backup(rest[0], rest[1])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
