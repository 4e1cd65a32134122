"""The package's layers hold (pyproject.toml's import-linter contracts: pipeline > engine > transforms |
checkpoint > the step > weights | optim | swap > the base; the native ops independent; no import
circles), the contracts do catch a circle put back, the root holds only what a step imports, and
every package ships in the wheel."""
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


def test_the_root_holds_only_what_a_step_imports():
    """A module stays in the root of zfunc/ only if ``zfunc.step`` imports it (directly or through
    another): every other concern has a package of its own (docs/architecture.md)."""
    import grimp

    graph = grimp.build_graph("zfunc")
    needed = graph.find_upstream_modules("zfunc.step") | {"zfunc.step"}
    root = sorted(f"zfunc.{name[:-3]}" for name in os.listdir(os.path.join(ROOT, "zfunc"))
                  if name.endswith(".py") and name != "__init__.py")
    assert [m for m in root if m not in needed] == []


def test_every_package_ships_in_the_wheel():
    """pyproject.toml lists the packages a non-editable install carries: a new package must be there."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {os.path.relpath(folder, ROOT).replace(os.sep, ".")
             for folder, _, files in os.walk(os.path.join(ROOT, "zfunc")) if "__init__.py" in files}
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
