"""Prefix-sharing arithmetic on record arrays."""

from __future__ import annotations

import numpy as np
import pytest

from autotune.traffic import TraceRecords
from autotune.traffic._records import prefix_from_blocks


def test_blocks_small_example() -> None:
    # request 0: blocks [5, 6]; request 1: no blocks; request 2: [5, 7] with a partial block
    info = prefix_from_blocks(
        np.array([5, 6, 5, 7]),
        np.array([0, 2, 2, 4]),
        np.array([1000, 10, 1000]),
        block_tokens=512,
    )
    assert info.shared_tokens.tolist() == [512, 0, 512]
    assert info.hit_tokens.tolist() == [256.0, 0.0, 256.0]  # block 5 held twice: one hit
    assert info.group.tolist() == [5, -1, 5]


def test_blocks_chunking_does_not_change_the_result(mooncake_records: TraceRecords) -> None:
    rng = np.random.default_rng(0)
    n = 2000
    lengths = rng.integers(0, 6, n)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    ids = rng.integers(0, 300, offsets[-1])
    inp = np.maximum(1, lengths * 512 - rng.integers(0, 512, n))
    whole = prefix_from_blocks(ids, offsets, inp, block_tokens=512)
    parts = prefix_from_blocks(ids, offsets, inp, block_tokens=512, chunk_blocks=37)
    assert np.array_equal(whole.shared_tokens, parts.shared_tokens)
    assert np.array_equal(whole.group, parts.group)
    assert whole.hit_tokens == pytest.approx(parts.hit_tokens)
    # the total of hits does not depend on the order of the requests
    perm = rng.permutation(n)
    shuffled_ids = np.concatenate([ids[offsets[i] : offsets[i + 1]] for i in perm])
    shuffled_offsets = np.concatenate(([0], np.cumsum(lengths[perm])))
    again = prefix_from_blocks(shuffled_ids, shuffled_offsets, inp[perm], block_tokens=512)
    assert again.hit_tokens.sum() == pytest.approx(whole.hit_tokens.sum())
    assert np.array_equal(again.shared_tokens, whole.shared_tokens[perm])
