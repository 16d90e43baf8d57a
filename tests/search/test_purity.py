"""The search is pure: no torch, no torch.distributed, no printing, no module-level mutable state."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_elixir.search as search_pkg

FILES = sorted(Path(search_pkg.__file__).parent.glob("*.py"))


def test_search_files_import_no_torch_and_do_not_print():
    assert FILES
    for path in FILES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "torch" for a in node.names), path
            if isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "torch", path
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "print", path


def test_no_module_level_mutable_containers_are_mutated():
    """Module-level dicts/lists/sets may exist as constants only if nothing calls a mutator on them."""
    mutators = {"append", "extend", "update", "add", "pop", "clear", "setdefault", "remove", "insert"}
    for path in FILES:
        tree = ast.parse(path.read_text())
        names = {t.id for node in tree.body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = node.func.value
                if isinstance(target, ast.Name) and target.id in names:
                    assert node.func.attr not in mutators, f"{path}: {target.id}.{node.func.attr}"
            if isinstance(node, ast.Global):
                raise AssertionError(f"{path}: global statement")
