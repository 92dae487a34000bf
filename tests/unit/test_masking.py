"""Storage passwords are masked wherever a URL is shown or written."""

from __future__ import annotations

import pytest

from autotune.masking import mask_argv, mask_url, redact


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql://u:hunter2-secret@db.example:5432/optuna", "postgresql://u:***@db.example:5432/optuna"),
        ("postgresql+psycopg://u:p%40ss@[::1]:5432/x", "postgresql+psycopg://u:***@[::1]:5432/x"),
        ("mysql://u:pw@[::1]:3306/db", "mysql://u:***@[::1]:3306/db"),
        ("postgresql://u:p@ss@host/db", "postgresql://u:***@host/db"),
        ("postgresql://:pw@host/db", "postgresql://:***@host/db"),
        ("postgresql://u@host/db", "postgresql://u@host/db"),
        ("postgresql://u:pw@h/db?sslmode=require&password=x", "postgresql://u:***@h/db?sslmode=require&password=***"),
        ("postgresql://h/db?PassWord=x&user=u", "postgresql://h/db?PassWord=***&user=u"),
        ("sqlite:///.autotune/x.db", "sqlite:///.autotune/x.db"),
        ("not a url", "not a url"),
        ("", ""),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_redact_removes_the_password_wherever_a_message_quotes_it() -> None:
    url = "postgresql://bob:s3cr%40t-pw@db/x?password=other-secret"
    text = f"cannot open {url}: password 's3cr@t-pw' and 's3cr%40t-pw' rejected; other-secret too"
    out = redact(text, [url, None])
    assert "s3cr" not in out and "other-secret" not in out
    assert "postgresql://bob:***@db/x?password=***" in out
    assert redact("a b c", ["postgresql://u:a@h/db"]) == "a b c"  # a one-letter password is not hunted down


def test_mask_argv() -> None:
    argv = ["search", "m.py", "--storage", "postgresql://u:pw1@h/db", "--storage=postgresql://u:pw2@h/db", "--json"]
    assert mask_argv(argv) == [
        "search", "m.py", "--storage", "postgresql://u:***@h/db", "--storage=postgresql://u:***@h/db", "--json"
    ]
