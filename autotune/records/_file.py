"""The base of a file a study writes: a pydantic model read and written as JSON.

A file written before a field existed still loads (the field takes its default), and a key
this version does not know is kept as it is (``extra="allow"``) and written back, so that
``save(load(path))`` loses nothing. ``save`` writes a temp file and then ``os.replace``s it:
a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, Self

from pydantic import BaseModel, ConfigDict, JsonValue, ValidationError

from autotune.errors import ConfigError, StudyError

__all__ = ["JsonValue", "StudyFileModel", "write_atomic", "write_text_atomic"]

def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` then ``os.replace(tmp, path)``, so that a reader never sees half a
    file; OSError becomes a :class:`StudyError` that says how to go on."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise StudyError(
            f"cannot write {path}: {exc.strerror or exc}; free space or choose another --out, "
            "then continue with --resume (every finished trial is in the Optuna storage)"
        ) from exc
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` to ``path`` atomically (:func:`write_atomic`)."""
    write_atomic(path, lambda tmp: tmp.write_text(text))


class StudyFileModel(BaseModel):
    """A JSON file of a study (:class:`BestFile`, :class:`StudyFile`): ``load``, ``save``,
    ``to_json``. A field that a file written before lacks is left out when it is saved
    again (``exclude_unset``), so an old file keeps its shape."""

    model_config = ConfigDict(extra="allow", frozen=True)

    #: the file's usual name in a study's output folder
    FILE_NAME: ClassVar[str] = ""

    @classmethod
    def from_json(cls, doc: object, *, source: str = "") -> Self:
        """The model of a parsed JSON document; :class:`ConfigError` when it is not one."""
        try:
            return cls.model_validate(doc)
        except ValidationError as exc:
            what = source or cls.FILE_NAME
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "the top level"
            raise ConfigError(f"{what} is not a study's {cls.FILE_NAME}: {where}: "
                              f"{first['msg']}; give the {cls.FILE_NAME} a study wrote "
                              "(autotune tune --out)") from None

    @classmethod
    def load(cls, path: Path) -> Self:
        """The file at ``path`` (or ``path``/FILE_NAME for a folder); :class:`ConfigError`
        when it cannot be read, is not JSON or is not such a file."""
        p = path / cls.FILE_NAME if path.is_dir() else path
        try:
            doc = json.loads(p.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read {p}: {exc.strerror or exc}; give a study's "
                              f"{cls.FILE_NAME} or its output folder") from None
        except ValueError as exc:
            raise ConfigError(f"{p} is not JSON ({exc}); give a study's "
                              f"{cls.FILE_NAME}") from None
        return cls.from_json(doc, source=str(p))

    def to_json(self) -> dict[str, JsonValue]:
        """The file's content: the fields it was given, in their order, then the keys it
        kept from a file of another version."""
        out: dict[str, JsonValue] = self.model_dump(mode="json", exclude_unset=True)
        return out

    def save(self, path: Path) -> None:
        """Write the file atomically (temp file, then ``os.replace``)."""
        write_text_atomic(path, json.dumps(self.to_json(), indent=2) + "\n")
