"""Every way a new user can hold the CLI wrong ends in one line naming the flag or config key, not a
traceback: `lopa client`, `lopa serve`, `lopa master`, `lopa worker`, `lopa generate`, `lopa bench tpf`."""

from __future__ import annotations

from pathlib import Path

import pytest

from lopa.cli import main
from lopa.serving.launcher import LocalCluster, free_ports


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process a check that came too late fails the test instead of starting a server or a load."""
    import lopa.cli.bench
    import lopa.cli.generate
    import lopa.cli.master
    import lopa.serving.worker

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("started: the error should have come first")

    monkeypatch.setattr(lopa.cli.master, "_serve_until_signalled", started)
    monkeypatch.setattr(lopa.serving.worker, "serve_worker", started)
    monkeypatch.setattr(LocalCluster, "start", started)
    monkeypatch.setattr(lopa.cli.generate.LocalEngine, "from_dirs", started)
    monkeypatch.setattr(lopa.cli.bench.LocalEngine, "from_dirs", started)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """(exit code, stderr) of `lopa argv...` run in this process."""
    try:
        code = main(list(argv))
    except SystemExit as exited:
        code = exited.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def one_line(err: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.strip()


def closed_address() -> str:
    return f"127.0.0.1:{free_ports(1)[0]}"


# -- lopa client ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value"), [("--branches", "-1"), ("--seed", "-1"), ("--top-k", "-1"), ("--max-new-tokens", "-5")]
)
def test_client_generate_rejects_negative_counts_before_sending(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    address = closed_address()  # nothing listens: the request must not get as far as sending
    code, err = run_cli(capsys, "client", "generate", "--address", address, "--prompt", "x", flag, value)
    assert code == 2
    assert one_line(err) == f"lopa client: error: {flag}: must be >= 0, got {value}"


def test_client_info_reports_an_unreachable_master_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(capsys, "client", "info", "--address", closed_address())
    assert code == 1 and one_line(err).startswith("lopa client: error: UNAVAILABLE: ")


def test_client_info_has_the_tls_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = run_cli(capsys, "client", "info", "--ca", str(tmp_path / "missing.pem"))
    assert code == 2
    assert one_line(err) == f"lopa client: error: --ca: no such file: {tmp_path / 'missing.pem'}"
    (tmp_path / "client.pem").write_text("")
    code, err = run_cli(capsys, "client", "info", "--cert", str(tmp_path / "client.pem"))
    assert code == 2 and one_line(err) == "lopa client: error: --key: --cert and --key go together"


def test_client_generate_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["client", "generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    for flag, help_text in [
        ("--address ADDRESS", "the master's client API, HOST:PORT (default: 127.0.0.1:50051)"),
        ("--prompt PROMPT", "prompt text"),
        ("--chat", "apply the model's chat template"),
        ("--stop STOP", "stop sequence (repeatable)"),
        ("--max-new-tokens MAX_NEW_TOKENS", "generation budget (default: the server's"),
        ("--json", "print one JSON object"),
        ("--ca CA", "CA bundle"),
    ]:
        assert f"{flag} {help_text}" in text, flag
    assert "decoding overrides (default: the server's" in text
