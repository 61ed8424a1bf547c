"""More than one GPU per server: the GPU count of a config, vLLM's parallelism rules and
the placement of trials on the GPUs of a node.

* :func:`server_gpus`: GPUs one server of a config uses (TP x PP x DP, read from its
  engine flags); the per-GPU objective, the placement and the GPUs the traffic needs all
  follow from it;
* :class:`ParallelRules`: head divisibility, expert parallelism only for MoE models, a
  server within one node, weights + the smallest KV cache within a GPU's memory (an
  estimate from ``config.json``), checked before any server starts;
* :class:`GpuPool`, :class:`Node`: whole GPUs of one node per trial, none shared.

A leaf: it imports nothing of autotune but :mod:`autotune.errors`.
"""

from autotune.parallelism._count import PARALLEL_FLAGS, flag_value, parallel_sizes, server_gpus
from autotune.parallelism._model import ModelSize
from autotune.parallelism._pool import GpuPool, Node
from autotune.parallelism._rules import MemoryEstimate, ParallelRules

__all__ = ["PARALLEL_FLAGS", "GpuPool", "MemoryEstimate", "ModelSize", "Node", "ParallelRules",
           "flag_value", "parallel_sizes", "server_gpus"]
