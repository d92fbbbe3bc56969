"""CPU (CI): `BwdConfig.dq_finish`'s visitor counts. The dQ writer finishes a q tile when
its landed-visit count reaches `q_blocks.visitor_count` (the kernel calls it with the
kernel's ops): that must be exactly how many kv blocks' walks (`DenseQBlocks`,
`BandQBlocks`, enumerated here with Python ints) include the tile — one too many and the
tile is never stored, one too few and it is stored before the last adds."""

import numpy as np
import pytest

from flexattn.kernels.blockmask.visit import band_block_ranges
from flexattn.kernels.bwd.q_blocks import visitor_count


def _band_walks(lo, hi, tile_m, tile_n, seqlen_q, seqlen_k):
    """{q tile: kv blocks visiting it}, from each kv block's walk (BandQBlocks' ranges)."""
    seen = {}
    for n in range((seqlen_k + tile_n - 1) // tile_n):
        m_lo, m_end, _, _ = band_block_ranges(-hi, -lo, n, tile_n, tile_m, seqlen_q)
        for m in range(m_lo, m_end):
            seen[m] = seen.get(m, 0) + 1
    return seen


@pytest.mark.parametrize("tile_m", [64, 80, 128])
def test_band_counts_are_the_walks_transposed(tile_m):
    rng = np.random.default_rng(tile_m)
    for _ in range(400):
        seqlen_q, seqlen_k = (int(x) for x in rng.integers(1, 1500, 2))
        lo = int(rng.integers(-1200, 1200))
        hi = lo + int(rng.integers(0, 1500))
        seen = _band_walks(lo, hi, tile_m, 128, seqlen_q, seqlen_k)
        for m in range((seqlen_q + tile_m - 1) // tile_m):
            assert visitor_count(m, tile_m, 128, seqlen_k, band=(lo, hi)) == seen.get(m, 0), \
                (lo, hi, seqlen_q, seqlen_k, m)


def test_causal_and_dense_counts():
    for seqlen_q, seqlen_k in ((1, 1), (64, 64), (1000, 1000), (333, 129), (129, 513), (4096, 4096)):
        n_kv = (seqlen_k + 127) // 128
        for m in range((seqlen_q + 63) // 64):
            # DenseQBlocks under causal: kv block n walks q tiles (n * 128) // 64 .. end
            walks = sum(1 for n in range(n_kv) if (n * 128) // 64 <= m)
            assert visitor_count(m, 64, 128, seqlen_k, causal=True) == walks
            assert visitor_count(m, 64, 128, seqlen_k) == n_kv
