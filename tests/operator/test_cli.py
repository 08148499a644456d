"""The operator's command line refuses settings it cannot run with, naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from lopa_operator.__main__ import parse, scope


@pytest.mark.parametrize("flag", ["--resync-seconds", "--retry-refused-seconds"])
@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "soon"])
def test_the_seconds_flags_must_be_positive_and_finite(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # 0 would make kopf's resync timer (or the refused rendering's retry) run in a busy loop.
    with pytest.raises(SystemExit):
        parse([f"{flag}={value}"])
    assert f"argument {flag}:" in capsys.readouterr().err


def test_the_seconds_flags_accept_a_fraction_and_default_to_the_environment() -> None:
    args = parse(["--resync-seconds=0.5", "--retry-refused-seconds=2.5"])
    assert (args.resync_seconds, args.retry_refused_seconds) == (0.5, 2.5)
    assert parse([]).retry_refused_seconds is None  # LOPA_OPERATOR_RETRY_REFUSED_SECONDS, else 60


def test_settings_come_from_the_environment_and_the_flags_win() -> None:
    """Each setting's one environment override, read in lopa_operator.settings only; a flag given
    on the command line wins; a malformed override names its variable."""
    from lopa_operator.settings import ENV, Settings, from_environment

    assert from_environment({}) == Settings()
    environ = {ENV["resync_s"]: "2.5", ENV["metrics_port"]: "9100", ENV["workers"]: "3"}
    chosen = from_environment(environ)
    assert (chosen.resync_s, chosen.metrics_port, chosen.workers) == (2.5, 9100, 3)
    assert chosen.retry_refused_s == Settings().retry_refused_s
    args = parse(["--resync-seconds=0.5", "--metrics-port=0"])
    flagged = chosen.with_flags(resync_s=args.resync_seconds, metrics_port=args.metrics_port,
                                retry_refused_s=args.retry_refused_seconds)
    assert (flagged.resync_s, flagged.metrics_port, flagged.retry_refused_s) == (0.5, 0, 60.0)
    with pytest.raises(ValueError, match="LOPA_OPERATOR_WORKERS: not a number: 'many'"):
        from_environment({ENV["workers"]: "many"})


def test_version_names_the_operator_and_kopf(capsys: pytest.CaptureFixture[str]) -> None:
    import kopf

    import lopa_operator

    with pytest.raises(SystemExit) as exited:
        parse(["--version"])
    assert exited.value.code == 0
    expected = f"lopa-operator {lopa_operator.__version__} (kopf {kopf.__version__})"
    assert capsys.readouterr().out.strip() == expected


def test_the_watch_scope_is_the_named_namespaces_or_all_or_the_operators_own(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    named = parse(["-n", "team-a", "--namespace=team-b", "-n", "team-a"])
    assert scope(named, missing) == ["team-a", "team-b"]
    assert scope(parse(["--all-namespaces"]), missing) == []  # [] = every namespace (kopf clusterwide)
    own = tmp_path / "namespace"
    own.write_text("lopa-system\n")  # what a pod's ServiceAccount mount holds
    assert scope(parse([]), own) == ["lopa-system"]


def test_no_scope_outside_a_pod_is_refused_naming_the_flags(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"--namespace.*--all-namespaces"):
        scope(parse([]), tmp_path / "missing")
    with pytest.raises(SystemExit, match="exclude each other"):
        scope(parse(["-A", "-n", "team-a"]), tmp_path / "missing")


@pytest.mark.parametrize("value", ["team-*", "!kube-system", "a,b", "Team_A"])
def test_namespace_patterns_are_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The operator neither lists nor watches namespaces (no such right): kopf would take a pattern
    # for an exact name and silently watch nothing.
    with pytest.raises(SystemExit):
        parse(["--namespace", value])
    assert "argument -n/--namespace:" in capsys.readouterr().err
