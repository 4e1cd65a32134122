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


def test_the_estimator_package_imports_under_its_name():
    import zfunc as zf
    import zfunc.estimator as E
    assert E.__name__ == "zfunc.estimator" and E.Cluster is not None and zf.estimate is E.estimate


def test_the_old_estimate_package_path_warns_and_zf_estimate_stays_callable():
    """``import zfunc.estimate`` sets ``zf.estimate`` to what it imports: the function must still run."""
    code = ("import warnings, zfunc as zf\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import zfunc.estimate as old\n"
            "    from zfunc.estimate.probes import link_rate\n"
            "    from zfunc.estimate import Cluster, Composition, Link\n"
            "import zfunc.estimator.probes as new_probes\n"
            "assert any('zfunc.estimator' in str(x.message) for x in w), [str(x.message) for x in w]\n"
            "assert link_rate is new_probes.link_rate and Cluster is zf.estimator.Cluster\n"
            "assert sum(m.startswith('zfunc.estimate.') for m in __import__('sys').modules) == 1  # no second copies\n"
            "from torch import nn\n"
            "est = zf.estimate(nn.Sequential(nn.Linear(8, 8)), Composition(stage=3), Cluster(1, 2, Link(1e9)))\n"
            "assert est.memory, est\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_zf_schedules_warns_and_is_the_pipeline_schedules():
    import zfunc as zf
    with pytest.warns(FutureWarning, match="zf.pipeline.schedules"):
        assert zf.schedules is zf.pipeline.schedules
    with pytest.raises(AttributeError, match="no_such_name"):
        zf.no_such_name
