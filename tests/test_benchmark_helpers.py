"""CPU (CI): the benchmarks' shared cProfile helpers (benchmarks/common.py), which seven
device scripts print their host profiles through."""

import os
import sys

# (appended: the benchmarks' module names never shadow a test helper's)
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

from common import cprofile_calls, cprofile_lines  # noqa: E402


def _leaf_of_the_profiled_call(n):
    return sum(range(n))


def _profiled_call():
    return _leaf_of_the_profiled_call(2000)


def test_the_profile_counts_every_call_and_names_its_callees():
    profile, per_call = cprofile_calls(_profiled_call, 7)
    assert per_call > 0
    lines = cprofile_lines(profile, ("tottime",), 10)
    assert all(line.strip() for line in lines)   # blank lines dropped
    leaf = [line for line in lines if "_leaf_of_the_profiled_call" in line]
    assert len(leaf) == 1 and leaf[0].split()[0] == "7"   # ncalls


def test_between_runs_after_each_call_outside_the_profile():
    seen = []

    def between_calls():
        seen.append(len(seen))

    profile, _ = cprofile_calls(_profiled_call, 5, between=between_calls)
    assert seen == [0, 1, 2, 3, 4]
    lines = cprofile_lines(profile, ("cumulative",), 20)
    assert not any("between_calls" in line for line in lines)
    assert any("_profiled_call" in line for line in lines)


def test_each_order_prints_its_own_table():
    profile, _ = cprofile_calls(_profiled_call, 3)
    one = cprofile_lines(profile, ("tottime",), 5)
    both = cprofile_lines(profile, ("tottime", "cumulative"), 5)
    assert sum("Ordered by" in line for line in one) == 1
    assert sum("Ordered by" in line for line in both) == 2
