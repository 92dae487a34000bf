"""What a new user and a fault drill hit (issue 13): help texts, early checks of the output and the model path, and
warnings a command owes before it spends minutes."""

from __future__ import annotations

from typer.testing import CliRunner

from autotune.cli import app

runner = CliRunner()


def test_search_help_shows_its_placeholders():
    result = runner.invoke(app, ["search", "--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert ".autotune/<study>.db" in result.output
    assert "<model>-<device>-g<gpus>-b<batch>" in result.output
