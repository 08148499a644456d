"""The venv is the lock: requirements/lock.txt decides every installed version, whatever the index serves."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tools import lock

REQUIRED = (
    "torch",
    "transformers",
    "grpcio",
    "grpcio-tools",
    "kopf",
    "pytest",
    "mkdocs-material",
    "pip",
    "uv",
)


def _environment(python_full_version: str) -> dict[str, str]:
    environment = lock.probe(sys.executable)["environment"]
    major_minor = ".".join(python_full_version.split(".")[:2])
    return {**environment, "python_full_version": python_full_version, "python_version": major_minor}


def _fake_wheel(directory: Path, name: str, version: str) -> Path:
    """A pure-Python wheel of `name` at `version` whose files are not the published ones."""
    stem = f"{name.replace('-', '_')}-{version}"
    path = directory / f"{stem}-py3-none-any.whl"
    files = {
        f"{stem}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{stem}.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for file, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{file},sha256={digest},{len(text.encode())}")
    record.append(f"{stem}.dist-info/RECORD,,")
    with zipfile.ZipFile(path, "w") as wheel:
        for file, text in files.items():
            wheel.writestr(file, text)
        wheel.writestr(f"{stem}.dist-info/RECORD", "\n".join(record) + "\n")
    return path


@pytest.fixture(scope="module")
def scratch_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv beside the test's own, with pip and nothing of the lock."""
    root = tmp_path_factory.mktemp("scratch") / "venv"
    venv.EnvBuilder(with_pip=True).create(root)
    return root / "bin" / "python"


def test_the_venv_holds_exactly_the_lock() -> None:
    assert lock.check(sys.executable) == []


def test_the_lock_pins_every_package_once_for_each_supported_python() -> None:
    pins = lock.read_lock()
    for python in ("3.10.13", "3.11.7", "3.12.1"):
        pinned = lock.pinned_for(pins, _environment(python))
        assert set(REQUIRED) <= set(pinned), f"{python}: {set(REQUIRED) - set(pinned)} not pinned"
    assert all(pin.hashes and all(h.startswith("sha256:") for h in pin.hashes) for pin in pins)


def test_the_constraints_file_is_the_lock_without_hashes() -> None:
    assert lock.CONSTRAINTS.read_text() == lock.constraints_text(lock.read_lock()), (
        "requirements/constraints.txt is stale: run `make lock`"
    )


def test_drift_names_each_package_and_both_versions() -> None:
    problems = lock.drift(
        {"grpcio-tools": "1.85.4", "torch": "2.15.0"},
        {"grpcio_tools": "1.99.0", "Lopa": "0.1.0", "six": "1.17.0"},
    )
    assert problems == [
        "grpcio-tools: 1.99.0 installed, the lock pins 1.85.4",
        "torch: missing (the lock pins 2.15.0)",
        "six: 1.17.0 installed, not in the lock",
    ]


def test_a_venv_with_a_newer_grpcio_tools_is_refused(scratch_venv: Path, tmp_path: Path) -> None:
    newer = _fake_wheel(tmp_path, "grpcio-tools", "1.99.0")
    subprocess.run(
        [scratch_venv, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", newer],
        check=True,
        timeout=120,
    )
    result = subprocess.run(
        [sys.executable, lock.__file__, "check", "--python", scratch_venv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    pinned = lock.pinned_for(lock.read_lock(), lock.probe(str(scratch_venv))["environment"])
    assert result.returncode == 1
    assert f"grpcio-tools: 1.99.0 installed, the lock pins {pinned['grpcio-tools']}" in result.stderr
    assert f"torch: missing (the lock pins {pinned['torch']})" in result.stderr
    assert "`make install` rebuilds .venv from the lock" in result.stderr


def test_an_index_serving_other_files_changes_nothing_installed(scratch_venv: Path, tmp_path: Path) -> None:
    """The installers of `make install` take the locked version's locked file or nothing: uv for the
    lock, pip for uv itself."""
    pinned = lock.pinned_for(lock.read_lock(), lock.probe(str(scratch_venv))["environment"])
    pin = next(p for p in lock.read_lock() if p.name == "iniconfig" and p.version == pinned["iniconfig"])
    index = tmp_path / "index"
    index.mkdir()
    _fake_wheel(index, "iniconfig", "99.0")  # a newer release
    _fake_wheel(index, "iniconfig", pin.version)  # the locked version, other bytes
    requirements = tmp_path / "lock.txt"
    requirements.write_text(pin.requirement())
    offline = ["--no-index", "--find-links", index, "--require-hashes", "--no-deps", "-r", requirements]
    uv = Path(sys.executable).parent / "uv"
    by_uv = subprocess.run(
        [uv, "pip", "install", "--python", scratch_venv, *offline],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert by_uv.returncode != 0 and "Hash mismatch" in by_uv.stderr, by_uv.stderr
    by_pip = subprocess.run(
        [scratch_venv, "-m", "pip", "install", *offline], capture_output=True, text=True, timeout=120
    )
    assert by_pip.returncode != 0 and "DO NOT MATCH THE HASHES" in by_pip.stderr, by_pip.stderr
    listed = subprocess.run(
        [scratch_venv, "-m", "pip", "list", "--format", "freeze"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "iniconfig" not in listed.lower()


def test_the_bootstrap_file_is_the_locks_uv() -> None:
    assert lock.BOOTSTRAP.read_text() == lock.bootstrap_text(lock.read_lock()), (
        "requirements/uv.txt is stale: run `make lock`"
    )
    assert "uv==" in lock.BOOTSTRAP.read_text() and "--hash=sha256:" in lock.BOOTSTRAP.read_text()
