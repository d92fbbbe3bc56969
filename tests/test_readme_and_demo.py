"""The README's example and the demo must keep working as written."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_example_runs():
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    out = namespace["out"]
    assert out.shape == (2, 8, 1024, 64) and bool(out.isfinite().all())
    assert namespace["q"].grad is not None


def test_readme_names_the_ci_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q tests" in readme and "python -m pytest -q tests" in ci


def test_demo_runs_and_agrees_with_naive_softmax(tmp_path):
    png = tmp_path / "mask.png"
    r = subprocess.run([sys.executable, "-m", "flexattn", "--seq", "512", "--plot", str(png)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "-> OK" in r.stdout and "sparsity=" in r.stdout
    assert png.stat().st_size > 1000
