"""Study plots on real SQLite studies: every PNG is written, whatever the trials."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState

from autotune.errors import TrackingError
from autotune.results import PLOT_FILES, param_importances, pareto_front, write_study_plots
from autotune.results import PRIOR_ATTR
from autotune.store import A

optuna.logging.set_verbosity(optuna.logging.WARNING)

DISTS = {"max_num_seqs": IntDistribution(4, 64, log=True),
         "kv_cache_dtype": CategoricalDistribution(["auto", "fp8_e4m3"])}
PNG = b"\x89PNG\r\n\x1a\n"


def _t(n_seqs: int, kv: str, outcome: str, value: float | None = None, ttft: float = 1.0,
       **attrs: Any) -> optuna.trial.FrozenTrial:
    """A finished trial with tune()'s attributes; outcome: ok | infeasible | a failure reason."""
    ua: dict[str, Any] = dict(attrs)
    if outcome in ("ok", "infeasible"):
        ua[A.METRICS] = {"output_tokens_per_s": value, "ttft_p99_s": ttft, "n_requests": 16}
        ua[A.STATE] = outcome
        cons = {"failed": 0.0, "slo": -0.2 if outcome == "ok" else 0.3, "errors": -0.05}
        if outcome == "infeasible":
            ua[A.REASON] = "slo"
        state = TrialState.COMPLETE
    else:
        ua.update({A.STATE: "failed", A.REASON: outcome, A.MESSAGE: "..."})
        cons = {"failed": 1.0, "slo": 0.0, "errors": 0.0}
        state = TrialState.PRUNED
    return optuna.trial.create_trial(
        state=state, value=value if state == TrialState.COMPLETE else None,
        params={"max_num_seqs": n_seqs, "kv_cache_dtype": kv}, distributions=DISTS,
        user_attrs=ua, constraints=cons,
    )  # fmt: skip


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return optuna.storages.RDBStorage(f"sqlite:///{tmp_path_factory.mktemp('plots')}/o.db")


def _study(storage: Any, name: str, trials: list[optuna.trial.FrozenTrial]) -> optuna.Study:
    study = optuna.create_study(storage=storage, study_name=name, direction="maximize")
    study.set_user_attr(A.SETTINGS, {"objective": "throughput", "slo": {"ttft_p99": 3.0}})
    study.add_trials(trials)
    return study


def _check(paths: dict[str, Path], out: Path) -> None:
    assert set(paths) == set(PLOT_FILES)
    for key, path in paths.items():
        assert path == out / PLOT_FILES[key]
        data = path.read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, key
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left


def test_full_study(storage: Any, tmp_path: Path) -> None:
    trials = [
        _t(16, "auto", "ok", 1000.0, 0.9, **{A.BASELINE: True}),
        _t(32, "auto", "ok", 1500.0, 1.4),
        _t(64, "fp8_e4m3", "infeasible", 2100.0, 3.5),
        _t(48, "auto", "oom"),
        _t(8, "auto", "rejected"),
        _t(24, "fp8_e4m3", "ok", 1300.0, 0.8),
        _t(12, "fp8_e4m3", "start_timeout"),
        _t(40, "auto", "ok", 1700.0, 2.0),
        _t(20, "fp8_e4m3", "ok", 1100.0, 0.7),
        # a prior copied from an earlier study: measured under another shape, not plotted
        _t(60, "auto", "ok", 99999.0, 0.1, **{PRIOR_ATTR: {"study": "old", "trial": 3}}),
    ]
    study = _study(storage, "full", trials)
    study.ask()  # a trial in flight: nothing to plot for it yet
    paths = write_study_plots(study, tmp_path / "plots")
    _check(paths, tmp_path / "plots")
    imp, why, n = param_importances(study)
    assert imp is not None and set(imp) == {"max_num_seqs", "kv_cache_dtype"}, why
    assert n == 6  # the measured trials of this study: not the failures, not the prior


@pytest.mark.parametrize(
    "name, trials",
    [
        ("none", []),
        ("one", [_t(16, "auto", "ok", 1000.0, **{A.BASELINE: True})]),
        ("only-failed", [_t(16, "auto", "oom"), _t(8, "auto", "rejected"),
                         _t(32, "fp8_e4m3", "crash")]),
    ],
)
def test_degenerate_studies_do_not_crash(storage: Any, tmp_path: Path, name: str,
                                         trials: list[optuna.trial.FrozenTrial]) -> None:
    study = _study(storage, name, trials)
    _check(write_study_plots(study, tmp_path), tmp_path)


def test_pareto_study(storage: Any, tmp_path: Path) -> None:
    study = optuna.create_study(storage=storage, study_name="two-objectives",
                                directions=["maximize", "minimize"])
    study.set_user_attr(A.SETTINGS, {"objective": "pareto"})
    for seqs, kv, tput, ttft in ((16, "auto", 900.0, 0.5), (32, "fp8_e4m3", 1200.0, 2.0),
                                 (24, "auto", 1000.0, 3.0), (8, "fp8_e4m3", 700.0, 0.4),
                                 (48, "auto", 1300.0, 3.5)):
        t = _t(seqs, kv, "ok", tput, ttft)
        study.add_trial(optuna.trial.create_trial(
            values=[tput, ttft], params=t.params, distributions=t.distributions,
            user_attrs=t.user_attrs, constraints=t.constraints))  # fmt: skip
    study.add_trial(_t(48, "auto", "oom"))
    _check(write_study_plots(study, tmp_path), tmp_path)
    imp, why, n = param_importances(study)
    assert imp is not None and n == 5, why


@pytest.mark.parametrize(
    "name, trials, why",
    [
        ("imp-one", [_t(16, "auto", "ok", 900.0)], "at least 5 measured trials"),
        ("imp-failed", [_t(16, "auto", "oom"), _t(32, "auto", "crash")],
         "at least 5 measured trials"),
        ("imp-four", [_t(4 * i, "auto", "ok", 900.0 + 50 * i) for i in range(1, 5)],
         "at least 5 measured trials (this study has 4)"),
        ("imp-constant", [_t(16, "auto", "ok", 900.0 + i) for i in range(5)],
         "no parameter varied"),
        # the readings identical: fANOVA itself would fail ("Encountered zero total
        # variance in all trees")
        ("imp-flat", [_t(4 * i, "auto", "ok", 900.0) for i in range(1, 6)],
         "every measured trial read the same objective (900)"),
    ],
)
def test_importances_say_why_not(storage: Any, name: str,
                                 trials: list[optuna.trial.FrozenTrial], why: str) -> None:
    imp, reason, _ = param_importances(_study(storage, name, trials))
    assert imp is None and why in reason, reason
    assert "Encountered" not in reason and "variance in all trees" not in reason


def test_unwritable_folder(storage: Any, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(TrackingError, match="cannot create the plot folder"):
        write_study_plots(_study(storage, "blocked", []), blocker / "plots")


def test_pareto_front() -> None:
    # (throughput, ttft): maximise the first, minimise the second
    pts = [(100.0, 1.0), (200.0, 2.0), (150.0, 2.5), (200.0, 1.5), (50.0, 0.5), (200.0, 1.5)]
    assert pareto_front(pts) == [0, 3, 4, 5]
    assert pareto_front([]) == []
