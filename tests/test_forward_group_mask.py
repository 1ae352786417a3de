"""The arithmetic of the CuTe forward's group_mask path (FlashForwardSm90.apply_mask_groups,
common._group_run) in numpy, bit for bit, against testing each key of a row directly.

In an SM90 wgmma accumulator (m64nNk16, float32) lane l of a warp holds, for each of its
rows, the columns 2 (l % 4) + 8 g + u (u in {0, 1}, g < N / 8): column c of the kernel's
``_rows_view`` is (u, g) = (c % 2, c // 2). The kernel builds, per row, one bit word per u
whose bit g says whether column 2 (l % 4) + 8 g + u of the key tile is visible: for each
interval [s, e) (relative to the thread's first column) the run of g with s <= 8 g + u < e,
and the columns below Nk. The GPU test (tests/gpu/test_cute_forward.py::
test_group_mask_forward_is_bit_identical_on_gpu) checks the kernel against its default path.
"""
import numpy as np
import pytest

M32 = 0xFFFFFFFF


def group_run(lo, hi, groups):
    """common._group_run with int32 ends: the bits g < groups with lo <= 8 g < hi."""
    a = min((max(lo, 0) + 7) >> 3, groups)
    b = min((max(hi, 0) + 7) >> 3, groups)
    return ((1 << b) - (1 << a)) & M32


def kernel_keep(starts, lengths, col0, lane, block_kv, seqlen_k):
    """One row's keep bits for the thread of `lane`, as apply_mask_groups computes them."""
    groups = block_kv // 8
    base = col0 + 2 * (lane % 4)
    words = [0, 0]
    for s0, ln in zip(starts, lengths):
        s = s0 - base
        e = s + ln
        words[0] |= group_run(s, e, groups)
        words[1] |= group_run(s - 1, e - 1, groups)
    k_end = seqlen_k - base
    words[0] &= group_run(0, k_end, groups)
    words[1] &= group_run(-1, k_end - 1, groups)
    return [bool(words[c % 2] >> (c // 2) & 1) for c in range(2 * groups)]


def direct_keep(starts, lengths, col0, lane, block_kv, seqlen_k):
    out = []
    for c in range(block_kv // 4):
        col = col0 + 2 * (lane % 4) + 8 * (c // 2) + c % 2
        vis = any(s <= col < s + ln for s, ln in zip(starts, lengths))
        out.append(vis and col < seqlen_k)
    return out


@pytest.mark.parametrize("block_kv", [128, 80, 176, 248])
def test_group_words_match_direct_tests(block_kv):
    rng = np.random.default_rng(block_kv)
    for _ in range(3000):
        k = int(rng.integers(1, 9))
        seqlen_k = int(rng.integers(1, 4 * block_kv))
        col0 = block_kv * int(rng.integers(0, (seqlen_k + block_kv - 1) // block_kv + 1))
        # starts around the tile (inside, left, right, far), lengths 0 .. past the tile
        starts = [int(x) for x in col0 + rng.integers(-2 * block_kv, 2 * block_kv, k)]   # < 0 too
        lengths = [int(x) for x in rng.choice([0, 1, 2, 7, 8, 9, 15, 16, 17, block_kv,
                                               int(rng.integers(0, 3 * block_kv))], k)]
        lane = int(rng.integers(0, 32))
        args = (starts, lengths, col0, lane, block_kv, seqlen_k)
        assert kernel_keep(*args) == direct_keep(*args), args


def test_edges():
    # an interval ending exactly at a group boundary, one starting on the pair's second column
    assert kernel_keep([8], [8], 0, 0, 128, 1000) == direct_keep([8], [8], 0, 0, 128, 1000)
    assert kernel_keep([9], [7], 0, 0, 128, 1000) == direct_keep([9], [7], 0, 0, 128, 1000)
    # the whole tile: 16 groups per word, no shift reaches 32
    assert all(kernel_keep([0], [10**6], 0, 3, 128, 10**6))
    # nothing past Nk, nothing of an empty interval
    assert not any(kernel_keep([0], [128], 128, 1, 128, 128))
    assert not any(kernel_keep([5], [0], 0, 2, 128, 1000))
