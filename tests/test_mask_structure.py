"""The structure of a mask is read from its IR, whatever door it came through
(flexattn/mods/structure.py): every spelling of causal is causal, bands are exact, and
anything else is not a band. Each recognized band is checked against the mask itself."""

import numpy as np
import pytest

from flexattn import mods
from flexattn.mods import as_mask
from flexattn.mods.structure import CAUSAL, Band, band_values, canonical_band, diagonal_band, is_causal

CAUSAL_SPELLINGS = [
    lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
    lambda b, h, q_idx, kv_idx: kv_idx <= q_idx,
    lambda b, h, q_idx, kv_idx: q_idx - kv_idx >= 0,
    lambda b, h, q_idx, kv_idx: kv_idx - q_idx < 1,
    lambda b, h, q_idx, kv_idx: ~(q_idx < kv_idx),
    lambda b, h, q_idx, kv_idx: 0 <= q_idx - kv_idx,
    lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx >= kv_idx),
    lambda b, h, q_idx, kv_idx: (q_idx + 1 > kv_idx) & True,
    lambda b, h, q_idx, kv_idx: 2 * q_idx >= 2 * kv_idx,
]


@pytest.mark.parametrize("spelling", range(len(CAUSAL_SPELLINGS)))
def test_every_spelling_of_causal_is_causal(spelling):
    mask = as_mask(CAUSAL_SPELLINGS[spelling])
    assert is_causal(mask)
    _check_band(mask, CAUSAL)


def test_builtins_and_combinations():
    assert is_causal(mods.causal())
    assert is_causal(mods.causal() & mods.full())
    # runtime widths and offsets: bounds that read the captured numbers
    window = mods.sliding_window(4)
    assert band_values(diagonal_band(window.expr), window.captures) == (0, 4)
    shifted = mods.causal(offset=3)
    assert band_values(diagonal_band(shifted.expr), shifted.captures) == (-3, None)
    assert not is_causal(shifted)
    both = mods.sliding_window(5, 2)
    assert band_values(diagonal_band(both.expr), both.captures) == (-2, 5)
    assert diagonal_band(mods.full().expr) == Band(None, None)
    assert not is_causal(mods.causal() | mods.full())
    assert not is_causal(mods.prefix_lm(16))
    assert not is_causal(None)


@pytest.mark.parametrize("fn, band", [
    (lambda b, h, q, kv: (q >= kv) & (q - kv <= 1024), Band(0, 1024)),
    (lambda b, h, q, kv: (q - kv).abs() <= 7, None),                 # abs: not linear (yet)
    (lambda b, h, q, kv: (kv - q <= 5) & (q - kv <= 3), Band(-5, 3)),
    (lambda b, h, q, kv: q + 3 >= kv, Band(-3, None)),
    (lambda b, h, q, kv: q - kv > 3, Band(4, None)),
    (lambda b, h, q, kv: 2 * q - 2 * kv >= 1, Band(1, None)),
    (lambda b, h, q, kv: 2 * q - 2 * kv < 3, Band(None, 1)),
    (lambda b, h, q, kv: q == kv, Band(0, 0)),
    (lambda b, h, q, kv: (q >= kv) & (q < kv), Band(0, -1)),
    (lambda b, h, q, kv: q >= 2 * kv, None),
    (lambda b, h, q, kv: q >= h, None),
    (lambda b, h, q, kv: (q >= kv) | (kv < 4), None),
    (lambda b, h, q, kv: q * 1000 >= kv * 1000, None),              # could wrap in int32
])
def test_bands(fn, band):
    mask = as_mask(fn)
    assert diagonal_band(mask.expr) == band
    if band is not None:
        _check_band(mask, band)


def _check_band(mask, band):
    q = np.arange(64)[:, None]
    kv = np.arange(80)[None, :]
    d = q - kv
    want = np.ones(d.shape, bool)
    if band.lo is not None:
        want &= d >= band.lo
    if band.hi is not None:
        want &= d <= band.hi
    np.testing.assert_array_equal(np.broadcast_to(mask(0, 0, q, kv), want.shape), want)


def test_scalar_bounds_combine_only_when_they_can_be_ordered():
    w = 7

    def two_windows(b, h, q, kv):      # two runtime bounds on one side: no static order
        return (q - kv <= w) & (q - kv <= 2 * w)

    assert diagonal_band(as_mask(two_windows).expr) is None
    assert diagonal_band(as_mask(lambda b, h, q, kv: (q - kv <= w) & (q - kv <= w)).expr) is not None


@pytest.mark.parametrize("spelling", [
    lambda: mods.sliding_window(64),
    lambda: as_mask(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 64)),
    lambda: as_mask(lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (kv_idx >= q_idx - 64)),
    lambda: mods.causal() & mods.sliding_window(64, None),
])
def test_every_spelling_of_a_window_has_one_canonical_form(spelling):
    mask = spelling()
    canon = canonical_band(mask)
    reference = canonical_band(mods.sliding_window(64))
    assert canon.expr is reference.expr and canon.captures == (0, 64)
    q, kv = np.arange(300)[:, None], np.arange(300)[None, :]
    np.testing.assert_array_equal(np.broadcast_to(canon(0, 0, q, kv), (300, 300)),
                                  np.broadcast_to(mask(0, 0, q, kv), (300, 300)))


def test_no_canonical_form_for_structures_of_their_own():
    assert canonical_band(mods.causal()) is None
    assert canonical_band(mods.full()) is None
    assert canonical_band(as_mask(lambda b, h, q, kv: (q >= kv) & (q < kv))) is None   # empty
    assert canonical_band(mods.document(np.zeros(8, np.int32))) is None
    one_sided = canonical_band(mods.causal(offset=5))
    assert one_sided.captures == (-5,)
