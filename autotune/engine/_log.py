"""vLLM's own log, read back: torch.compile seconds and the start phases of a server
(weights loaded, graphs captured, healthy).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)


# vLLM's compile monitor (vllm/compilation/monitor.py): "torch.compile took 41.23 s in
# total" once per compiled model (the MTP drafter has its own), on every version we know.
_COMPILE_LINE = re.compile(rb"torch\.compile took ([0-9.]+) s in total")


_PROFILE_LINE = re.compile(rb"(?:(\d\d-\d\d \d\d:\d\d:\d\d).*)?Initial profiling/warmup run took "
                           rb"([0-9.]+) s")


# the first line after the kernel warm-up that follows the profiling run (vLLM 0.26)
_CAPTURE_LINE = re.compile(rb"(\d\d-\d\d \d\d:\d\d:\d\d).*(?:CuTeDSL warmup|Capturing CUDA graphs|"
                           rb"Torch profiler disabled for CUDA graph capture)")


def _stamp(raw: bytes) -> float:
    import datetime as dt

    t = dt.datetime.strptime("2000-" + raw.decode(), "%Y-%m-%d %H:%M:%S")
    return t.timestamp()


def _log_bytes(log_path: Path | None) -> bytes | None:
    """The server log's bytes, None when there is none or it cannot be read (a log problem
    is not an error)."""
    if log_path is None:
        return None
    try:
        return Path(log_path).read_bytes()
    except OSError:
        return None


def compile_seconds(log_path: Path | None) -> float | None:
    """Seconds of the server's start that a warm compile/JIT cache takes away, as its log
    dates them, or None when it says nothing: torch.compile ("torch.compile took X s in
    total", summed over the models it compiled), the profiling run that JIT-compiles the
    Triton kernels ("Initial profiling/warmup run took X s") and the kernel warm-up after it
    (to the first CUDA-graph capture line). On the H200 a cold start spends ~220 s there, a
    warm one ~10 s (docs/measurement.md, section 10). A log problem is not an error."""
    data = _log_bytes(log_path)
    return None if data is None else _compile_in(data)


def _compile_in(data: bytes) -> float | None:
    found = [float(m.group(1)) for m in _COMPILE_LINE.finditer(data)]
    for prof in _PROFILE_LINE.finditer(data):
        found.append(float(prof.group(2)))
        cap = _CAPTURE_LINE.search(data, prof.end())
        if cap is not None and prof.group(1) is not None:
            try:
                gap = _stamp(cap.group(1)) - _stamp(prof.group(1))
            except ValueError:
                gap = 0.0
            if 0 <= gap < 3600:
                found.append(gap)
    return round(sum(found), 2) if found else None


# the first line of each vLLM process, "(APIServer pid=1) INFO 12-01 13:13:46 [...]"
_PROC_LINE = re.compile(rb"\((APIServer|EngineCore)[^)]*\) \w+ (\d\d-\d\d \d\d:\d\d:\d\d)")


_WEIGHTS_LINE = re.compile(rb"(\d\d-\d\d \d\d:\d\d:\d\d).*Model loading took")


_GRAPHS_LINE = re.compile(rb"Graph capturing finished in ([0-9.]+) secs")


def start_phases(log_path: Path | None) -> dict[str, float]:
    """Where a server's start went, as vLLM's log dates it (seconds; a phase it does not
    date is left out): ``engine_spawn_s`` from the API server's first line to the engine
    process's (the API server's set-up, then the engine process's spawn and imports),
    ``weights_s`` from there to the loaded weights, ``torch_compile_s`` and ``kernel_jit_s``
    (:func:`compile_seconds`, split: the Triton JIT of the profiling run and the kernel
    warm-up after it) and ``graph_capture_s`` (CUDA graphs). What they leave of the start
    is the API server's own imports before its first line and its last steps. Read on the
    H200: a warm start of 67 s was 25 + 6 + 2 + 4.6 + 12 s of these (docs/measurement.md,
    section 10). A log problem is not an error: it gives an empty dict."""
    data = _log_bytes(log_path)
    return {} if data is None else _phases_in(data)


def _phases_in(data: bytes) -> dict[str, float]:
    first: dict[bytes, float] = {}
    try:
        for m in _PROC_LINE.finditer(data):
            first.setdefault(m.group(1), _stamp(m.group(2)))
            if len(first) == 2:
                break
        weights = _WEIGHTS_LINE.search(data)
        t_weights = _stamp(weights.group(1)) if weights is not None else None
    except ValueError:
        return {}
    out: dict[str, float] = {}
    api, engine = first.get(b"APIServer"), first.get(b"EngineCore")
    if api is not None and engine is not None and 0 <= engine - api < 3600:
        out["engine_spawn_s"] = engine - api
    if engine is not None and t_weights is not None and 0 <= t_weights - engine < 3600:
        out["weights_s"] = t_weights - engine
    compiled = [float(m.group(1)) for m in _COMPILE_LINE.finditer(data)]
    if compiled:
        out["torch_compile_s"] = sum(compiled)
    total = _compile_in(data)
    if total is not None and total - sum(compiled) > 0:
        out["kernel_jit_s"] = total - sum(compiled)
    graphs = [float(m.group(1)) for m in _GRAPHS_LINE.finditer(data)]
    if graphs:
        out["graph_capture_s"] = sum(graphs)
    return {k: round(v, 2) for k, v in out.items() if v >= 0.05}  # not a phase below that
