import os
import sys

import pytest

# The shared harness (tests/harness: workers, cases, models, the Adam reference, the memory reader)
# and every test folder go on the path, so a test imports a helper or another test's function by
# its module name, and the worker processes (which start with this path) find them too.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _folder, _dirs, _files in sorted(os.walk(_HERE), reverse=True):
    if "__pycache__" not in _folder:
        sys.path.insert(0, _folder)
sys.path.insert(0, os.path.join(_HERE, "harness"))

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
