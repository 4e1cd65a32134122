import os
import sys

import pytest

# The shared harness (tests/harness, docs/testing.md) goes on the path: tests import its modules by
# name, and the worker processes, which start with this path, find them too. A test module never
# imports another (tests/core/test_test_imports.py); pytest's default import mode puts each test
# file's own folder on the path as it collects it, so a worker still finds a test's top-level
# function by its module name.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness"))
# Every process a test launches lets gloo's workers finish before its interpreter's teardown
# (harness/at_exit/sitecustomize.py says why): the reference runs under real DeepSpeed need it.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness", "at_exit"),
                os.environ.get("PYTHONPATH")) if p)

from workers import close_all  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _stop_workers():
    yield
    close_all()


def pytest_runtest_logreport(report):
    """With ``ZFUNC_FAILURE_LOG=path``, each failure's traceback is appended to ``path`` the
    moment it happens, and each test's outcome and seconds to ``path.outcomes`` (the GPU check
    reads them even when the run is cut short, and xdist's dots name no test; docs/testing.md's
    tier costs are summed from them)."""
    path = os.environ.get("ZFUNC_FAILURE_LOG")
    if not path:
        return
    if report.failed:
        with open(path, "a") as f:
            f.write(f"\n===== {report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}\n")
    if report.when == "call" or report.outcome != "passed" or report.duration > 1:
        with open(path + ".outcomes", "a") as f:
            f.write(f"{report.outcome} {report.nodeid} ({report.when}) {report.duration:.2f}s\n")
