"""Pure: report blocks -> GitHub-flavoured Markdown, figures referenced by relative path (figures/<name>.png)."""

from __future__ import annotations

from collections.abc import Sequence

from autotune.report.document import Block, Bullets, Callout, Code, Heading, Image, Paragraph, Table

FIGURES_DIR = "figures"


def render_markdown(blocks: Sequence[Block]) -> str:
    parts: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            parts.append("#" * block.level + " " + block.text)
        elif isinstance(block, Paragraph):
            parts.append(block.text)
        elif isinstance(block, Bullets):
            parts.append("\n".join(f"- {item}" for item in block.items))
        elif isinstance(block, Table):
            parts.append(_table(block))
        elif isinstance(block, Code):
            fence = "````" if "```" in block.text else "```"
            parts.append(f"{fence}{block.language}\n{block.text}\n{fence}")
        elif isinstance(block, Image):
            figure = block.figure
            parts.append(f"![{figure.title}]({FIGURES_DIR}/{figure.filename})")
        elif isinstance(block, Callout):
            # GitHub renders this as a warning box; elsewhere it is a plain quote.
            parts.append(f"> [!WARNING]\n> **{block.title}.** {block.text}")
    return "\n\n".join(parts) + "\n"


def _table(table: Table) -> str:
    rule = {"left": ":---", "right": "---:"}
    lines = [
        "| " + " | ".join(_cell(h) for h in table.header) + " |",
        "| " + " | ".join(rule[a] for a in table.align) + " |",
    ]
    for i, row in enumerate(table.rows):
        cells = [_cell(c) for c in row]
        if i in table.highlight:
            cells[0] = f"{cells[0]} ★"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
