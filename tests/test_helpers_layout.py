"""Where the tests' shared code lives: in ``tests/helpers``. A ``conftest.py`` defines fixtures
and pytest hooks only, and no test imports a ``conftest`` or another test module."""

from __future__ import annotations

import ast

from tests.helpers.paths import ROOT

TESTS = ROOT / "tests"


def is_fixture(decorator: ast.expr) -> bool:
    """``@pytest.fixture`` or ``@pytest.fixture(...)``."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "fixture"


def is_pytest_variable(node: ast.Assign | ast.AnnAssign) -> bool:
    """An assignment pytest reads from a conftest (``pytest_plugins``, ``collect_ignore...``)."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return all(isinstance(t, ast.Name) and t.id.startswith(("pytest_", "collect_ignore")) for t in targets)


def test_conftest_files_define_only_fixtures_and_hooks():
    for path in TESTS.rglob("conftest.py"):
        for node in ast.parse(path.read_text()).body:
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.name.startswith("pytest_") or any(is_fixture(d) for d in node.decorator_list), \
                    f"{where}: {node.name} is no fixture or hook; shared code goes in tests/helpers"
            assert not isinstance(node, ast.ClassDef), f"{where}: shared code goes in tests/helpers"
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                assert is_pytest_variable(node), f"{where}: shared values go in tests/helpers"


def test_no_test_imports_a_conftest_or_another_test_module():
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else [f".{node.module or ''}"]
                names += [f"{node.module}.{a.name}" if node.module else a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                last = name.rpartition(".")[2]
                assert last != "conftest" and not last.startswith("test_"), \
                    f"{path.relative_to(ROOT)}:{node.lineno} imports {name}; shared code goes in tests/helpers"
