"""Search spaces: YAML -> Optuna distributions, conditions, rules and engine argv.

A space file declares knobs (each maps to a ``vllm serve`` flag, a key of a JSON flag such
as ``--speculative-config``, or an environment variable), conditions (a knob that exists
only when others have some values) and rules (combinations vLLM rejects), so an invalid
sample never costs a server start. See ``docs/search-spaces.md`` and ``search_spaces/``.

Expressions in ``when``/``rules``/``derive`` are a small, safe subset of Python:
comparisons, ``and``/``or``/``not``, ``in``, arithmetic, ``min``/``max``, knob names and
the facts ``device`` ("cpu"/"cuda"), ``hybrid``, ``mtp``, ``moe`` (model facts),
``gpu_arch`` (e.g. "sm90"), ``avx512`` (the CPU has AVX-512 or AMX), ``gpus`` (GPUs of the
largest node the trials run on; 0 without GPUs), ``weights_dtype`` (the checkpoint's dtype
from config.json, e.g. "bfloat16"; "" when it names none), ``prequantized`` (config.json
carries a ``quantization_config``), and the traffic's
``streams`` (concurrent streams of the replay, counted as ``autotune.kernels.streams_of``
does) and ``prompt_p90`` (tokens; both 0 when the space is loaded without a traffic
shape). A knob that is inactive (its condition is false) has the value ``None`` in expressions.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from autotune.errors import SpaceError
from autotune.events import ParamValue
from autotune.parallelism import flag_value
from autotune.space._expr import _Expr
from autotune.space._facts import _FACTS, ModelFacts, _has_routed_experts

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution
    from optuna.trial import BaseTrial


class Knob(BaseModel):
    """One searchable engine setting."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = ""
    type: Literal["int", "float", "categorical", "bool"]
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    choices: list[ParamValue] | None = None
    # Where the value goes (exactly one of flag / json / env, or derive-only):
    flag: str | None = None  # "--max-num-seqs"; bools become --x / --no-x
    # e.g. "--speculative-config.num_speculative_tokens"
    json_flag: str | None = Field(default=None, alias="json")
    env: str | None = None  # "OMP_NUM_THREADS"
    virtual: bool = False  # no flag of its own: only feeds `derive` expressions
    omit_when: ParamValue = None  # value that means "leave the flag out" (e.g. MTP depth 0 = off)
    when: str | None = None  # condition for the knob to exist
    default: ParamValue = None  # vLLM's own default (the baseline trial uses it; None = unknown)
    lossy: bool = False  # changes outputs (quality probe)
    # "moe": the value "tuned" sets the knob's env to the folder of kernel configs the
    # study tunes for this model, GPU and shape before trial 0 (autotune kernels moe)
    tuned: Literal["moe"] | None = None
    help: str = ""

    @model_validator(mode="after")
    def _check(self) -> Knob:
        targets = [t for t in (self.flag, self.json_flag, self.env) if t]
        if self.virtual and targets:
            raise ValueError("a virtual knob feeds 'derive' only; remove its flag/json/env")
        if not self.virtual and len(targets) != 1:
            raise ValueError("give exactly one of 'flag', 'json' or 'env' (or virtual: true)")
        if self.flag and not self.flag.startswith("-"):
            raise ValueError(f"flag {self.flag!r} must start with '-'")
        if self.json_flag and "." not in self.json_flag:
            raise ValueError(
                f"json {self.json_flag!r} must be FLAG.KEY, e.g. --speculative-config.method"
            )
        if self.type in ("int", "float"):
            if self.low is None or self.high is None:
                raise ValueError(f"a {self.type} knob needs 'low' and 'high'")
            if not (math.isfinite(self.low) and math.isfinite(self.high)):
                raise ValueError("'low' and 'high' must be finite numbers")
            if self.low > self.high:
                raise ValueError(f"low ({self.low:g}) is above high ({self.high:g})")
            if self.log and self.low <= 0:
                raise ValueError(f"a log-scale knob needs low > 0, got {self.low:g}")
            if self.choices is not None:
                raise ValueError("'choices' belongs to categorical knobs")
        elif self.type == "categorical":
            if not self.choices:
                raise ValueError("a categorical knob needs a non-empty 'choices' list")
            if len({json.dumps(c) for c in self.choices}) != len(self.choices):
                raise ValueError(f"'choices' has duplicates: {self.choices}")
        if self.tuned is not None and (
            not self.env or self.type != "categorical" or "tuned" not in (self.choices or [])
        ):
            raise ValueError(
                f"tuned: {self.tuned} needs an 'env' target (e.g. VLLM_TUNED_CONFIG_FOLDER) and "
                "a categorical knob with the choice 'tuned'")
        if self.default is not None and not self.contains(self.default):
            raise ValueError(f"default {self.default!r} is outside the knob's values")
        return self

    @property
    def bounds(self) -> tuple[float, float]:
        """(low, high) of an int or float knob (its validator makes sure both are set)."""
        if self.low is None or self.high is None:
            raise SpaceError(f"knob {self.name!r} is {self.type}: it has no low/high")
        return self.low, self.high

    def contains(self, value: object) -> bool:
        if self.type == "bool":
            return isinstance(value, bool)
        if self.type == "categorical":
            return value in (self.choices or [])
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        low, high = self.bounds
        return low <= float(value) <= high

    def distribution(self) -> BaseDistribution:
        import optuna.distributions as d

        if self.type == "bool":
            return d.CategoricalDistribution([False, True])
        if self.type == "categorical":
            return d.CategoricalDistribution(list(self.choices or []))
        low, high = self.bounds
        if self.type == "int":
            return d.IntDistribution(int(low), int(high), log=self.log, step=int(self.step or 1))
        return d.FloatDistribution(low, high, log=self.log, step=self.step)


