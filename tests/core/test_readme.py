"""The README's first example runs as pasted, and the documentation's links resolve: the front page
is the first code a user runs, so a change that breaks it fails here."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def first_python_block(markdown: str) -> str:
    """The body of the first ```python fence."""
    return re.search(r"^```python\n(.*?)^```", markdown, flags=re.S | re.M).group(1)


def test_the_first_example_runs_as_pasted(tmp_path):
    """In a fresh interpreter, in an empty folder, with no process group and no torchrun: exactly
    what a user who pastes it into a file and runs it with python gets."""
    with open(os.path.join(ROOT, "README.md")) as f:
        example = first_python_block(f.read())
    (tmp_path / "first.py").write_text(example)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = ROOT  # this checkout's zfunc, whatever is installed
    out = subprocess.run([sys.executable, "first.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert os.listdir(tmp_path) == ["first.py"], "the example leaves nothing behind"


def test_the_docs_links_resolve():
    """docs/check_links.py: every relative link in README.md and docs/ names a file and a heading there."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "docs", "check_links.py")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
