"""The app's layers point one way: cli -> tui -> chat -> the backend's API. Read from the source (every import,
including those inside functions): app/tui and app/chat import from the backend only ``api``, ``limits``, ``errors``,
``paths``, ``files``, ``inputs`` and ``redact`` (and ``models.config`` for annotations, under TYPE_CHECKING);
everything else of the backend (loading, memory, hub, the engine) reaches the UI through the callables app/cli passes in
(app/tui/seams.py). No package __init__ imports its submodules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[2] / "app"
BACKEND_FOR_THE_UI = {
    "specchat.backend.api",
    "specchat.backend.limits",
    "specchat.backend.errors",
    "specchat.backend.paths",
    "specchat.backend.files",
    "specchat.backend.inputs",
    "specchat.backend.redact",  # a leaf: secrets masked and terminal escapes stripped from what is shown
    # What a request may ask for beyond api.py (issue 46): a constraint's spec and grammar check, tool-call syntaxes.
    # Pure Python (llguidance loaded only to build a grammar), no engine.
    "specchat.backend.constraint_spec",
    "specchat.backend.tool_calls",
}
ANNOTATIONS_ONLY = {"specchat.backend.models.catalog.config"}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, under ``if TYPE_CHECKING:``) for every import in the file."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                for stmt in child.body:
                    visit_stmt(stmt, True)
                for stmt in child.orelse:
                    visit_stmt(stmt, typing_only)
                continue
            visit_stmt(child, typing_only)

    def visit_stmt(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, typing_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            found.append((node.module or "", typing_only))
        visit(node, typing_only)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return found


def _modules(folder: str) -> list[Path]:
    return sorted((APP / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _modules("tui") + _modules("chat"), ids=lambda p: str(p.relative_to(APP)))
def test_the_ui_reaches_the_backend_only_through_its_api(path: Path) -> None:
    layer = path.relative_to(APP).parts[0]
    forbidden_app = ("specchat.app.cli",) if layer == "tui" else ("specchat.app.cli", "specchat.app.tui")
    for module, typing_only in _imports(path):
        assert not module.startswith(forbidden_app), f"{path}: imports {module} (layers: cli -> tui -> chat)"
        if module.startswith("specchat.backend"):
            allowed = module in BACKEND_FOR_THE_UI or (typing_only and module in ANNOTATIONS_ONLY)
            assert allowed, f"{path}: imports {module}; the UI gets it through a callable from app/cli"


@pytest.mark.parametrize("path", sorted(APP.rglob("__init__.py")), ids=lambda p: str(p.relative_to(APP)))
def test_package_inits_import_nothing_of_their_own(path: Path) -> None:
    package = "specchat." + ".".join(("app", *path.parent.relative_to(APP).parts))
    assert not [m for m, _ in _imports(path) if m == package or m.startswith(package + ".")], path


@pytest.mark.parametrize("path", _modules("serve"), ids=lambda p: str(p.relative_to(APP)))
def test_the_server_reaches_the_engine_only_through_its_api(path: Path) -> None:
    """app/serve serves any EngineAPI: it imports nothing of the app but itself, and of the backend only the API."""
    for module, _ in _imports(path):
        if module.startswith("specchat.app"):
            assert module.startswith("specchat.app.serve"), f"{path}: imports {module}"
        if module.startswith("specchat.backend"):
            assert module in BACKEND_FOR_THE_UI, f"{path}: imports {module}; the server gets the engine from app/cli"
