"""autotune uses Optuna through its public surface only: no private Optuna module, class, function or attribute is
named anywhere in the package (issue 22), so an Optuna release that reshuffles its internals cannot break a search."""

from __future__ import annotations

import ast
from pathlib import Path

import optuna

PACKAGE = Path(__file__).resolve().parents[2] / "autotune"
OPTUNA = Path(optuna.__file__).resolve().parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_private_names(root: Path) -> set[str]:
    """Every private name a package defines: its private modules, functions, classes, module globals and the
    attributes it assigns (self._x = ...)."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        names |= {part.removesuffix(".py") for part in path.relative_to(root).parts if _private(part)}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {name for name in names if _private(name)}


def _dotted(node: ast.expr) -> list[str]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def private_optuna_uses(source: str, optuna_private: set[str], own_private: set[str]) -> list[str]:
    """Where source names a private Optuna name: an import from a private Optuna module or of a private name,
    optuna.x._y; in a module that imports optuna (the modules that hold Optuna's objects), also an attribute or a
    getattr string that Optuna defines and autotune does not (trial._trial_id, study._storage, "_get_trials"), or
    one both define read off another object than self. (Elsewhere such a name is torch's: Module._modules.)"""
    found: list[str] = []
    tree = ast.parse(source)
    holds_optuna = any(
        (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "optuna" for a in node.names))
        or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "optuna")
        for node in ast.walk(tree)
    )
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "optuna":
            names = [alias.name for alias in node.names]
            if any(_private(part) for part in (node.module or "").split(".")) or any(map(_private, names)):
                found.append(f"{line}: from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "optuna" and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            dotted = _dotted(node)
            receiver = dotted[0] if dotted else None
            if receiver == "optuna" or (holds_optuna and node.attr in optuna_private and (
                    node.attr not in own_private or receiver not in ("self", "cls"))):
                found.append(f"{line}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            if holds_optuna and node.value in optuna_private - own_private:
                found.append(f"{line}: {node.value!r}")
    return found


def test_the_package_names_no_private_optuna_name() -> None:
    optuna_private, own_private = defined_private_names(OPTUNA), defined_private_names(PACKAGE)
    offenders = {
        str(path.relative_to(PACKAGE.parent)): uses
        for path in sorted(PACKAGE.rglob("*.py"))
        if (uses := private_optuna_uses(path.read_text(), optuna_private, own_private))
    }
    assert offenders == {}


def test_the_scan_finds_each_kind_of_private_use() -> None:
    optuna_private, own_private = defined_private_names(OPTUNA), defined_private_names(PACKAGE)
    assert {"_trial_id", "_storage", "_CachedStorage", "_get_trials", "_heartbeat"} <= optuna_private
    offending = {
        "trial._trial_id": ".",
        "study._storage.get_all_trials(0)": ".",
        "optuna.storages._CachedStorage(rdb)": ".",
        "from optuna.storages._heartbeat import BaseHeartbeat": "from",
        "from optuna.storages import _CachedStorage": "from",
        "import optuna.storages._rdb.models": "import",
        "getattr(optuna.storages.RDBStorage, '_get_trials')": "'",
        "other._lock.acquire()": ".",  # a name autotune defines too, read off an object not its own
    }
    for source, kind in offending.items():
        uses = private_optuna_uses(f"import optuna\n{source}", optuna_private, own_private)
        assert len(uses) == 1 and uses[0].split(": ", 1)[1].startswith(kind), (source, uses)
    fine = "import optuna\nself._lock = 1\nstudy.trials[0].number\noptuna.storages.fail_stale_trials(study)\n"
    assert private_optuna_uses(fine, optuna_private, own_private) == []
