"""Checks that run before trial 0: what would otherwise cost server starts to find out.

:func:`check_before_trial_0` is called once by the study after the space is loaded:

* every flag, JSON key and environment variable the space can emit exists in the
  installed vLLM (read from vLLM's own parser, :mod:`autotune.engine._flags`);
* the installed vLLM is inside the tested range (a warning when it is not);
* the shape's prompt + output lengths fit the context vLLM gets (the space's
  ``--max-model-len``, else the model's ``max_position_embeddings``), and the space does
  not ask for more context than the model has;
* the installed vLLM's modules have compiled bytecode, or Python may write it (a warning
  when neither: every server start would compile vLLM's modules again).

Each problem is one :class:`~autotune.errors.AutotuneError` line with the fix.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.config import TuneSettings
from autotune.errors import ConfigError, ShapeError, SpaceError

if TYPE_CHECKING:
    from autotune.engine._flags import EngineSurface
    from autotune.space import SearchSpace
    from autotune.traffic import TrafficShape

__all__ = ["MAX_CLIPPED_FRACTION", "check_before_trial_0", "check_bytecode", "check_context",
           "check_flags", "check_vocab_size"]

logger = logging.getLogger(__name__)

#: More than this share of a replay's requests beyond the context stops the study before
#: trial 0 (they would be clipped: the replay would not be the shape any more).
MAX_CLIPPED_FRACTION = 0.05


def check_before_trial_0(*, space: SearchSpace, shape: TrafficShape, model: Path,
                         settings: TuneSettings,
                         surface: EngineSurface | None = None) -> list[str]:
    """Raise one clear error if the study cannot work; return (and log) warnings."""
    warnings = check_flags(space, surface=surface)
    warnings += check_context(space, shape, model, seed=settings.seed,
                              num_requests=settings.measure.num_requests,
                              shape_path=settings.shape)
    warnings += check_bytecode()
    for w in warnings:
        logger.warning("%s", w)
    return warnings


def check_flags(space: SearchSpace, *, surface: EngineSurface | None = None) -> list[str]:
    """Raise :class:`SpaceError` naming the knob, flag and version of every target the
    installed vLLM lacks; return a warning when its version is outside the tested range
    or its parser cannot be read (then nothing is checked)."""
    from autotune.engine import detect_engine
    from autotune.engine._flags import SUPPORTED, check_space_flags, engine_surface
    from autotune.errors import EngineError

    info = detect_engine()
    if surface is None:
        try:
            surface = engine_surface()
        except EngineError as exc:
            return [f"the space's flags were not checked: {exc}"]
    problems = check_space_flags(space, surface, package=info.package)
    if problems:
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:])})" if problems[1:] else ""
        raise SpaceError(problems[0] + more)
    lo, hi = SUPPORTED
    if not lo <= info.version_tuple[:2] < hi:
        return [(
            f"{info.package} {info.version} is outside the range autotune was tested with "
            f"(>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}); its flags were checked against its own "
            "parser, but behaviour may differ"
        )]
    return []


def model_context(model: Path) -> int | None:
    """The model's own context (config.json max_position_embeddings), None if unknown."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for c in (cfg, cfg.get("text_config") or {}):
        v = c.get("max_position_embeddings")
        if isinstance(v, int) and v > 0:
            return v
    return None


