"""The failure model (pure): start failures learned from earlier trials, samples steered
away with the predicted reason, the sampler's insistence, the hit rate."""

from __future__ import annotations

from autotune.space import load_space
from autotune.study._failmodel import MAX_STEERED_IN_A_ROW, FailureModel
from tests.conftest import REPO

SPACE = load_space(REPO / "search_spaces" / "cpu.yaml")


def _cfg(seqs: int, **kw: object) -> dict[str, object]:
    return {"max_num_seqs": seqs, "enable_chunked_prefill": True, **kw}


def _model() -> FailureModel:
    """Earlier trials: every config with max_num_seqs >= 48 ran out of memory."""
    m = FailureModel(space=SPACE)
    for seqs in (4, 8, 12, 16, 24, 32):
        m.add(_cfg(seqs), None)
    for seqs in (48, 56, 64):
        m.add(_cfg(seqs), "oom")
    return m


def test_a_config_near_earlier_start_failures_is_predicted_to_fail_with_their_reason() -> None:
    m = _model()
    pred = m.predict(_cfg(60))
    assert pred.fail and pred.reason == "oom" and pred.p_fail >= 0.6 and pred.neighbours >= 2
    assert pred.text().startswith("predicted to fail to start (oom: ")
    ok = m.predict(_cfg(10))
    assert not ok.fail and ok.p_fail == 0.0


def test_nothing_is_predicted_without_similar_trials() -> None:
    m = FailureModel(space=SPACE)
    assert not m.predict(_cfg(60)).fail and m.predict(_cfg(60)).neighbours == 0
    m.add({"kv_cache_dtype": "fp8_e4m3"}, "oom")  # another space's knob: far away
    m.add({"kv_cache_dtype": "fp8_e4m3", "x": 1}, "oom")
    assert not m.predict(_cfg(60)).fail


def test_one_failure_among_starts_predicts_nothing() -> None:
    m = FailureModel(space=SPACE)
    for seqs in (56, 60):
        m.add(_cfg(seqs), None)
    m.add(_cfg(64), "crash")
    assert not m.predict(_cfg(62)).fail


def test_the_sampler_gets_its_way_when_it_insists() -> None:
    m = _model()
    pred, away = m.steer(_cfg(60))
    assert away and pred.fail
    pred, away = m.steer(_cfg(60))  # the same config again: it runs
    assert not away and pred.fail
    steered = [m.steer(_cfg(50 + i))[1] for i in range(MAX_STEERED_IN_A_ROW + 1)]
    assert steered == [True] * MAX_STEERED_IN_A_ROW + [False]  # then one runs anyway
    assert not m.steer(_cfg(8))[1]
    assert m.steered["oom"] == 1 + MAX_STEERED_IN_A_ROW


def test_the_hit_rate_counts_the_predicted_failures_that_ran() -> None:
    m = _model()
    m.earlier, m.studies = 9, 2
    m.outcome(_cfg(60), "oom", predicted=True)
    m.outcome(_cfg(52), None, predicted=True)  # a false alarm: it started
    m.outcome(_cfg(40), "oom", predicted=False)  # a miss
    m.steer(_cfg(58))
    rec = m.record()
    assert rec == {"earlier_trials": 9, "studies": 2, "steered": 1, "predicted_ran": 2,
                   "predicted_failed": 1, "missed": 1}
    text = m.summary()
    assert text.startswith("failure model (9 earlier trial(s) of 2 studies on this engine and "
                           "hardware): steered 1 sample(s) away (oom 1)")
    assert "of 2 predicted failure(s) the sampler insisted on, 1 failed (hit rate 50%)" in text
    assert text.endswith("start failures it did not predict: 1")
    assert len(m.seen) == 9 + 3  # what ran is learned from


def test_distance_reads_numbers_by_their_share_of_the_knob_s_range() -> None:
    m = FailureModel(space=SPACE)
    knob = SPACE.knobs["max_num_seqs"]
    assert knob.low is not None and knob.high is not None
    d = m.distance({"max_num_seqs": knob.low}, {"max_num_seqs": knob.high})
    assert d == 1.0
    assert m.distance(_cfg(8), _cfg(8)) == 0.0
    assert m.distance({"a": 1}, {"b": 1}) == 1.0


def test_equally_near_trials_of_either_kind_are_weighed_together() -> None:
    m = FailureModel(space=SPACE)
    for reason in ("oom", None, "oom", "crash"):  # the same config, four times
        m.add(_cfg(40), reason)
    pred = m.predict(_cfg(40))
    assert pred.fail and pred.reason == "oom" and pred.p_fail == 0.75 and pred.neighbours == 4
