"""Old import paths users wrote keep working after the redesign, with a warning that names the
new one; the checkpoint command line runs as a package without runpy's warning."""
import importlib
import subprocess
import sys

import pytest

import zfunc  # noqa: F401 (installs the aliases)


@pytest.mark.parametrize("old, new", [("zfunc.rates", "zfunc.transforms.offload.rates"),
                                      ("zfunc.offload_plan", "zfunc.transforms.offload.plan")])
def test_an_old_module_path_warns_and_is_the_new_module(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(FutureWarning, match=new):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_the_checkpoint_command_line_runs_without_a_runpy_warning():
    out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "zfunc.checkpoint", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "consolidate" in out.stdout and "export-hf" in out.stdout
    assert "RuntimeWarning" not in out.stderr, out.stderr
