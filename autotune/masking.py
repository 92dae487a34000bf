"""Pure: storage URLs with their passwords masked, wherever autotune shows or writes one (stdout, --json, the tuned
config and its `# Command:` header, error messages, the report). Configs get committed; passwords must not."""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence

MASK = "***"
_QUERY_SECRETS = ("password", "passwd", "sslpassword")
"""Query parameters libpq (and so SQLAlchemy's PostgreSQL drivers) read a password from."""
_MIN_REDACTED = 3
"""redact() replaces a bare password anywhere in a text only from this length on (a 1-letter one would mangle it)."""


def mask_url(url: str) -> str:
    """'postgresql://u:secret@host/db?password=x' -> 'postgresql://u:***@host/db?password=***'. A URL without a
    password, or text that is no URL, comes back unchanged."""
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
        port = parts.port
    except ValueError:  # a malformed port or IPv6 host: nothing we can rebuild; hide what follows the scheme
        return url.split("://", 1)[0] + "://" + MASK if "://" in url and "@" in url else url
    netloc = parts.netloc
    if password is not None:
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host
        netloc = f"{parts.username or ''}:{MASK}@{host}" + (f":{port}" if port else "")
    query = "&".join(_mask_query_item(item) for item in parts.query.split("&")) if parts.query else ""
    if netloc == parts.netloc and query == parts.query:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


def _mask_query_item(item: str) -> str:
    key, sep, _ = item.partition("=")
    return f"{key}={MASK}" if sep and key.lower() in _QUERY_SECRETS else item


def secrets_of(url: str | None) -> list[str]:
    """The passwords in a URL, as written and URL-decoded (longest first): what redact() removes."""
    if not url:
        return []
    found: set[str] = set()
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:
        return []
    values = [password] if password else []
    for item in parts.query.split("&"):
        key, sep, value = item.partition("=")
        if sep and key.lower() in _QUERY_SECRETS and value:
            values.append(value)
    for value in values:
        found.update({value, urllib.parse.unquote(value), urllib.parse.unquote_plus(value)})
    return sorted((s for s in found if s), key=len, reverse=True)


def redact(text: str, urls: Sequence[str | None]) -> str:
    """Text with every URL of `urls` masked, and their passwords replaced wherever else they appear (a driver's
    message may quote one). The last guard before anything is printed."""
    for url in urls:
        if not url:
            continue
        text = text.replace(url, mask_url(url))
        for secret in secrets_of(url):
            if len(secret) >= _MIN_REDACTED:
                text = text.replace(secret, MASK)
    return text


def mask_argv(argv: Sequence[str]) -> list[str]:
    """A command line with the value of every --storage masked (`--storage URL` and `--storage=URL`)."""
    masked: list[str] = []
    after_flag = False
    for arg in argv:
        if after_flag:
            masked.append(mask_url(arg))
            after_flag = False
        elif arg.startswith("--storage="):
            masked.append("--storage=" + mask_url(arg[len("--storage="):]))
        else:
            masked.append(arg)
            after_flag = arg == "--storage"
    return masked
