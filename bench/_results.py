"""Write a benchmark's table to bench/results/<name>.md and .json, with the date, device and command that made it."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def device_line(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}"
    processor = platform.processor() or platform.machine()
    return f"CPU stand-in ({os.cpu_count()} cores, {processor}), torch {torch.__version__}"


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def show(tables: dict[str, str]) -> None:
    """Print the tables as write() puts them in the results file (for --no-write)."""
    for heading, table in tables.items():
        print(f"\n## {heading}\n\n{table}")


def write(name: str, *, title: str, device: str, tables: dict[str, str], data: dict[str, Any], notes: str = "") -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    body = [f"# {title}", "", f"- date: {stamp}", f"- device: {device_line(device)}", f"- command: `{command}`", ""]
    for heading, table in tables.items():
        body += [f"## {heading}", "", table, ""]
    if notes:
        body += [notes.strip(), ""]
    path = RESULTS / f"{name}.md"
    path.write_text("\n".join(body))
    (RESULTS / f"{name}.json").write_text(
        json.dumps({"date": stamp, "device": device_line(device), "command": command, **data}, indent=2, default=str)
    )
    print("\n".join(body))
    return path