class Rule(BaseModel):
    """A combination vLLM rejects: ``when`` true means the sample is invalid."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    when: str
    reason: str


class LaunchSpec(BaseModel):
    """Engine flags and environment for one configuration."""

    model_config = ConfigDict(frozen=True)

    flags: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)


#: vLLM's MoE routing simulator (``uniform_random``, ``normal_routing``): a stand-in's random
#: weights route every token to the same few experts; the hybrid space's stand_in part sets it
ROUTING_SIMULATION_ENV = "VLLM_MOE_ROUTING_SIMULATION_STRATEGY"


def dummy_routing_warning(model: str | Path, flags: Sequence[str], env: Mapping[str, str],
                          *, fix: str = "") -> str | None:
    """A one-line warning when a MoE model is served with ``--load-format dummy`` and without
    a routing simulator: its random weights send every token to the same experts, so the
    MoE layers cost a fraction of a trained model's (None when that is not the case).
    ``fix``: what to do about it, as the caller's user does it (default: bench's --env)."""
    joined = " ".join(flags)
    if "--load-format dummy" not in joined and "--load-format=dummy" not in joined:
        return None
    if env.get(ROUTING_SIMULATION_ENV) or os.environ.get(ROUTING_SIMULATION_ENV):
        return None
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not _has_routed_experts(cfg):
        return None
    fix = fix or f"add --env {ROUTING_SIMULATION_ENV}=uniform_random"
    return (f"warning: dummy weights route every token to the same few experts, so this MoE "
            f"model's expert layers cost a fraction of a trained model's; {fix} to spread them "
            "as a trained router does")


#: a check beyond the rules: (params, their launch spec) -> why vLLM would refuse them
Check = Callable[[Mapping[str, object], LaunchSpec], list[str]]


class _StandIn(BaseModel):
    """What only a stand-in model needs (random weights): applied unless ``real_weights``."""

    model_config = ConfigDict(extra="forbid")

    fixed_flags: list[str] = Field(default_factory=list)
    fixed_env: dict[str, str] = Field(default_factory=dict)
    fixed_json: dict[str, dict[str, object]] = Field(default_factory=dict)
    derive: dict[str, str] = Field(default_factory=dict)


class _SpaceFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    fixed_flags: list[str] = Field(default_factory=list)
    fixed_env: dict[str, str] = Field(default_factory=dict)
    fixed_json: dict[str, dict[str, object]] = Field(default_factory=dict)
    knobs: dict[str, Knob]
    rules: list[Rule] = Field(default_factory=list)
    # "--flag" or "--json-flag.key" -> expression; None leaves the flag out. Applied to every
    # trial, the baseline included.
    derive: dict[str, str] = Field(default_factory=dict)
    # dropped when the model is a real checkpoint (ModelFacts.real_weights)
    stand_in: _StandIn | None = None

    @field_validator("knobs")
    @classmethod
    def _non_empty(cls, v: dict[str, Knob]) -> dict[str, Knob]:
        if not v:
            raise ValueError("a space needs at least one knob")
        return v


class SearchSpace:
    """A validated search space bound to the model facts it is used with."""

    def __init__(self, spec: _SpaceFile, *, facts: ModelFacts | None = None,
                 source: str = "") -> None:
        self.name = spec.name
        self.description = spec.description
        self.source = source
        self.facts = facts or ModelFacts()
        if spec.stand_in is not None and not self.facts.real_weights:
            extra = spec.stand_in
            merged = {f: {**spec.fixed_json.get(f, {}), **o} for f, o in extra.fixed_json.items()}
            spec = spec.model_copy(update={
                "fixed_flags": [*spec.fixed_flags, *extra.fixed_flags],
                "fixed_env": {**spec.fixed_env, **extra.fixed_env},
                "fixed_json": {**spec.fixed_json, **merged},
                "derive": {**spec.derive, **extra.derive},
            })  # fmt: skip
        self._spec = spec
        self.knobs: dict[str, Knob] = {
            k: v.model_copy(update={"name": k}) for k, v in spec.knobs.items()
        }
        names = set(self.knobs) | set(_FACTS)
        where = source or spec.name
        self._when = {
            k: _Expr(v.when, names, f"{where}: knob {k!r} 'when'")
            for k, v in self.knobs.items()
            if v.when
        }
        self._rules = [
            (_Expr(r.when, names, f"{where}: rule {r.reason!r}"), r.reason) for r in spec.rules
        ]
        self._derive = {
            target: _Expr(expr, names, f"{where}: derive {target!r}")
            for target, expr in spec.derive.items()
        }
        for k, e in self._when.items():
            if k in e.names:
                raise SpaceError(f"{where}: knob {k!r} has a condition on itself")
        # kind -> folder of tuned kernel configs, or kind -> why there is none (with_tuned)
        self.tuned_dirs: dict[str, str] = {}
        self.tuned_missing: dict[str, str] = {}
        # checks that need more than an expression: (params, launch) -> reasons (with_checks)
        self.checks: tuple[Check, ...] = ()

    # -- tuned kernels ------------------------------------------------------------------------
    def tuned_kinds(self) -> dict[str, list[str]]:
        """Kernel kinds some knob can point at (kind -> knob names), e.g. {"moe": [...]}."""
        out: dict[str, list[str]] = {}
        for name, knob in self.knobs.items():
            if knob.tuned:
                out.setdefault(knob.tuned, []).append(name)
        return out

    def with_tuned(self, dirs: Mapping[str, str], missing: Mapping[str, str] | None = None
                   ) -> SearchSpace:
        """This space with kernel folders bound: a knob's "tuned" value sets its env to
        ``dirs[kind]``; a kind in ``missing`` makes "tuned" a rule violation with that
        reason (the sample is rejected before any server starts)."""
        import copy

        bound = copy.copy(self)
        bound.tuned_dirs = dict(dirs)
        bound.tuned_missing = dict(missing or {})
        return bound

    def with_facts(self, facts: ModelFacts) -> SearchSpace:
        """This space bound to other facts (e.g. the GPUs of the executor's nodes)."""
        import copy

        bound = copy.copy(self)
        bound.facts = facts
        return bound

    def with_checks(self, *checks: Check) -> SearchSpace:
        """This space with more checks: ``check(params, launch)`` returns the reasons vLLM
        would refuse (or could not serve) the config, like a rule (e.g. the parallelism
        rules of :mod:`autotune.parallelism`, which read the model and the nodes)."""
        import copy

        bound = copy.copy(self)
        bound.checks = (*self.checks, *checks)
        return bound

    def fixed_flag(self, flag: str) -> str | None:
        """The value ``fixed_flags`` give ``flag`` (``--x V`` or ``--x=V``; the last one
        wins, as in vLLM's argument parser), None when they do not set it."""
        return flag_value(self._spec.fixed_flags, flag)

    # -- facts ------------------------------------------------------------------------------
    def _env(self, params: Mapping[str, object]) -> dict[str, object]:
        env: dict[str, object] = dict.fromkeys(self.knobs)
        env.update(self.facts.model_dump())
        env.update(params)
        return env

    def is_active(self, knob: str, params: Mapping[str, object]) -> bool:
        cond = self._when.get(knob)
        return True if cond is None else bool(cond(self._env(params)))

    # -- sampling ---------------------------------------------------------------------------
    def suggest(self, trial: BaseTrial, *, baseline: bool = False) -> dict[str, ParamValue]:
        """Sample a config with an Optuna trial (define-by-run, conditions respected).

        With ``baseline=True`` only knobs with a known vLLM ``default`` are set (to it), so the
        trial stands for vLLM's defaults.
        """
        params: dict[str, ParamValue] = {}
        for name, knob in self.knobs.items():  # YAML order: conditions name earlier knobs
            if not self.is_active(name, params):
                continue
            if baseline and knob.default is None:
                continue
            if knob.type in ("bool", "categorical"):
                params[name] = trial.suggest_categorical(
                    name, [False, True] if knob.type == "bool" else list(knob.choices or [])
                )
            elif knob.type == "int":
                low, high = knob.bounds
                params[name] = trial.suggest_int(name, int(low), int(high), log=knob.log,
                                                 step=int(knob.step or 1))
            else:
                low, high = knob.bounds
                params[name] = trial.suggest_float(name, low, high, log=knob.log, step=knob.step)
        return params

    def baseline_params(self) -> dict[str, ParamValue]:
        """Knob values of vLLM's defaults (for enqueueing the baseline trial)."""
        params: dict[str, ParamValue] = {}
        for name, knob in self.knobs.items():
            if knob.default is not None and self.is_active(name, params):
                params[name] = knob.default
        return params

    def violations(self, params: Mapping[str, object]) -> list[str]:
        """Reasons this config would be rejected by vLLM (empty when valid)."""
        out: list[str] = []
        env = self._env(params)
        for name, value in params.items():
            knob = self.knobs.get(name)
            if knob is None:
                out.append(f"unknown knob {name!r}")
            elif not knob.contains(value):
                out.append(f"{name}={value!r} is outside the knob's values")
        for expr, reason in self._rules:
            if expr(env) is True:
                out.append(reason)
        for name, value in params.items():
            knob = self.knobs.get(name)
            # before the study binds its kernels (with_tuned) "tuned" is not yet decided
            if knob is not None and knob.tuned and value == "tuned" and (
                    knob.tuned in self.tuned_missing):
                why = self.tuned_missing[knob.tuned]
                out.append(f"{name}=tuned: no tuned {knob.tuned} kernel configs ({why})")
        if self.checks and not out:
            try:
                launch = self.launch_spec(params)
            except SpaceError:  # "tuned" before the kernels are bound: decided later
                return out
            for check in self.checks:
                out.extend(check(params, launch))
        return out

    def lossy_knobs(self, params: Mapping[str, object]) -> list[str]:
        """Lossy knobs set to something other than their reference default."""
        return [
            k for k, v in params.items()
            if k in self.knobs and self.knobs[k].lossy and v != self.knobs[k].default
        ]  # fmt: skip

    # -- launch -----------------------------------------------------------------------------
    def launch_spec(self, params: Mapping[str, object], *, baseline: bool = False) -> LaunchSpec:
        """Engine flags and environment for ``params`` (fixed flags included).

        The baseline passes only the fixed flags: it measures vLLM's own defaults.
        """
        flags: list[str] = list(self._spec.fixed_flags)
        env: dict[str, str] = dict(self._spec.fixed_env)
        json_args: dict[str, dict[str, object]] = {}
        values: dict[str, object] = {} if baseline else dict(params)
        for name, value in values.items():
            knob = self.knobs[name]
            if knob.virtual or value is None or (
                knob.omit_when is not None and value == knob.omit_when
            ):
                continue
            if knob.flag:
                flags.extend(_flag_args(knob.flag, value))
            elif knob.env and knob.tuned and value == "tuned":
                folder = self.tuned_dirs.get(knob.tuned)
                if folder is None:
                    raise SpaceError(
                        f"knob {name!r} is 'tuned' but no {knob.tuned} kernel folder is bound; "
                        f"{self.tuned_missing.get(knob.tuned, 'tune them first')}")
                env[knob.env] = folder
            elif knob.env:
                env[knob.env] = _scalar(value)
            elif knob.json_flag:
                flag, key = knob.json_flag.split(".", 1)
                json_args.setdefault(flag, {})[key] = value
        # Derived flags apply to every trial, the baseline included: they encode what the
        # engine needs whatever the sample (e.g. a workaround for a known engine bug).
        env_vals = self._env(values)
        for target, expr in self._derive.items():
            value = expr(env_vals)
            if value is None:
                continue
            head = target.split(".", 1)[0]
            if "." in target and target.startswith("--") and (
                head in json_args or head in self._spec.fixed_json
            ):
                json_args.setdefault(head, {})[target.split(".", 1)[1]] = value
            else:
                flags.extend(_flag_args(target, value))
        for flag, base in self._spec.fixed_json.items():
            if flag in json_args:  # a JSON flag is passed only when some knob turned it on
                json_args[flag] = {**base, **json_args[flag]}
        for flag, obj in json_args.items():
            flags.extend([flag, json.dumps(obj, sort_keys=True, separators=(",", ":"))])
        return LaunchSpec(flags=tuple(flags), env=env)


def _scalar(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _flag_args(flag: str, value: object) -> list[str]:
    if isinstance(value, bool):
        if flag.startswith("--"):
            return [flag] if value else ["--no-" + flag[2:]]
        return [flag] if value else []
    if flag.startswith("-O") and not flag.startswith("--"):
        return [f"{flag}{_scalar(value)}"]
    return [flag, _scalar(value)]


def load_space(path: str | Path, *, facts: ModelFacts | None = None) -> SearchSpace:
    """Read and validate a search-space YAML file (raises :class:`SpaceError`)."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise SpaceError(
            f"search space {p} not found; pick one of search_spaces/*.yaml"
        ) from None
    except (OSError, yaml.YAMLError) as exc:
        raise SpaceError(f"search space {p} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise SpaceError(f"search space {p} must be a YAML mapping with 'name' and 'knobs'")
    try:
        spec = _SpaceFile.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise SpaceError(f"search space {p} is invalid: {problems}") from None
    return SearchSpace(spec, facts=facts, source=str(p))