def check_vocab_size(model: Path, *, option: str = "--model") -> None:
    """The model's config.json gives ``vocab_size`` (the prompts' token ids stay below it),
    or a :class:`ConfigError` says where to add it: with the value that the folder's
    ``autotune-model.json`` (a model autotune generated) records, where it has one.
    ``model``: as the user gave it (named in the message)."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return  # a missing or unreadable config.json has checks and messages of its own
    if not isinstance(cfg, dict) or cfg.get("vocab_size") or (
            cfg.get("text_config") or {}).get("vocab_size"):
        return
    where = Path(model) / "config.json"
    try:
        known = json.loads((Path(model) / "autotune-model.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        known = None
    value = (f"{known}: {Path(model) / 'autotune-model.json'} records it" if known else
             "N: the size of the tokenizer's vocabulary (tokenizer.json's model.vocab)")
    raise ConfigError(f"{option} {model}: {where} has no vocab_size, which the prompts need "
                      f"(their token ids stay below it); add \"vocab_size\": {value}")


def check_context(space: SearchSpace, shape: TrafficShape, model: Path, *, seed: int = 0,
                  num_requests: int | None = None,
                  shape_path: Path | str | None = None) -> list[str]:
    """Raise if the shape's prompt + output lengths do not fit the context vLLM gets; the
    error's fix names ``shape_path`` (the shape's file), so that it runs as printed."""
    from autotune.traffic import context_overflow

    where = space.source or space.name
    ctx_model = model_context(model)
    raw = space.fixed_flag("--max-model-len")
    ctx_space: int | None = None
    if raw is not None:
        try:
            ctx_space = int(raw)
        except ValueError:
            raise SpaceError(f"{where}: --max-model-len {raw!r} is not a whole number") from None
    if ctx_space is not None and ctx_model is not None and ctx_space > ctx_model:
        raise SpaceError(
            f"{where}: --max-model-len {ctx_space} is above the model's context "
            f"(max_position_embeddings {ctx_model} in {model}/config.json) and vLLM refuses "
            f"to start; lower it to {ctx_model} or less"
        )
    context = ctx_space or ctx_model
    if context is None:
        return []
    over, n, longest = context_overflow(shape, context=context, seed=seed,
                                        num_requests=num_requests)
    if over == 0:
        return []
    by = f"--max-model-len {context} in {where}" if ctx_space else f"the model's {context}"
    fix = ("raise --max-model-len in the space's fixed_flags (the model allows "
           f"{ctx_model})" if ctx_space and ctx_model and ctx_space < ctx_model
           else "use a model with a longer context")
    line = (
        f"shape {shape.name!r}: {over} of {n} requests ({over / n:.0%}) need more than the "
        f"{context}-token context ({by}; longest prompt + output {longest:,.0f})"
    )
    if over / n > MAX_CLIPPED_FRACTION:
        import shlex

        source = shlex.quote(str(shape_path)) if shape_path is not None else shape.name
        out = shlex.quote(f"{shape.name}-{context}.json")
        raise ShapeError(
            f"{line}; {fix}, or clip the shape's lengths: autotune shape clip "
            f"{source} --max-total-tokens {context} -o {out} (then tune with --shape {out})"
        )
    return [f"{line}: they are clipped to fit"]


#: Modules of vLLM that every server start imports (the API server and its configuration).
BYTECODE_PROBES = ("__init__.py", "entrypoints/openai/api_server.py", "engine/arg_utils.py",
                   "config/model.py")


def check_bytecode(package: str = "vllm", *, package_dir: Path | None = None,
                   dont_write: bool | None = None) -> list[str]:
    """A warning when the installed ``package`` (vLLM) has no compiled bytecode and this
    Python will not write any: each server start (the API server and its engine process,
    both importing vLLM) then compiles vLLM's modules from source again. On the H200 host,
    whose image sets ``PYTHONDONTWRITEBYTECODE`` and whose vLLM was installed with
    ``pip --no-compile``, that was ~25 s of every start (69-87 s; 49-57 s once compiled,
    experiments/h200-trust, note 12). Nothing is imported; ``package_dir`` and
    ``dont_write`` (default: ``sys.flags.dont_write_bytecode``) are for tests."""
    if package_dir is None:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            return []
        locations = list(spec.submodule_search_locations or []) if spec else []
        if not locations:
            return []
        package_dir = Path(locations[0])
    compiled = [Path(importlib.util.cache_from_source(str(package_dir / p)))
                for p in BYTECODE_PROBES if (package_dir / p).is_file()]
    missing = [pyc for pyc in compiled if not pyc.exists()]
    if not missing:
        return []  # compiled, or not a package laid out like vLLM's
    if dont_write is None:
        dont_write = bool(sys.flags.dont_write_bytecode)
    cache_dir = missing[0].parent
    writable_at = cache_dir if cache_dir.exists() else cache_dir.parent
    if not dont_write and os.access(writable_at, os.W_OK):
        return []  # the first start writes them
    why = ("PYTHONDONTWRITEBYTECODE is set" if dont_write
           else f"{writable_at} is not writable")
    return [(
        f"{package} at {package_dir} has no compiled bytecode and Python will not write it "
        f"({why}): every server start compiles its modules again (~25 s a start on the "
        f"H200 host); compile them once: {sys.executable} -m compileall -q -j 0 "
        f"{package_dir.parent}"
    )]
