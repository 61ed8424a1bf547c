"""Screen, then refine: the promotion rule, the coarse readings of a throughput run and of
a capacity search, the rung counts of a study, and rungs read back from the storage."""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

import pytest

from autotune.measure import LogWatch, Screen, SegmentRule, SegmentWatch
from autotune.measure._screen import bracket_closed, coarse_ready
from autotune.store import A, State, rung_counts
from autotune.study import promotion_bar, rung0_readings, rungs_line
from autotune.trial import CapacitySearch, Level, search_capacity

REPO = Path(__file__).resolve().parents[2]


def test_a_coarse_leader_or_a_possible_winner_is_promoted_the_rest_screened() -> None:
    s = Screen(bar=100.0, incumbent=120.0)
    assert s.promotes(100.0, 106.0)  # in the top 1/eta of rung 0
    assert s.promotes(95.0, 121.0)  # below the bar, but its interval reaches the incumbent
    assert not s.promotes(95.0, 110.0)  # neither: screened
    assert not Screen(bar=100.0).promotes(95.0, 1e9)  # no incumbent yet: the bar alone
    assert Screen(bar=-math.inf).promotes(1.0, 1.1)  # rung 0 not filled: every trial goes on
    assert s.promotes(math.nan, math.nan)  # a reading that says nothing stops nothing
    rec = s.record(95.0, 89.3, 100.7, 12.3)
    assert rec == {"value": 95.0, "ci_low": 89.3, "ci_high": 100.7, "bar": 100.0,
                   "incumbent": 120.0, "promoted": False, "at_s": 12.3}


@pytest.mark.parametrize(("readings", "bar"), [
    ([], -math.inf), ([5.0, 9.0], -math.inf),  # fewer than eta: no bar yet
    ([1.0, 3.0, 2.0], 3.0),  # top third of 3: the best
    ([1.0, 6.0, 2.0, 5.0, 3.0, 4.0], 5.0),  # of 6: the top 2
    ([1.0, 7.0, 2.0, 5.0, 3.0, 4.0, 6.0], 5.0),  # of 7: the top ceil(7/3) = 3
])
def test_the_bar_is_the_top_third_of_the_rung_0_readings(readings: list[float],
                                                          bar: float) -> None:
    assert promotion_bar(readings) == bar


def test_coarse_fidelity_is_three_times_the_precision_or_a_2x_bracket() -> None:
    assert coarse_ready(3, 0.06, 0.02) and not coarse_ready(3, 0.061, 0.02)
    assert not coarse_ready(2, 0.01, 0.02)  # two segments are the pruner's, not a reading
    assert bracket_closed(1.0, 2.0) and not bracket_closed(1.0, 2.01)
    assert not bracket_closed(None, 2.0) and not bracket_closed(1.0, None)


def _watch(screen: Screen | None) -> SegmentWatch:
    rule = SegmentRule(precision=0.02, min_segments=5)
    ctl = SegmentWatch(rule, 16, LogWatch(None), None, 7, screen=screen)
    ctl.warm_end, ctl.last_t = 0.0, 0.0
    return ctl


def _feed(ctl: SegmentWatch, rates: list[float]) -> int:
    """Segments of 1 s at these rates; returns how many were fed before it stopped."""
    tokens = 0
    for i, r in enumerate(rates, start=1):
        tokens += int(r)
        if ctl.on_segment(float(i), tokens, 0):
            return i
    return len(rates)


def test_a_run_stops_at_its_coarse_reading_when_it_is_no_leader() -> None:
    rates = [100.0, 101.0, 99.0, 100.0, 100.5, 99.5, 100.0, 100.0]
    ctl = _watch(Screen(bar=150.0, incumbent=160.0))
    n = _feed(ctl, rates)
    assert ctl.stop == "screened" and n == 3
    assert ctl.coarse is not None and not ctl.coarse["promoted"]
    assert 99.0 < ctl.coarse["value"] < 101.0 and ctl.coarse["bar"] == 150.0


