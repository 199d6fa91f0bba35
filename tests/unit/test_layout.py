"""The house's shape, checked: no import circle among ecd's modules at import time, every module
at most 550 lines, no package over 12 modules, and the daemon's packages import only downwards
(docs/architecture.md draws the layers). Imports under `if TYPE_CHECKING:` and inside functions
do not run at import time, so they do not count."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ecd"
MAX_MODULE_LINES = 550
MAX_PACKAGE_MODULES = 12

# Who may import whom inside ecd.daemon, at import time: a package may import those listed for it
# (and anything outside ecd.daemon). Bottom up: the registry (entries and their life), the
# operational parts (metrics, security, systemd, reload: they read the daemon through narrow
# views), the tiers (host pool, disk), the control socket, the peer plane (whose owner side
# serves peers the way the control socket serves clients); server.py assembles everything.
DAEMON_LAYERS = {
    "registry": {"registry"},
    "ops": {"ops", "registry", "writes"},
    "tiers": {"tiers", "registry", "ops"},
    # puts without a message: put leases and the submission area's consumer
    "writes": {"writes", "registry"},
    "control": {"control", "registry", "tiers", "ops", "writes"},
    "peer": {"peer", "control", "registry", "tiers", "ops"},
    # what outlives the process: the keepers of the pool and the adoption of its journal
    "restart": {"restart", "registry", "tiers", "ops"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_time_imports(path: Path) -> set[str]:
    """The ecd modules `path` imports when it is imported (module level, outside TYPE_CHECKING)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if not is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                    visit(block)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("ecd"))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("ecd"):
                    continue
                for alias in node.names:  # `from pkg import module` imports the module
                    sub = f"{target}.{alias.name}"
                    found.add(sub if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() else target)
    visit(ast.parse(path.read_text()).body)
    return found


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {}
    for name, path in known.items():
        edges = set()
        for target in import_time_imports(path):
            # importing a.b.c imports a and a.b first: their __init__ modules run too
            parts = target.split(".")
            edges.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        graph[name] = {t for t in edges if t in known and t != name}
    return graph


def test_no_import_circle_at_import_time():
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def strongconnect(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                strongconnect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            strongconnect(node)
    assert not circles, f"import circles at import time: {circles}"


def test_daemon_packages_import_only_their_layers():
    wrong = []
    for name, targets in import_graph().items():
        parts = name.split(".")
        if len(parts) < 3 or parts[1] != "daemon" or parts[2] not in DAEMON_LAYERS:
            continue
        allowed = DAEMON_LAYERS[parts[2]]
        for target in targets:
            tparts = target.split(".")
            if len(tparts) >= 3 and tparts[1] == "daemon" and tparts[2] not in allowed:
                wrong.append(f"{name} -> {target}")
            elif tparts[:2] == ["ecd", "daemon"] and len(tparts) == 3 and tparts[2] not in DAEMON_LAYERS:
                wrong.append(f"{name} -> {target} (the daemon's assembly)")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_at_most_550_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)} has {lines} lines"


def test_no_package_has_more_than_12_modules():
    crowded = {}
    for package in [p.parent for p in PACKAGE.rglob("__init__.py")]:
        count = sum(1 for p in package.glob("*.py") if p.name != "__init__.py")
        if count > MAX_PACKAGE_MODULES:
            crowded[str(package.relative_to(ROOT))] = count
    assert not crowded, f"packages with more than {MAX_PACKAGE_MODULES} modules: {crowded}"


# Private names of other projects that tests may read (they are not ecd's to open up).
FOREIGN_PRIVATES = {"_vllm_config", "_sleep", "_connector_metadata", "_exit", "_getframe", "_replace", "_asdict",
                    "_fields", "_make", "_batch_mm_inputs_from_scheduler"}


def test_tests_reach_ecd_objects_only_through_public_names():
    """Tests see inside a daemon, client or connector object only through its public names or a
    named test-support hook (ecd/client/testing.py): never `obj._private` (a test helper's own
    attributes, `self._x`, are its business; a module's private layout constants, such as the
    ring's header offsets that its corruption tests write, are not an object's state)."""
    reaching = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.attr not in FOREIGN_PRIVATES):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if node.attr == "_copy":  # ecd._copy: the C extension's module name, not a private attribute
                continue
            if node.attr.isupper():  # a module's layout constant (the ring's header offsets), not an object's state
                continue
            reaching.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert not reaching, "tests reading private attributes:\n" + "\n".join(reaching)
