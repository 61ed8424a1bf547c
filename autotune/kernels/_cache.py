"""Tuned kernel folders kept beside the compile caches (``--cache-dir``, default
``~/.cache/autotune``): ``kernels/moe/<GPU>/<E,N>-<shape fingerprint>-s<streams>-<key>/``
(``s128+256`` when ``--max-num-seqs`` choices cut 256 streams to 128 in some trials).

The key covers what a tuned file is specific to: the MoE layer's shape (E, N, K, top-k,
dtype, not the model's path: two checkpoints of one architecture share it), the GPU, the
traffic shape's fingerprint, the numbers of sequences a step holds (the streams the study
replays, the shape's own or ``--concurrency``, cut to each ``--max-num-seqs`` value the
space can pass: the decode token counts are min(streams, seqs) x (1 + MTP depth), and the
fingerprint does not cover a closed loop's streams) and the vLLM version (its Triton and
its kernel change the best tiles). A study asks :func:`ensure_tuned_moe` once
before trial 0; a second study on the same key finds the folder complete and times
nothing, and one whose space adds MTP depths or chunk sizes times only the new counts.
The key needs no version for guard keys and ``--min-gain``: the file is rebuilt from the
folder's results each time, so a folder tuned before them is reused without timing and
written again with them.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from autotune.kernels._moe_shape import MoeShape, device_file_name, moe_shape_from_model
from autotune.kernels._search import KernelTimer
from autotune.kernels._sizes import DEFAULT_MAX_NUM_SEQS, active_streams, streams_of
from autotune.kernels._tune import MoeTuneResult, MoeTuneSettings, Progress, tune_moe

__all__ = ["ensure_tuned_moe", "tuned_moe_folder"]


def tuned_moe_folder(cache_dir: Path, *, moe: MoeShape, gpu_name: str,
                     shape_fingerprint: str, vllm_version: str,
                     streams: int | Iterable[int]) -> Path:
    """The cache folder for one (MoE shape, GPU, traffic shape, streams, vLLM version);
    ``streams``: the numbers of sequences a step holds (:func:`active_streams`; one
    number: the streams themselves)."""
    held = sorted({streams} if isinstance(streams, int) else set(streams))
    key = "|".join([moe.key(), gpu_name, shape_fingerprint,
                    f"streams={','.join(map(str, held))}", vllm_version])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    leaf = (f"E{moe.experts}-N{moe.intermediate}-{shape_fingerprint[:16]}"
            f"-s{'+'.join(map(str, held))}-{digest}")
    return Path(cache_dir).expanduser() / "kernels" / "moe" / device_file_name(gpu_name) / leaf


def ensure_tuned_moe(*, cache_dir: Path, model: Path, shape_path: Path, shape_fingerprint: str,
                     gpu_name: str, vllm_version: str, mtp_depths: Sequence[int] = (0,),
                     max_batched_tokens: Sequence[int] = (8192,),
                     max_num_seqs: Sequence[int] = (DEFAULT_MAX_NUM_SEQS,),
                     concurrency: int | None = None, gpus: int = 1,
                     budget_s: float | None = None, trials: int = 48,
                     on_progress: Callable[[Progress], None] | None = None,
                     timers: Sequence[KernelTimer] | None = None,
                     clock: Callable[[], float] = time.monotonic) -> MoeTuneResult:
    """Tune into the cache folder what it lacks; ``result.path.parent`` is the folder to set
    ``VLLM_TUNED_CONFIG_FOLDER`` to (only missing token counts are timed; ``concurrency``
    overrides the shape's streams, as ``autotune tune --concurrency``; ``max_num_seqs``:
    the ``--max-num-seqs`` values the trials may pass; ``timers`` and ``clock``: see
    :func:`tune_moe`)."""
    from autotune.traffic import load_shape

    moe = moe_shape_from_model(model)
    streams, _ = streams_of(load_shape(shape_path), concurrency)
    folder = tuned_moe_folder(cache_dir, moe=moe, gpu_name=gpu_name,
                              shape_fingerprint=shape_fingerprint, vllm_version=vllm_version,
                              streams=active_streams(streams, max_num_seqs))
    settings = MoeTuneSettings(model=model, shape=shape_path, out=folder, gpus=gpus,
                               mtp_depths=tuple(mtp_depths),
                               max_batched_tokens=tuple(max_batched_tokens),
                               max_num_seqs=tuple(max_num_seqs), concurrency=concurrency,
                               budget_s=budget_s, trials=trials,
                               reuse=True)
    return tune_moe(settings, gpu_name=gpu_name, on_progress=on_progress, timers=timers,
                    clock=clock)
