"""Bench models that are a recipe at other sizes: `recipe("mlp.py", WIDTHS=[...])` runs recipes/<name> in a namespace
of its own with those constants replaced (its functions read them when called) and returns that namespace."""

from pathlib import Path
from typing import Any


def recipe(name: str, **constants: Any) -> dict[str, Any]:
    path = Path(__file__).resolve().parents[2] / "recipes" / name
    namespace: dict[str, Any] = {"__name__": f"recipe_{path.stem}", "__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    unknown = set(constants) - set(namespace)
    if unknown:
        raise KeyError(f"recipes/{name} has no {sorted(unknown)}")
    namespace.update(constants)
    return namespace
