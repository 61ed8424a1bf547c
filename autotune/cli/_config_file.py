"""``autotune tune --config study.yaml``: every tune option in a file, flags override it.

The file's keys are the flags' names without ``--`` (``trials``, ``start-timeout`` or
``start_timeout``, ``slo``, ...); a ``--no-X`` flag is the key ``X`` with ``false``
(``baseline: false``), and the settings' own field names (``timeout_s``, ``use_ray``) are
accepted too, so the resolved config a study saves (``OUT/config.yaml``) runs again as it is.
Pure functions over the tune parser's argparse actions: they read no global state.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError

__all__ = ["apply_config", "config_keys", "explicit_dests", "load_config_file", "render_config"]

# options of the command itself, not of the study
_NOT_IN_FILE = {"help", "config", "print_config", "json", "quiet", "verbose"}
# settings field -> the parser's dest (TuneSettings names a few options differently)
_SETTINGS_ALIASES = {"timeout_s": "timeout", "start_timeout_s": "start_timeout",
                     "request_timeout_s": "request_timeout", "ray": "use_ray"}


def _study_actions(actions: Iterable[argparse.Action]) -> list[argparse.Action]:
    return [a for a in actions if a.option_strings and a.dest not in _NOT_IN_FILE
            and a.dest != argparse.SUPPRESS]


def config_keys(actions: Iterable[argparse.Action]) -> dict[str, tuple[argparse.Action, bool]]:
    """File key -> (action, negated): ``negated`` keys take the opposite of the flag's
    meaning (``no-baseline: true`` == ``baseline: false``)."""
    out: dict[str, tuple[argparse.Action, bool]] = {}
    for a in _study_actions(actions):
        out[a.dest] = (a, False)
        for flag in a.option_strings:
            if flag.startswith("--"):
                name = flag[2:].replace("-", "_")
                out.setdefault(name, (a, isinstance(a, argparse._StoreFalseAction)))
    for alias, dest in _SETTINGS_ALIASES.items():
        if dest in out:
            out[alias] = out[dest]
    return out


def load_config_file(path: Path) -> dict[str, object]:
    """The mapping in a YAML (or JSON) config file; a clear ConfigError otherwise."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        obj = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML: {str(exc).splitlines()[0]}") \
            from None
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise ConfigError(f"--config {path}: the file must be a mapping of option: value "
                          "(autotune tune --print-config writes one)")
    return {str(k): v for k, v in obj.items()}


def explicit_dests(actions: Iterable[argparse.Action], argv: Sequence[str]) -> set[str]:
    """Dests of the options given on the command line (they override the file)."""
    given = set()
    for a in actions:
        for flag in a.option_strings:
            if any(tok == flag or tok.startswith(flag + "=") for tok in argv):
                given.add(a.dest)
    return given


def _convert(a: argparse.Action, key: str, value: Any, where: str) -> object:  # a YAML value
    if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: '{key}' must be true or false, not {value!r}")
        return value
    if isinstance(a, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [v if isinstance(v, dict) else str(v) for v in items]
    if value is None:
        return None
    if a.dest == "slo" and isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if a.dest == "api_price" and isinstance(value, list):  # [IN, OUT] as config.yaml has it
        return ",".join(str(v) for v in value)
    if isinstance(value, (dict, list)):
        raise ConfigError(f"{where}: '{key}' takes one value, not {type(value).__name__}")
    conv = a.type if callable(a.type) else str
    try:
        out = conv(value if conv is not str else str(value))
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: '{key}': {value!r} is not a valid "
                          f"{getattr(conv, '__name__', 'value')}") from None
    if a.choices is not None and out not in a.choices:
        raise ConfigError(f"{where}: '{key}': {value!r} is not one of "
                          f"{', '.join(map(str, a.choices))}")
    return out


def apply_config(args: argparse.Namespace, actions: Iterable[argparse.Action],
                 values: Mapping[str, object], *, explicit: set[str], where: str) -> None:
    """Set each file value on ``args`` unless its option was given on the command line."""
    keys = config_keys(actions)
    seen: dict[str, str] = {}
    for raw_key, value in values.items():
        key = raw_key.replace("-", "_")
        if key not in keys:
            near = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.6)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ConfigError(f"{where}: unknown key '{raw_key}'{hint} (the keys are the "
                              "flags of 'autotune tune' without '--'; 'autotune tune "
                              "--print-config' writes them all)")
        action, negated = keys[key]
        if action.dest in seen:
            raise ConfigError(f"{where}: '{raw_key}' and '{seen[action.dest]}' set the same "
                              "option; keep one")
        seen[action.dest] = raw_key
        converted = _convert(action, raw_key, value, where)
        if negated:
            converted = not converted
        if action.dest not in explicit:
            setattr(args, action.dest, converted)


def render_config(args: argparse.Namespace, actions: Iterable[argparse.Action],
                  *, required: Iterable[str] = ()) -> str:
    """A config file of every study option with its current value and help as comments
    (what ``--print-config`` writes: a starting point to edit)."""
    import yaml

    required = set(required)
    lines = ["# autotune tune --config FILE: every option of 'autotune tune' (flags given on",
             "# the command line override the file). Generated by 'autotune tune --print-config'.",
             ""]
    for a in _study_actions(actions):
        value = getattr(args, a.dest, a.default)
        if isinstance(value, Path):
            value = str(value)
        if a.dest == "slo" and isinstance(value, str):
            from autotune.config import parse_slo

            value = parse_slo(value)
        if isinstance(a, argparse._AppendAction):
            value = [_json_or_text(v) for v in (value or [])]
        help_text = " ".join((a.help or "").split()).replace("%%", "%")
        if isinstance(a, argparse._StoreFalseAction):
            help_text = f"false = {a.option_strings[0]}: {help_text}"
        for chunk in _wrap(help_text, 88):
            lines.append(f"# {chunk}")
        text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
        text = text.removesuffix("...").strip()
        lines.append(f"{a.dest}: {text}" if value is not None or a.dest in required
                     else f"# {a.dest}: {text}")
        lines.append("")
    return "\n".join(lines)


def _json_or_text(v: object) -> object:
    import json

    if isinstance(v, str) and not v.startswith("@"):
        try:
            return json.loads(v)
        except ValueError:
            pass
    return v


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width) or [""]
