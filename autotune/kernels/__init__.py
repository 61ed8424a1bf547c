"""Kernel configs below the engine flags: tuned for the token counts a traffic shape makes.

``autotune kernels moe`` (:func:`tune_moe`) tunes vLLM's fused-MoE Triton kernel for a
model's expert shape on the present GPU, only at the batch sizes the shape's traffic
reaches, and writes the JSON file vLLM reads from ``VLLM_TUNED_CONFIG_FOLDER``;
:func:`ensure_tuned_moe` does it once per (model, GPU, shape) for a study and caches the
folder beside the compile caches. Besides the tuned counts the file holds vLLM's own
default config at guard keys (:func:`guard_keys`), and a count keeps that default unless
its winner is ``min_gain`` faster. See ``docs/kernels.md``.
"""

from autotune.kernels._cache import ensure_tuned_moe, tuned_moe_folder
from autotune.kernels._guard import (
    default_boundaries,
    guard_grid,
    guard_keys,
    with_guard_keys,
)
from autotune.kernels._moe_shape import (
    MoeShape,
    config_file_name,
    device_file_name,
    moe_shape_from_model,
)
from autotune.kernels._search import (
    Candidate,
    KernelFailure,
    KernelTimer,
    SearchSettings,
    SizeResult,
    TimingCosts,
    kept_default_reason,
    replay_seconds,
    search_size,
)
from autotune.kernels._sizes import TokenCount, cudagraph_size, streams_of, token_counts
from autotune.kernels._space import (
    GRID,
    canonical,
    default_config,
    grid,
    prune_reason,
    smem_bytes,
)
from autotune.kernels._tune import (
    KernelsUnavailable,
    MoeTuneResult,
    MoeTuneSettings,
    Progress,
    check_cuda,
    tune_moe,
    write_moe_config,
)

__all__ = [
    "GRID",
    "Candidate",
    "KernelFailure",
    "KernelTimer",
    "KernelsUnavailable",
    "MoeShape",
    "MoeTuneResult",
    "MoeTuneSettings",
    "Progress",
    "SearchSettings",
    "SizeResult",
    "TimingCosts",
    "TokenCount",
    "canonical",
    "check_cuda",
    "config_file_name",
    "cudagraph_size",
    "default_boundaries",
    "default_config",
    "device_file_name",
    "ensure_tuned_moe",
    "grid",
    "guard_grid",
    "guard_keys",
    "kept_default_reason",
    "moe_shape_from_model",
    "prune_reason",
    "replay_seconds",
    "search_size",
    "smem_bytes",
    "streams_of",
    "token_counts",
    "tune_moe",
    "tuned_moe_folder",
    "with_guard_keys",
    "write_moe_config",
]
