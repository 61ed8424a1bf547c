"""The study's TPE with weighted observations (pure: in-memory Optuna studies)."""

from __future__ import annotations

import math

import optuna
import pytest
from optuna.distributions import FloatDistribution

from autotune.results import Learned
from autotune.results._warm import shape_weight
from autotune.store import A
from autotune.study._sampler import WeightedTPESampler, observation_weight

SPACE = {"x": FloatDistribution(0.0, 1.0)}


def _trial(x: float, value: float, weight: float | None = None) -> optuna.trial.FrozenTrial:
    attrs = {A.PRIOR: {"study": "old", "trial": 0, "weight": weight}} if weight is not None \
        else {}
    return optuna.trial.create_trial(params={"x": x}, distributions=SPACE, value=value,
                                     user_attrs=attrs)


def _samples(sampler: optuna.samplers.BaseSampler, n: int = 6) -> list[float]:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.add_trials([_trial(x / 10, -abs(x / 10 - 0.3)) for x in range(10)])
    out = []
    for _ in range(n):
        t = study.ask(SPACE)
        out.append(t.params["x"])
        study.tell(t, -abs(t.params["x"] - 0.3))
    return out


def test_without_weighted_priors_it_samples_exactly_as_tpe() -> None:
    assert _samples(WeightedTPESampler(seed=3)) == _samples(optuna.samplers.TPESampler(seed=3))


def test_a_prior_counts_in_the_estimators_with_its_weight() -> None:
    sampler = WeightedTPESampler(seed=0)
    study = optuna.create_study(sampler=sampler)
    trials = [_trial(0.2, 1.0, weight=0.25), _trial(0.8, 1.0)]
    mpe = sampler._build_parzen_estimator(study, SPACE, trials, handle_below=False)
    w = mpe._mixture_distribution.weights
    assert math.isclose(w[0] / w[1], 0.25)  # TPE's own weights are equal below 25 trials


@pytest.mark.parametrize(("attrs", "weight"), [
    ({}, 1.0), ({A.PRIOR: {"study": "a"}}, 1.0), ({A.PRIOR: {"weight": 0.4}}, 0.4),
    ({A.PRIOR: {"weight": -1}}, 1.0), ({A.PRIOR: {"weight": True}}, 1.0)])
def test_observation_weight_reads_a_prior_s_weight(attrs: dict[str, object],
                                                   weight: float) -> None:
    t = optuna.trial.create_trial(params={"x": 0.5}, distributions=SPACE, value=1.0,
                                  user_attrs=attrs)
    assert observation_weight(t) == weight


def test_shape_weight_falls_with_the_shape_distance() -> None:
    assert shape_weight(0.0) == 1.0 and shape_weight(1.0) == 0.5
    assert math.isclose(shape_weight(3.0), 0.1)


def test_the_first_line_names_the_studies_and_their_weights() -> None:
    learned = Learned([_trial(0.1, 1.0, 1.0)] * 12, [("a", 8, 0.0, 1.0), ("b", 4, 1.0, 0.5)],
                      [])
    assert learned.line() == (
        "learned from 12 earlier trial(s) of 2 studies, each reading weighted by how near its "
        "shape is to this one: a (8 trial(s), shape distance 0.00, weight 1.00), b (4 "
        "trial(s), shape distance 1.00, weight 0.50)")
    assert Learned([], [], ["study c: its shape file x no longer exists"]).line().startswith(
        "learned from no earlier study: none in the store on this model and hardware")


def test_trials_without_every_param_of_the_space_are_left_out_as_tpe_does() -> None:
    sampler = WeightedTPESampler(seed=0)
    study = optuna.create_study(sampler=sampler)
    other = optuna.trial.create_trial(params={"y": 1.0}, distributions={
        "y": FloatDistribution(0.0, 2.0)}, value=1.0, user_attrs={A.PRIOR: {"weight": 0.5}})
    trials = [_trial(0.2, 1.0, weight=0.25), other, _trial(0.8, 1.0)]
    mpe = sampler._build_parzen_estimator(study, SPACE, trials, handle_below=False)
    w = mpe._mixture_distribution.weights
    assert len(w) == 3 and math.isclose(w[0] / w[1], 0.25)  # two kept, and the prior
