"""Speculation modes and the alternating order of runs (loadtest/modes.py)."""

import pytest

from loadtest.modes import AB, interleaved, ordered, parse_modes, spec_option


def test_spec_option_of_each_mode():
    assert spec_option("default") is None and spec_option("on") is None
    assert spec_option("off") == {"enabled": False}
    assert spec_option("k4") == {"k": 4}
    for bad in ("adaptive", "k", "kx", "4"):
        with pytest.raises(ValueError, match="unknown mode"):
            spec_option(bad)


def test_parse_modes_checks_every_name():
    assert parse_modes(AB) == ["on", "off"]
    assert parse_modes("default,k2,off") == ["default", "k2", "off"]
    with pytest.raises(ValueError):
        parse_modes("on,sometimes")


def test_interleaved_order_alternates():
    assert ordered(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert interleaved(["a", "b"], 3) == [
        (0, "a"),
        (0, "b"),
        (1, "b"),
        (1, "a"),
        (2, "a"),
        (2, "b"),
    ]
    assert interleaved(["a"], 2) == [(0, "a"), (1, "a")]
