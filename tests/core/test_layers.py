"""The package's layers hold (pyproject.toml's import-linter contracts): pipeline above engine
above transforms above the core, the native ops independent, and no import circles; and the
contracts do catch a circle put back."""
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lint_imports(root: str) -> subprocess.CompletedProcess:
    """``lint-imports`` on the package under ``root`` (its pyproject.toml's contracts)."""
    env = {**os.environ, "PYTHONPATH": root}
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                           "lint_imports_command()"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold():
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_a_circle_put_back_breaks_the_contracts(tmp_path):
    """A copy of the package where the core imports a transform (state -> offload_nvme -> step ->
    state, the circle the redesign removed) fails, naming the import."""
    shutil.copytree(os.path.join(ROOT, "zfunc"), tmp_path / "zfunc", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path / "pyproject.toml")
    state = tmp_path / "zfunc" / "state.py"
    state.write_text(state.read_text() + "\nfrom .transforms.offload.nvme import SwapState  # noqa: E402\n")
    out = lint_imports(str(tmp_path))
    assert out.returncode != 0
    assert "zfunc.state -> zfunc.transforms.offload.nvme" in out.stdout, out.stdout
