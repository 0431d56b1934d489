"""common/units.py: the one reading of "500ms", "2GiB" and "10/s" (cards, bench flags and SLOs, the engine)."""

import argparse

import pytest

from inferlab.common.units import UnitError, format_ms, parse_bytes, parse_duration, parse_rate


def test_sizes_and_the_engine_flags_bare_byte_count():
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("512 mib") == 512 * 2**20
    assert parse_bytes("1073741824", "--kv-cache-memory", bare="B") == 2**30
    with pytest.raises(UnitError, match="--kv-cache-memory: '1073741824' has no unit"):
        parse_bytes("1073741824", "--kv-cache-memory")
    with pytest.raises(UnitError, match="cannot read '2m' as a size"):  # MB or MiB? refused
        parse_bytes("2m")


def test_durations_minutes_and_bare_numbers():
    assert parse_duration("2m") == parse_duration("2min") == 120
    assert parse_duration("500ms") == 0.5 and parse_duration("50us") == pytest.approx(5e-5)
    assert parse_duration("600", "--timeout", bare="s") == 600
    for bare in ("500", 500, 0.5):
        with pytest.raises(UnitError, match="has no unit"):
            parse_duration(bare)
    with pytest.raises(UnitError, match="unknown time unit 'sec'"):
        parse_duration("5sec")
    assert parse_rate("600/min") == 10


def test_a_unit_error_is_an_argparse_type_error_so_flags_show_its_message(capsys):
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--kv", type=lambda t: parse_bytes(t, "--kv", bare="B"))
    assert p.parse_args(["--kv", "2GiB"]).kv == 2 * 2**30
    with pytest.raises(SystemExit):
        p.parse_args(["--kv", "2 lots"])
    assert "cannot read '2 lots' as a size" in capsys.readouterr().err


def test_format_ms():
    assert [format_ms(s) for s in (0.0051234, 0.05123, 0.5123, 5.123)] == [
        "5.123 ms", "51.23 ms", "512.3 ms", "5123 ms"]
    assert format_ms(0.6) == "600.0 ms" and format_ms(0.6, unit=False) == "600.0" and format_ms(None) == "–"
