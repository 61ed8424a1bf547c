"""Read and write traffic-shape JSON files."""

from __future__ import annotations

import json
import os
import re
import shlex
import tempfile
from pathlib import Path

from pydantic import ValidationError

from autotune.errors import ShapeError
from autotune.traffic._models import TrafficShape, compute_fingerprint

__all__ = ["load_shape", "save_shape"]

_NUMBER_LIST = re.compile(r"\[\s*(-?[0-9][-0-9.e+]*(?:,\s*-?[0-9][-0-9.e+]*)*)\s*\]")


def _compact_lists(text: str) -> str:
    """Put lists of numbers (quantiles, rate profiles) on one line each."""
    return _NUMBER_LIST.sub(
        lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text
    )


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {err['msg']}{more}"


def load_shape(path: str | Path) -> TrafficShape:
    """Load and validate a shape file; :class:`ShapeError` says what is wrong and how to fix it.

    The stored fingerprint must match the statistics: a hand-edited shape is refused.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ShapeError(
            f"traffic shape {p} does not exist; fit one from a recorded trace with 'autotune "
            f"shape fit' and -o {shlex.quote(str(p))}"
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ShapeError(f"traffic shape {p} cannot be read: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ShapeError(
            f"traffic shape {p} line {exc.lineno}: not valid JSON ({exc.msg}); refit it with "
            "'autotune shape fit'"
        ) from exc
    if not isinstance(data, dict):
        raise ShapeError(f"traffic shape {p}: expected a JSON object, got {type(data).__name__}")
    try:
        shape = TrafficShape.model_validate(data)
    except ValidationError as exc:
        raise ShapeError(
            f"traffic shape {p}: {_first_error(exc)}; fix the file or refit it with "
            "'autotune shape fit'"
        ) from exc
    expected = compute_fingerprint(shape.model_dump())
    if shape.fingerprint != expected:
        raise ShapeError(
            f"traffic shape {p}: fingerprint {shape.fingerprint!r} does not match its statistics "
            f"({expected!r}); the statistics were edited by hand. Refit it with 'autotune shape "
            'fit\', or set "fingerprint" to the value above if the edit was deliberate'
        )
    return shape


def save_shape(shape: TrafficShape, path: str | Path) -> Path:
    """Write ``shape`` as indented JSON, atomically (temp file, then ``os.replace``)."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        mode = p.stat().st_mode & 0o777 if p.exists() else 0o644
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        try:
            os.chmod(tmp, mode)  # mkstemp makes 0600; a shape file is meant to be shared
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                # no "precision": null in exact shapes (files from before it stay unchanged)
                skip = {"precision"} if shape.precision is None else None
                fh.write(_compact_lists(shape.model_dump_json(indent=2, exclude=skip)))
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise ShapeError(f"cannot write traffic shape {p}: {exc}") from exc
    return p
