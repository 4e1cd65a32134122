import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from workers import close_all  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _stop_workers():
    yield
    close_all()


def pytest_runtest_logreport(report):
    """With ``ZFUNC_FAILURE_LOG=path``, each failure's traceback is appended to ``path`` the
    moment it happens (the GPU check reads it even when the run is cut short)."""
    path = os.environ.get("ZFUNC_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"\n===== {report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}\n")
