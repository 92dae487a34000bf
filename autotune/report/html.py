"""Pure: report blocks -> one self-contained HTML page (inline CSS, figures as base64 data URIs, no scripts, nothing
fetched), so the file opens offline and can be mailed or attached as is."""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Sequence

from autotune.report.document import Block, Bullets, Callout, Code, Heading, Image, Paragraph, Table

_CSS = """
body { font: 15px/1.5 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #1f2328; background: #fff;
       max-width: 1180px; margin: 2em auto; padding: 0 1.5em; }
h1 { font-size: 1.7em; border-bottom: 1px solid #d0d7de; padding-bottom: .3em; }
h2 { font-size: 1.35em; border-bottom: 1px solid #d0d7de; padding-bottom: .2em; margin-top: 1.8em; }
h3 { font-size: 1.1em; margin-top: 1.4em; }
code { font: 0.88em ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; background: #f3f4f6;
       padding: .1em .3em; border-radius: 4px; }
pre { background: #f6f8fa; padding: .9em 1em; border-radius: 6px; overflow-x: auto; }
pre code { background: none; padding: 0; font-size: 0.85em; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.88em; }
th, td { border: 1px solid #d0d7de; padding: .3em .6em; vertical-align: top; }
th { background: #f6f8fa; }
td.right, th.right { text-align: right; }
tr.chosen td { background: #fff8c5; }
figure { margin: 1em 0 1.5em; }
figure img { max-width: 100%; height: auto; border: 1px solid #e5e7eb; }
figcaption { color: #57606a; font-size: 0.9em; margin-top: .3em; }
.warning { border-left: 4px solid #bf8700; background: #fff8c5; padding: .6em 1em; margin: .8em 0;
           border-radius: 0 6px 6px 0; }
.warning strong.title { color: #7d4e00; }
ul li { margin: .25em 0; }
"""


def render_html(blocks: Sequence[Block], *, title: str) -> str:
    body: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            body.append(f"<h{block.level}>{_inline(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            body.append(f"<p>{_inline(block.text)}</p>")
        elif isinstance(block, Bullets):
            body.append("<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in block.items) + "</ul>")
        elif isinstance(block, Table):
            body.append(_table(block))
        elif isinstance(block, Code):
            language = f' class="language-{html.escape(block.language)}"' if block.language else ""
            body.append(f"<pre><code{language}>{html.escape(block.text)}</code></pre>")
        elif isinstance(block, Image):
            figure = block.figure
            data = base64.b64encode(figure.png).decode("ascii")
            body.append(
                f'<figure id="{html.escape(figure.name)}"><img src="data:image/png;base64,{data}" '
                f'alt="{html.escape(figure.title)}" width="{figure.width_px}" height="{figure.height_px}"></figure>'
            )
        elif isinstance(block, Callout):
            body.append(f'<div class="warning"><strong class="title">⚠ {_inline(block.title)}.</strong> '
                        f"{_inline(block.text)}</div>")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


def _table(table: Table) -> str:
    def cls(i: int) -> str:
        return ' class="right"' if table.align[i] == "right" else ""

    head = "".join(f"<th{cls(i)}>{_inline(h)}</th>" for i, h in enumerate(table.header))
    rows = []
    for n, row in enumerate(table.rows):
        marker = ' class="chosen"' if n in table.highlight else ""
        cells = [_inline(c) for c in row]
        if n in table.highlight:
            cells[0] += " ★"
        rows.append(f"<tr{marker}>" + "".join(f"<td{cls(i)}>{c}</td>" for i, c in enumerate(cells)) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


_CODE = re.compile(r"`([^`]+)`")
_BOLD = re.compile(r"\*\*(.+?)\*\*")
_ITALIC = re.compile(r"(?<![\w*])\*(?!\s)([^*]+?)\*(?![\w*])")


def _inline(text: str) -> str:
    """The inline Markdown the document uses (`code`, **bold**, *italic*) as HTML; everything else escaped. Code
    spans are set aside first, so bold may wrap them and their contents stay literal."""
    codes: list[str] = []

    def keep(match: re.Match[str]) -> str:
        codes.append(f"<code>{html.escape(match.group(1))}</code>")
        return f"\x00{len(codes) - 1}\x00"

    escaped = html.escape(_CODE.sub(keep, text))
    escaped = _BOLD.sub(r"<strong>\1</strong>", escaped)
    escaped = _ITALIC.sub(r"<em>\1</em>", escaped)
    return re.sub("\x00(\\d+)\x00", lambda m: codes[int(m.group(1))], escaped)
