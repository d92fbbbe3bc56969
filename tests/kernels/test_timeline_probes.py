"""CPU (CI): the decode timeline's probes (benchmarks/decode_timeline.py, stream_marks.py)
— the stream mark compiles for sm_90a to one timer read and one store, the lead / trail
arithmetic survives the 32-bit timer's wrap, and the CTA dump flags each group's merger.
No GPU needed."""

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


def test_cta_lines_mark_each_groups_merger():
    """``--dump-ctas``: one line per CTA in group-major, split-minor order (the kernel's CTA
    index), the merging CTA flagged and alone given merge columns, times from the first entry."""
    base = 5000
    stamps = np.zeros((2 * 3, 20), np.int64)
    stamps[:, 0] = base + 100 * np.arange(6)             # entries: CTA 0 first
    stamps[:, 4] = base + 7000 + 10 * np.arange(6)       # stream ends
    stamps[[2, 4], 6] = base + 10_000                    # the mergers: split 2 of group 0, split 1 of group 1
    stamps[[2, 4], 13] = base + 9000
    lines = decode_timeline.cta_lines(stamps.astype(np.uint32), splits=3, groups=5)
    assert len(lines) == 1 + 6                           # header, then every CTA (only 2 groups exist)
    flagged = [line.split()[:3] for line in lines[1:] if line.split()[2] == "M"]
    assert flagged == [["0", "2", "M"], ["1", "1", "M"]]
    first = lines[1].split()
    assert first[:2] == ["0", "0"] and float(first[2]) == 0.0 and float(first[6]) == 7.0
    assert lines[1].split()[-1] == "-" and float(lines[3].split()[-1]) == 10.0


def test_summary_counts_shared_sms():
    """The ``shared`` column: SMs that hold more than one of the launch's CTAs (column 7 is
    each CTA's SM), the block scheduler's placement beside the timing."""
    base = 5000
    stamps = np.zeros((5, 20), np.int64)
    stamps[:, :7] = base + 100 * np.arange(7)            # entry .. merge, in order
    stamps[:, 7] = [3, 9, 9, 4, 3]                       # SMs 3 and 9 hold two CTAs each
    row = decode_timeline.summarize(stamps.astype(np.uint32), gbytes=1.0)
    assert row["shared"] == 2.0
    stamps[:, 7] = [0, 1, 2, 3, 4]
    assert decode_timeline.summarize(stamps.astype(np.uint32), gbytes=1.0)["shared"] == 0.0
