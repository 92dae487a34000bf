"""The report a person reads after a search: Markdown with figures, and one self-contained HTML file."""

from autotune.report.writer import write_search_report

__all__ = ["write_search_report"]
