"""CPU (CI): the decode timeline's probes (benchmarks/decode_timeline.py, stream_marks.py)
— the stream mark compiles for sm_90a to one timer read and one store, and the lead /
trail arithmetic survives the 32-bit timer's wrap. No GPU needed."""

import os
import sys

import numpy as np
import pytest

pytest.importorskip("cutlass")
pytest.importorskip("torch")

# (appended: the benchmarks' module names never shadow a test helper's)
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

import decode_timeline  # noqa: E402
import stream_marks  # noqa: E402


def test_stream_mark_reads_the_timer_once():
    ptx = stream_marks.compile_for_ptx().__ptx__
    assert ".target sm_90a" in ptx
    assert ptx.count("%globaltimer_lo") == 1 and ptx.count("st.global.b32") == 1


@pytest.mark.parametrize("base", [1000, (1 << 32) - 1500])   # the second wraps inside the launch
def test_lead_and_trail_across_the_timer_wrap(base):
    stamps = np.zeros((3, 20), np.int64)
    stamps[:, 0] = [base + 300, base, base + 100]               # entries: the first at `base`
    marks = np.array([base - 2500, base + 12_000], np.int64)   # 2.5 µs before, 12 µs after it
    as_u32 = (lambda a: (a % (1 << 32)).astype(np.uint32))
    got = decode_timeline.lead_and_trail(as_u32(stamps), as_u32(marks), done=10.0)
    assert got["lead"] == pytest.approx(2.5) and got["trail"] == pytest.approx(2.0)
