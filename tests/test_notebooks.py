"""Every notebook runs top to bottom on the CPU (reference path), is stored without
outputs, is small, and uses only the public API (so it runs unchanged on a GPU)."""

import json
import pathlib
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from compile_pool import workers

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
MAX_BYTES = 100_000
# modules a notebook may import: the public API
PUBLIC_MODULES = {"flexattn", "flexattn.torch", "flexattn.torch.context_parallel", "flexattn.mods", "flexattn.mods.ops", "flexattn.mods.positions", "flexattn.plotting"}


def execute(nb, cwd):
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def outputs(nb, kind=None):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if kind in (None, o.get("output_type"))]


def text_of(nb):
    return "".join(o.get("text", "") for o in outputs(nb, "stream"))


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"tour.ipynb", "mask_gallery.ipynb", "score_mods.ipynb", "benchmarks.ipynb"} <= names


def _execute_or_error(path):
    try:
        return execute(nbformat.read(path, as_version=4), path.parent)
    except Exception as e:   # re-raised by the notebook's own test
        return e


@pytest.fixture(scope="module")
def executed():
    """Every notebook executed once, side by side: each runs in its own kernel process, so
    threads here only wait on them (CI's two cores: ~65 s one after another, ~37 s). As
    many at once as the compile pool runs (FLEXATTN_TEST_COMPILE_WORKERS=1: one by one)."""
    with ThreadPoolExecutor(workers()) as pool:
        return dict(zip(NOTEBOOKS, pool.map(_execute_or_error, NOTEBOOKS)))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(executed, path):
    nb = executed[path]
    if isinstance(nb, Exception):
        raise nb
    errors = outputs(nb, "error")
    assert not errors, "\n".join(f"{e['ename']}: {e['evalue']}" for e in errors)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_clean_and_small(path):
    assert path.stat().st_size < MAX_BYTES, f"{path.name} is {path.stat().st_size} bytes; clear its outputs"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: cell {i} has stored outputs; clear them before saving"
            assert cell.execution_count is None, f"{path.name}: cell {i} has an execution count; clear outputs"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_uses_only_the_public_api(path):
    nb = nbformat.read(path, as_version=4)
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    imported = set(re.findall(r"^\s*(?:from|import)\s+(flexattn[\w.]*)", source, re.M))
    assert imported <= PUBLIC_MODULES, f"{path.name} imports {sorted(imported - PUBLIC_MODULES)}"
    private = re.findall(r"\b(?:flexattn|fa|mods|plotting)\._\w+", source)
    assert not private, f"{path.name} reaches into private names: {private}"


def _row(**kw):
    return {"date": "2026-11-22 08:17 UTC", "device": "NVIDIA H100 80GB HBM3", "commit": "abc1234", "script": "bench_fwd.py",
            "shape": "B4 S4096 H16 D128", "metric": "tflops", "unit": "TFLOP/s", **kw}


RESULT_ROWS = {   # benchmarks/results/<area>.jsonl stand-ins
    "forward": [
        _row(variant="causal", impl="flexattn", value=540.2, date="2026-11-21 10:00 UTC"),   # older: replaced below
        _row(variant="causal", impl="flexattn", value=578.7),
        _row(variant="causal", impl="fa4", value=593.5),
        _row(variant="window1024", impl="flexattn", value=445.3),
        _row(variant="window1024", impl="flexattn", metric="first_call_s", unit="s", value=1.9),  # not plotted
        _row(variant="document4", impl="fa4", value=None, note="n/a"),                           # no value
    ],
    "decode": [
        _row(script="bench_decode.py", shape="B8 L8192", layout="paged64", variant="alibi", impl=impl, metric="tbps",
             unit="TB/s", value=v) for impl, v in (("flexattn", 2.43), ("flexattn-k/c", 2.75), ("flexattn/loop", 2.73))
    ],
    "host": [_row(script="bench_overhead.py", variant="full", impl="flexattn/torch", metric="host_us", unit="µs", value=15.2)],
}


@pytest.mark.skipif(not (NOTEBOOK_DIR / "benchmarks.ipynb").exists(), reason="no benchmarks notebook")
@pytest.mark.parametrize("content", ["missing", "no-plottable-rows", "rows"])
def test_benchmarks_notebook_reads_results(tmp_path, content):
    """The notebook finds benchmarks/results/*.jsonl above its folder; run it on a stand-in tree."""
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "benchmarks").mkdir()
    if content != "missing":
        results = tmp_path / "benchmarks" / "results"
        results.mkdir()
        areas = {"host": RESULT_ROWS["host"]} if content == "no-plottable-rows" else RESULT_ROWS
        for area, rows in areas.items():
            (results / f"{area}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    nb = execute(nbformat.read(NOTEBOOK_DIR / "benchmarks.ipynb", as_version=4), tmp_path / "notebooks")
    assert not outputs(nb, "error")
    text = text_of(nb)
    images = [o for o in outputs(nb) if "image/png" in o.get("data", {})]
    if content == "missing":
        assert "No benchmark results yet" in text and not images
    elif content == "no-plottable-rows":
        assert "holds 1 row(s), but none with a TFLOP/s or TB/s value" in text and not images
    else:
        assert "Forward TFLOP/s: 3 measurements from forward.jsonl" in text
        assert "2026-11-22 08:17 UTC · NVIDIA H100 80GB HBM3 · commit abc1234" in text
        assert re.search(r"^causal\s+578\.7\s+593\.5$", text, re.M)      # the latest causal row, not 540.2
        assert re.search(r"^window1024\s+445\.3\s+-$", text, re.M) and "540.2" not in text
        assert "Decode TB/s: 2 measurements from decode.jsonl" in text     # flexattn/loop is not a plotted column
        assert re.search(r"^paged64 alibi\s+2\.43\s+2\.75$", text, re.M)
        assert "backward" not in text.lower() and len(images) == 2
