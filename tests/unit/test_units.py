import pytest

from autotune.errors import UsageError
from autotune.units import format_bytes, parse_duration, parse_size


def test_sizes():
    assert parse_size("40GiB") == 40 * 2**30
    assert parse_size("512 MB") == 512_000_000
    assert parse_size("1024") == 1024
    with pytest.raises(UsageError, match="40GiB"):
        parse_size("lots")


def test_durations():
    assert parse_duration("20m") == 1200
    assert parse_duration("1h30m") == 5400
    assert parse_duration("45") == 45
    with pytest.raises(UsageError, match="20m"):
        parse_duration("soon")


def test_format_bytes():
    assert format_bytes(5 * 2**20) == "5.0 MiB"
    assert format_bytes(12) == "12 B"
