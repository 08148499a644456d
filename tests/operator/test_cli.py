"""The operator's command line refuses settings it cannot run with, naming the flag."""

from __future__ import annotations

import pytest

from lopa_operator.__main__ import parse


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "soon"])
def test_resync_seconds_must_be_positive_and_finite(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: accepted, and 0 made kopf's resync timer reconcile every object in a busy loop.
    with pytest.raises(SystemExit):
        parse([f"--resync-seconds={value}"])
    assert "argument --resync-seconds:" in capsys.readouterr().err


def test_resync_seconds_accepts_a_fraction() -> None:
    assert parse(["--resync-seconds=0.5"]).resync_seconds == 0.5


def test_version_names_the_operator_and_kopf(capsys: pytest.CaptureFixture[str]) -> None:
    import kopf

    import lopa_operator

    with pytest.raises(SystemExit) as exited:
        parse(["--version"])
    assert exited.value.code == 0
    expected = f"lopa-operator {lopa_operator.__version__} (kopf {kopf.__version__})"
    assert capsys.readouterr().out.strip() == expected
