"""profile/ stays free of process groups: it never imports torch.distributed."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_elixir.profile as profile_pkg

PROFILE_DIR = Path(profile_pkg.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_profile_modules_do_not_import_torch_distributed():
    files = sorted(PROFILE_DIR.glob("*.py"))
    assert len(files) >= 5
    offenders = {f.name: m for f in files for m in _imported_modules(f) if m.startswith("torch.distributed")}
    assert offenders == {}


def test_public_api_is_exported():
    assert callable(profile_pkg.profile_model) and callable(profile_pkg.profile_hardware)
    assert set(profile_pkg.__all__) >= {"ModelProfile", "HardwareProfile", "profile_model", "profile_hardware"}
