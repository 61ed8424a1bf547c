"""Facts about this machine: the GPU (nvidia-smi), the CPU's features and cores, processes.

One place for what the space's conditions (``gpu_arch``, ``avx512``), the study's records
(the GPU type) and Ray's sizing read from the machine. Each answer is read once per process.
"""

from __future__ import annotations

import os
import subprocess
from functools import lru_cache

__all__ = ["CPU", "cpu_count", "cpu_has_avx512", "gpu_arch", "gpu_memory_gib", "gpu_names",
           "gpu_type", "is_cpu", "nvidia_smi", "process_start_ticks", "unit_of"]

#: the device (vLLM's ``current_platform``) and the GPU type a study records on the CPU
#: build of vLLM (``autotune.gpu_type``, best.json's ``engine.device``)
CPU = "cpu"


def is_cpu(kind: str | None) -> bool:
    """Whether a recorded device or GPU type ("cpu", "cuda", "NVIDIA H200") is the CPU
    build's: its server is a CPU server, with no GPU to count or bill by."""
    return (kind or "").strip().lower() == CPU


def unit_of(kind: str | None) -> str:
    """What a figure is per and what time is counted on: "GPU", or "server" on the CPU
    build (a CPU server counts as one unit, as in :mod:`autotune.cost`)."""
    return "server" if is_cpu(kind) else "GPU"


def _query_gpus(field: str) -> list[str]:
    """A ``--query-gpu`` field of every GPU, in nvidia-smi's order ([] without one)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]


def nvidia_smi(field: str) -> str:
    """The first GPU's ``--query-gpu`` field ("" without nvidia-smi or a GPU)."""
    lines = _query_gpus(field)
    return lines[0] if lines else ""


def gpu_names() -> list[str]:
    """Every GPU's name, in nvidia-smi's order ([] without nvidia-smi or a GPU)."""
    return _query_gpus("name")


@lru_cache(maxsize=1)
def gpu_type() -> str:
    """The GPU's name ("NVIDIA H200"), "unknown" when nvidia-smi does not say."""
    return nvidia_smi("name") or "unknown"


@lru_cache(maxsize=1)
def gpu_memory_gib() -> float | None:
    """The first GPU's memory in GiB (nvidia-smi's ``memory.total``), None without one."""
    raw = nvidia_smi("memory.total").split()  # "143771 MiB"
    try:
        return float(raw[0]) / 1024 if raw else None
    except ValueError:
        return None


@lru_cache(maxsize=1)
def gpu_arch() -> str:
    """The GPU's architecture as vLLM names it ("sm90" on Hopper), "" without a GPU."""
    cap = nvidia_smi("compute_cap")  # "9.0" on Hopper
    return "sm" + cap.replace(".", "") if cap else ""


@lru_cache(maxsize=1)
def cpu_has_avx512() -> bool:
    """The CPU has AVX-512 (or AMX): the CPU build of vLLM needs it for FP8 KV caches."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 16)
    except OSError:
        return False
    return " avx512f" in text or " amx_tile" in text


def host_class(device: str | None) -> str:
    """What a start-to-start spread depends on beside the engine and the model: the GPU type
    ("NVIDIA H200"), or on the CPU build the CPU model and its count ("AMD EPYC 7763 x 2
    CPUs"): hosts of one class spread alike."""
    if not is_cpu(device):
        return str(device or "unknown")
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} x {cpu_count()} CPUs"


def cpu_count() -> int:
    """Logical CPUs of this machine (at least 1)."""
    return os.cpu_count() or 1


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc/PID/stat`` field 22),
    so that a pid reused by another process is not taken for the first one; None when no
    such process runs (a zombie has exited). Without ``/proc``: 0 for a live pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None
    except OSError:
        pass
    else:
        fields = stat[stat.rindex(b")") + 2:].split()  # the name may hold spaces and ")"
        return None if fields[0] in (b"Z", b"X") else int(fields[19])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return 0  # alive, owned by another user
    return 0
