"""``autotune export`` as one library call: check, then render (:func:`export`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from autotune.deploy._fit import Fit, check_fit, context_of
from autotune.deploy._render import ExportOptions, compose_file, k8s_yaml, serve_script
from autotune.deploy._source import ExportSource
from autotune.deploy._standin import Deployable, deployable
from autotune.errors import AutotuneError

if TYPE_CHECKING:
    from autotune.traffic import TrafficShape

__all__ = ["ExportError", "Exported", "deploy_config", "export"]

Format = Literal["k8s", "compose", "serve"]


class ExportError(AutotuneError):
    """A config that must not be exported as it is (never feasible, cannot serve the shape)."""


@dataclass(frozen=True)
class Exported:
    """The rendered file and what the user is told about it."""

    text: str
    deployable: Deployable
    fit: Fit | None
    notes: list[str] = field(default_factory=list)


def deploy_config(src: ExportSource) -> Deployable:
    """The config's flags as the trial's vLLM version spelt them, without stand-in-only
    settings."""
    from autotune.engine import translate_flags

    flags = list(src.flags)
    if src.engine_version:
        try:
            version = tuple(int(p) for p in src.engine_version.split(".")[:3])
        except ValueError:
            version = ()
        if version:
            flags = translate_flags(flags, version)
    return deployable(flags, src.env)


def export(src: ExportSource, *, fmt: Format, options: ExportOptions | None = None,
           shape: TrafficShape | None = None, force: bool = False) -> Exported:
    """Render ``src`` as ``fmt``. Refused (:class:`ExportError`) without ``force`` when the
    study never measured the config feasible or its context cannot hold ``shape`` (the
    study's own shape when None and its file is here)."""
    opts = options or ExportOptions()
    notes: list[str] = []
    if not src.feasible:
        if not force:
            raise ExportError(f"study {src.study} never measured trial {src.trial}'s config "
                              "feasible; export it anyway with --force (the files then say so)")
        notes.append(f"trial {src.trial} was never measured feasible (exported with --force)")
    dep = deploy_config(src)
    if shape is None and src.shape_path and Path(src.shape_path).exists():
        from autotune.traffic import load_shape

        shape = load_shape(Path(src.shape_path))
    elif shape is None:
        notes.append(f"the study's shape file {src.shape_path or '(none recorded)'} is not "
                     "here: the context was not checked against the traffic (give --shape)")
    fit = None
    if shape is not None:
        ctx, where = context_of(dep.flags, src.model)
        fit = check_fit(shape, ctx, where)
        if not fit.ok and not force:
            raise ExportError(fit.message + "; or export anyway with --force")
        if not fit.ok:
            notes.append(fit.message)
        elif fit.warning:
            notes.append(fit.warning)
    text = {"k8s": lambda: k8s_yaml(src, dep, opts),
            "compose": lambda: compose_file(src, dep, opts),
            "serve": lambda: serve_script(src, dep)}[fmt]()
    return Exported(text=text, deployable=dep, fit=fit, notes=notes)