def test_a_leader_keeps_its_coarse_reading_and_goes_on_to_full_resolution() -> None:
    rates = [100.0, 101.0, 99.0, 100.0, 100.5, 99.5, 100.0, 100.0]
    ctl = _watch(Screen(bar=90.0))
    _feed(ctl, rates)
    assert ctl.stop == "precise" and len(ctl.rates) >= 5
    assert ctl.coarse is not None and ctl.coarse["promoted"]
    plain = _watch(None)
    _feed(plain, rates)
    assert plain.stop == "precise" and plain.coarse is None


def _probe(true_scale: float, calls: list[float]):  # type: ignore[no-untyped-def]
    def probe(scale: float) -> Level:
        calls.append(scale)
        ok = scale <= true_scale
        return Level(scale=scale, offered_rps=scale, passed=ok,
                     goodput_fraction=1.0 if ok else 0.5, error_rate=0.0)
    return probe


def test_a_capacity_search_stops_at_its_first_2x_bracket_when_screened() -> None:
    seen: list[tuple[float | None, float | None]] = []

    def screen(r: Any) -> bool:
        if not bracket_closed(r.low, r.high):
            return False
        seen.append((r.low, r.high))
        return True

    calls: list[float] = []
    res = search_capacity(_probe(1.3, calls), recorded_rps=2.0,
                          search=CapacitySearch(tolerance=0.1), screen=screen)
    assert res.status == "screened" and calls == [1.0, 2.0] and seen == [(1.0, 2.0)]
    full: list[float] = []
    whole = search_capacity(_probe(1.3, full), recorded_rps=2.0,
                            search=CapacitySearch(tolerance=0.1), screen=lambda r: False)
    assert whole.status == "found" and len(full) > len(calls)


# -- a study -------------------------------------------------------------------------------

def _study(storage: Any, *, screen: bool, trials: int = 14, seed: int = 0) -> Any:
    import optuna

    from autotune.config import TuneSettings
    from autotune.events import StudyCallbacks
    from autotune.space import load_space
    from autotune.study import StudyLoop, TrialTemplate
    from autotune.testing import SimulatedExecutor, fidelity_outcome

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    space = load_space(REPO / "search_spaces" / "cpu.yaml")
    settings = TuneSettings(model=Path("m"), shape=Path("s"), space=REPO / "search_spaces"
                            / "cpu.yaml", trials=trials, seed=seed, recheck=1,
                            use_ray=False, quality_probe=False, objective="throughput",
                            screen=screen, resume=True, pruner="none")
    study = optuna.create_study(direction="maximize", storage=storage, study_name="s",
                                load_if_exists=True,
                                sampler=optuna.samplers.RandomSampler(seed=seed))
    if not study.trials:
        study.enqueue_trial(space.baseline_params(), user_attrs={A.BASELINE: True})

    def evaluate(params: dict[str, Any], spec: Any) -> Any:
        # a value that depends on the params (a surface), read a little apart at rung 0
        v = 100.0 + 10.0 * (zlib.crc32(repr(sorted(params.items())).encode()) % 7)
        return fidelity_outcome(spec, full=v, coarse=v * 1.01)

    sim = SimulatedExecutor(evaluate)
    loop = StudyLoop(study=study, settings=settings, space=space, executor=sim,
                     template=TrialTemplate(model="m", shape=None),
                     callbacks=StudyCallbacks([sim]))
    loop.run()
    return study, loop


