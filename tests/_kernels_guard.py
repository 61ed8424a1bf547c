"""Helpers shared by tests/integration/test_kernels_guard.py and tests/unit/test_kernels_guard.py."""

from __future__ import annotations

# the H200 run's tuned counts (32 and 256 streams of the case study, MTP 0/1)
TRAFFIC = (32, 64, 256, 512, 544, 576, 768, 1024, 8192)


# a tuned config no default config equals (BLOCK_SIZE_N 256), told apart per key by GROUP
TUNED = {m: {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64,
             "GROUP_SIZE_M": 16 + i, "num_warps": 4, "num_stages": 3}
         for i, m in enumerate(TRAFFIC)}
