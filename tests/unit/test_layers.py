"""Imports only go down: every ``moefleet`` package imports only packages of a lower layer.

The layers are docs/architecture.md's, top to bottom; this test reads every import
statement of ``src/moefleet`` (function-local ones too: a deferred import is still an
arrow) and fails naming each file and line whose import runs up or sideways.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "moefleet"

# Top to bottom; packages on one line are one layer and may not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("__main__",),
    ("cli",),
    ("compare", "demo", "experiments"),
    ("calibration",),
    ("serve",),
    ("remoe",),
    ("compose",),
    ("experts",),
    ("runtime",),
    ("autoscale",),
    ("sim",),
    ("plan",),
    ("brownout", "engine", "profiles", "predict"),
    ("report",),
    ("traces",),
    ("models",),
    ("data", "platform", "workloads", "control", "torch_io"),
    ("io", "paths", "limits", "metric_names"),
    ("errors",),
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}

def _package(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def _imported(tree: ast.AST, module: list[str]) -> list[tuple[str, int]]:
    """(top-level moefleet package, line) of every moefleet import in ``tree``."""
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = ["moefleet", *module[: len(module) - node.level]]
                names = [".".join([*base, *([node.module] if node.module else [])])]
            else:
                names = [node.module or ""]
        for name in names:
            parts = name.split(".")
            if parts[0] == "moefleet" and len(parts) > 1:
                out.append((parts[1], node.lineno))
    return out


def test_every_package_has_a_layer() -> None:
    packages = {_package(p) for p in SRC.rglob("*.py")} - {"__init__"}
    assert not packages - RANK.keys(), (
        f"packages without a layer: {sorted(packages - RANK.keys())}; place them in LAYERS "
        "and in docs/architecture.md's diagram")


def test_imports_only_go_down() -> None:
    upward: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        src = _package(path)
        if src == "__init__":
            continue
        module = list(path.relative_to(SRC).with_suffix("").parts)
        for dst, line in _imported(ast.parse(path.read_text(), str(path)), module):
            if dst == src:
                continue
            if RANK[dst] <= RANK[src]:
                upward.append(f"{path.relative_to(SRC.parent)}:{line}: {src} -> {dst}")
    assert not upward, "imports that do not go down:\n" + "\n".join(upward)
