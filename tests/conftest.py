import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from workers import close_all  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _stop_workers():
    yield
    close_all()
