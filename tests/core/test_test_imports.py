"""No test module imports another, and the harness imports none: what tests share lives in
tests/harness/ (docs/testing.md), so a test file can be read, moved or deleted on its own.

Every ``tests/**/test_*.py``, ``tests/harness/*.py`` and ``tests/**/conftest.py`` is parsed with ``ast``; an import of a
module named ``test_*`` (``import test_x``, ``from test_x import f``, ``from tests.core.test_x
import f``, ``from . import test_x``), at the top or inside a function, fails, naming its file and
line."""
import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def _is_test_module(dotted: str) -> bool:
    return any(part.startswith("test_") for part in dotted.split("."))


def _imports_of_test_modules(path: pathlib.Path, root: pathlib.Path = TESTS.parent) -> list[str]:
    """Each import in ``path`` of a test module, or of a ``test_*`` name from a module (a test module of a
    package, or a test function, which would run again where imported): "file:line: the statement",
    the file relative to ``root``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [base] if base else []
            names += [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
        else:
            continue
        if any(_is_test_module(name) for name in names):
            found.append((node.lineno, f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}"))
    return [line for _, line in sorted(found)]


def test_no_test_module_imports_another():
    found = [line for path in sorted(TESTS.rglob("test_*.py")) for line in _imports_of_test_modules(path)]
    assert not found, "a test imports another test module (move what they share to tests/harness/):\n" + \
        "\n".join(found)


def test_the_harness_and_the_conftests_import_no_test_module():
    paths = sorted((TESTS / "harness").rglob("*.py")) + sorted(TESTS.rglob("conftest.py"))
    found = [line for path in paths for line in _imports_of_test_modules(path)]
    assert not found, "the harness or a conftest imports a test module:\n" + "\n".join(found)


def test_the_check_finds_each_form_of_import(tmp_path):
    """Absolute, from the package path, relative, inside a function, and a ``test_*`` name imported
    from a module are each found, with their line; modules that only have "test" elsewhere in their
    name are not."""
    path = tmp_path / "example.py"
    path.write_text("import test_a\nfrom test_b import f\nfrom tests.core.test_c import g\nfrom . import test_d\n"
                    "def h():\n    from test_e import k\n"
                    "import testing_tools\nfrom zfunc.testing import memory\nfrom models import test_name_like\n")
    found = _imports_of_test_modules(path, tmp_path)
    assert [line.split(": ", 1)[0] for line in found] == [f"example.py:{n}" for n in (1, 2, 3, 4, 6, 9)], found
