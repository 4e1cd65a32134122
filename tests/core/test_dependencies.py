"""Every third-party module the library, the tests, the examples and the benchmarks import is declared
in pyproject, so the README's commands work on a fresh machine: a package installed by hand on a
developer's machine once hid ``peft`` from the test extra and the test command failed to collect.

What the tests run (tests/, examples/, zfunc/ and the benchmarks a test launches) must come from
the project's dependencies or its ``test`` extra; the other benchmarks may use any extra.
"""
from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOCAL_FOLDERS = ("zfunc", "tests", "examples", "benchmarks")


def _declared() -> dict[str, set[str]]:
    """``{extra or "": normalized distribution names}`` from pyproject."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lists = {"": project["dependencies"], **project.get("optional-dependencies", {})}
    return {extra: {_normalize(re.split(r"[<>=!~\[;\s]", req, maxsplit=1)[0]) for req in reqs}
            for extra, reqs in lists.items()}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _local_names() -> set[str]:
    """Module names that resolve to the repository's own files (test helpers, scripts beside each other)."""
    names = {"zfunc", "_zfunc_as_deepspeed"}  # the top-level packages pyproject ships
    for folder in LOCAL_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            names.add(path.stem)
            names.update(part for part in path.relative_to(ROOT).parts[:-1])
    return names


def _imports(path: pathlib.Path) -> set[str]:
    """The top-level module names ``path`` imports (absolute imports only)."""
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            tops.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def _benchmarks_tests_run() -> set[pathlib.Path]:
    """The benchmark scripts a test names, with the benchmark modules they import."""
    scripts = {p.name: p for p in (ROOT / "benchmarks").glob("*.py")}
    named = set()
    for test in (ROOT / "tests").rglob("*.py"):
        strings = [n.value for n in ast.walk(ast.parse(test.read_text())) if isinstance(n, ast.Constant)
                   and isinstance(n.value, str)]
        if any("benchmarks" in s for s in strings):
            named.update(scripts[name] for s in strings for name in scripts if s.endswith(name))
    todo, seen = list(named), set()
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo.extend(scripts[m + ".py"] for m in _imports(path) if m + ".py" in scripts)
    return seen


def _undeclared(files, allowed: set[str], local: set[str], where: str) -> list[str]:
    providers = importlib.metadata.packages_distributions()
    problems = []
    for path in sorted(files):
        for top in sorted(_imports(path)):
            if top in sys.stdlib_module_names or top in local or top == "__future__":
                continue
            dists = {_normalize(d) for d in providers.get(top, [])} or {_normalize(top)}  # not installed: its own name
            if not dists & allowed and top not in providers:
                problems.append(f"{path.relative_to(ROOT)} imports {top!r}, which no installed distribution provides: "
                                f"declare the package that provides it in pyproject ({where})")
            elif not dists & allowed:
                problems.append(f"{path.relative_to(ROOT)} imports {top!r} (from {sorted(dists)}), which {where} "
                                f"does not name: add it there in pyproject.toml")
    return problems


def test_what_the_tests_run_is_declared():
    declared = _declared()
    files = [p for folder in ("zfunc", "tests", "examples") for p in (ROOT / folder).rglob("*.py")]
    files += _benchmarks_tests_run()
    problems = _undeclared(files, declared[""] | declared.get("test", set()), _local_names(),
                           "[project] dependencies or the 'test' extra")
    assert not problems, "\n".join(problems)


def test_every_benchmark_import_is_declared():
    declared = _declared()
    everything = set().union(*declared.values())
    problems = _undeclared(list((ROOT / "benchmarks").rglob("*.py")), everything, _local_names(), "any extra")
    assert not problems, "\n".join(problems)


def test_an_undeclared_import_is_named(tmp_path, monkeypatch):
    """The check can fail: a module importing a package pyproject does not name is reported by name."""
    script = tmp_path / "uses_it.py"
    script.write_text("import optree\nimport json\nfrom hypothesis import given\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    problems = _undeclared([script], {"optree"}, set(), "the test extra")
    assert len(problems) == 1 and "'hypothesis'" in problems[0] and "uses_it.py" in problems[0], problems
