"""The reference config and its outputs, computed once and cached on disk."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Final, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from autotune.errors import AutotuneError, SpaceError
from autotune.quality._client import ProbeOutputs, run_probe
from autotune.quality._probe import ProbeSet

if TYPE_CHECKING:
    from autotune.events import ParamValue
    from autotune.space import SearchSpace

logger = logging.getLogger(__name__)

_CACHE_FORMAT: Final = 1


# ---------------------------------------------------------------------------------------------
# The reference


def reference_params(space: SearchSpace, params: Mapping[str, ParamValue] | None = None
                     ) -> dict[str, ParamValue]:
    """Knob values of the reference config: ``params`` (default: the space's baseline values)
    with every active lossy knob at its ``default`` (its full-precision value).

    Launch it with ``space.launch_spec(reference_params(space))``. Raises
    :class:`SpaceError` when an active lossy knob has no ``default``.
    """
    out = dict(space.baseline_params() if params is None else params)
    for name, knob in space.knobs.items():
        if not knob.lossy:
            continue
        if not space.is_active(name, out):
            out.pop(name, None)
            continue
        if knob.default is None:
            raise SpaceError(
                f"search space {space.name}: knob {name!r} is lossy but has no 'default'; "
                "the quality reference needs its full-precision value (e.g. default: float32)"
            )
        out[name] = knob.default
    return out


def model_fingerprint(model: str | os.PathLike[str]) -> str:
    """A short id of a model: for a local directory, its config and the names, sizes and
    modification times of its files; otherwise the name itself."""
    p = Path(model)
    h = hashlib.sha256()
    if p.is_dir():
        h.update(str(p.resolve()).encode())
        for f in sorted(p.iterdir()):
            if not f.is_file():
                continue
            st = f.stat()
            if f.suffix == ".json" and st.st_size < 5_000_000:
                h.update(f.name.encode() + b"\0" + f.read_bytes())
            else:
                h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    else:
        h.update(str(model).encode())
    return h.hexdigest()[:24]


class ReferenceKey(BaseModel):
    """What decides the reference outputs; :attr:`digest` names the cache file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    model_fingerprint: str
    probe_digest: str
    flags: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    engine: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()


def _engine_id() -> str:
    try:
        from autotune.engine import detect_engine

        info = detect_engine()
    except AutotuneError:
        return ""
    return f"{info.package} {info.version}"


class ReferenceCache:
    """Reference outputs as JSON files under ``directory``, one per :class:`ReferenceKey`.

    Writes are atomic (temp file, then ``os.replace``); an unreadable or mismatching file
    is logged as a warning and treated as missing, so it is recomputed and replaced.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def key(
        self,
        *,
        model: str | os.PathLike[str],
        probe: ProbeSet,
        flags: Sequence[str],
        env: Mapping[str, str] | None = None,
        engine: str | None = None,
    ) -> ReferenceKey:
        """The key of a reference (``engine`` defaults to the installed vLLM's version)."""
        return ReferenceKey(
            model=str(model),
            model_fingerprint=model_fingerprint(model),
            probe_digest=probe.digest,
            flags=tuple(str(f) for f in flags),
            env=tuple(sorted((str(k), str(v)) for k, v in (env or {}).items())),
            engine=_engine_id() if engine is None else engine,
        )

    def path(self, key: ReferenceKey) -> Path:
        return self.directory / f"quality-reference-{key.digest[:20]}.json"

    def load(self, key: ReferenceKey) -> ProbeOutputs | None:
        """The cached outputs for ``key``, or None (missing, corrupted or stale)."""
        path = self.path(key)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            logger.warning("quality reference %s is unreadable (%s); recomputing it", path, exc)
            return None
        try:
            if not isinstance(raw, dict) or raw.get("format") != _CACHE_FORMAT:
                raise ValueError(f"format {raw.get('format') if isinstance(raw, dict) else raw!r}")
            if ReferenceKey.model_validate(raw["key"]) != key:
                raise ValueError("its key does not match")
            outputs = ProbeOutputs.model_validate(raw["outputs"])
        except (KeyError, ValueError, ValidationError) as exc:
            logger.warning("quality reference %s is not usable (%s); recomputing it", path,
                           str(exc).splitlines()[0])
            return None
        if outputs.probe_digest != key.probe_digest:
            logger.warning("quality reference %s holds another probe's outputs; recomputing", path)
            return None
        return outputs

    def save(self, key: ReferenceKey, outputs: ProbeOutputs) -> Path:
        """Write ``outputs`` for ``key`` atomically; returns the file's path."""
        if outputs.probe_digest != key.probe_digest:
            raise AutotuneError(
                "quality: these outputs are of another probe than the key says; not caching"
            )
        from autotune import __version__

        path = self.path(key)
        doc = {
            "format": _CACHE_FORMAT,
            "key": key.model_dump(mode="json"),
            "outputs": outputs.model_dump(mode="json"),
            "saved_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "autotune_version": __version__,
        }
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=self.directory)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(doc, f, separators=(",", ":"))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        except OSError as exc:
            raise AutotuneError(
                f"quality: cannot write the reference cache {path}: {exc}; check that "
                f"{self.directory} is writable"
            ) from exc
        return path

    @contextlib.contextmanager
    def lock(self, key: ReferenceKey) -> Iterator[None]:
        """Hold an exclusive file lock for ``key``: concurrent workers compute it once."""
        import fcntl

        lock_path = self.directory / f".{self.path(key).name}.lock"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            f = open(lock_path, "a")
        except OSError as exc:
            raise AutotuneError(
                f"quality: cannot use the reference cache directory {self.directory}: {exc}; "
                "make it writable or choose another cache directory"
            ) from exc
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


class ProbeServer(Protocol):
    """What :func:`ensure_reference` needs of a started server (``VllmServer`` fits)."""

    @property
    def base_url(self) -> str: ...

    served_model_name: str


def ensure_reference(
    cache: ReferenceCache | None,
    *,
    model: str | os.PathLike[str],
    reference_flags: Sequence[str],
    reference_env: Mapping[str, str] | None,
    probe: ProbeSet,
    start_server: Callable[[], AbstractContextManager[ProbeServer]],
    engine: str | None = None,
) -> ProbeOutputs:
    """The reference outputs of ``probe``: from ``cache``, or computed on a server that
    ``start_server()`` starts (a context manager yielding a healthy server, stopped on exit)
    and then cached. ``cache=None`` always computes.

    ``start_server`` must serve ``model`` with ``reference_flags``/``reference_env`` (they
    only make the cache key). Errors of the server (start, crash) propagate: without a
    reference no lossy trial can be judged.
    """
    if cache is None:
        with start_server() as server:
            return run_probe(server.base_url, server.served_model_name, probe)
    key = cache.key(model=model, probe=probe, flags=reference_flags, env=reference_env,
                    engine=engine)  # fmt: skip
    with cache.lock(key):
        hit = cache.load(key)
        if hit is not None:
            logger.info("quality reference from cache %s", cache.path(key))
            return hit
        logger.info("computing the quality reference (%d prompts) with %s", len(probe.prompts),
                    " ".join(reference_flags))
        with start_server() as server:
            outputs = run_probe(server.base_url, server.served_model_name, probe)
        path = cache.save(key, outputs)
        logger.info("quality reference cached in %s (%.1f s)", path, outputs.wall_s)
        return outputs