def test_a_study_screens_trials_keeps_their_readings_and_judges_on_full_ones(
        tmp_path: Path) -> None:
    from optuna.trial import TrialState

    from autotune.store import readings

    study, loop = _study(f"sqlite:///{tmp_path / 'a.db'}", screen=True)
    trials = study.get_trials(deepcopy=False)
    screened = [t for t in trials if t.user_attrs.get(A.STATE) == State.SCREENED]
    assert screened, "no trial stopped at rung 0"
    for t in screened:  # told PRUNED, its coarse reading kept with the bar it missed
        assert t.state == TrialState.PRUNED and t.user_attrs[A.RUNG] == 0
        c = t.user_attrs[A.SCREEN]
        assert not c["promoted"] and c["value"] < c["bar"]
        assert t.user_attrs[A.METRICS]["output_tokens_per_s"] == c["value"]
        assert t.intermediate_values  # the sampler sees its reading
    counts = rung_counts(trials)
    assert counts["screened"] == len(screened) and counts["refined"] >= 1
    # the verdict and the re-check read full-resolution trials only
    used = {t.number for ts in readings(study).values() for t in ts}
    assert not used & {t.number for t in screened}
    rechecked = {t.user_attrs.get(A.RECHECK_OF) for t in trials} - {None}
    assert not rechecked & {t.number for t in screened}
    phases = study.user_attrs[A.GPU_PHASES]
    assert phases["screened"] == pytest.approx(len(screened) * 1.0)
    assert rungs_line(counts).startswith(f"rungs: {len(screened)} screened at rung 0, ")
    assert loop.phases.spent["screened"] > 0


def test_no_screen_measures_every_trial_to_full_resolution(tmp_path: Path) -> None:
    study, _ = _study(f"sqlite:///{tmp_path / 'b.db'}", screen=False)
    trials = study.get_trials(deepcopy=False)
    assert rung_counts(trials) == {}
    assert not any(t.user_attrs.get(A.STATE) == State.SCREENED for t in trials)
    assert rungs_line({}) == ""


def test_a_resumed_study_ranks_against_the_rungs_in_its_storage(tmp_path: Path) -> None:
    import optuna

    url = f"sqlite:///{tmp_path / 'c.db'}"
    study, _ = _study(url, screen=True, trials=10)
    before = rung0_readings(study.get_trials(deepcopy=False))
    counts = rung_counts(study.get_trials(deepcopy=False))
    # a fresh process: only the storage knows the rungs
    again = optuna.load_study(study_name="s", storage=url)
    assert rung0_readings(again.get_trials(deepcopy=False)) == before
    assert promotion_bar(rung0_readings(again.get_trials())) == promotion_bar(before)
    resumed, _ = _study(url, screen=True, trials=16)
    after = rung_counts(resumed.get_trials(deepcopy=False))
    for t in again.get_trials(deepcopy=False):  # the first session's rungs are kept
        kept = resumed.trials[t.number]
        assert kept.user_attrs.get(A.RUNG) == t.user_attrs.get(A.RUNG)
    assert sum(after.values()) > sum(counts.values())
    assert after["screened"] >= counts["screened"]


def test_a_capacity_trial_keeps_its_first_2x_bracket_as_its_coarse_reading() -> None:
    from autotune.trial import CapacityResult, TrialOutcome, TrialSpec
    from autotune.trial._open_trial import _screen_test

    spec = TrialSpec(number=3, model="m", flags=(), env={}, shape=None,
                     screen=Screen(bar=10.0, incumbent=12.0))
    outcome = TrialOutcome(number=3, ok=True)
    test = _screen_test(spec, outcome, 2.0, 0.0)
    assert test is not None
    assert not test(CapacityResult(recorded_rps=2.0, low=1.0, high=None))  # open: no reading
    assert test(CapacityResult(recorded_rps=2.0, low=1.0, high=2.0))  # 2 to 4 req/s: screened
    assert outcome.coarse is not None and outcome.coarse["value"] == 2.0
    assert outcome.coarse["ci_high"] == 4.0 and not outcome.coarse["promoted"]
    assert not test(CapacityResult(recorded_rps=2.0, low=1.0, high=1.5))  # the first is kept
    leader = TrialOutcome(number=3, ok=True)
    test = _screen_test(spec, leader, 2.0, 0.0)
    assert test is not None and not test(CapacityResult(recorded_rps=2.0, low=5.0, high=8.0))
    assert leader.coarse is not None and leader.coarse["promoted"]
    unscreened = TrialSpec(number=4, model="m", flags=(), env={}, shape=None)
    assert _screen_test(unscreened, TrialOutcome(number=4, ok=True), 2.0, 0.0) is None
