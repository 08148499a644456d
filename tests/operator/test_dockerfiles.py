"""Static checks of the images (no container engine in CI) and of the torch-free operator package."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lopa_operator import security
from tools import lock

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", sorted(p.name for p in DOCKER.glob("*.Dockerfile")))
def test_dockerfile_copies_existing_paths_and_runs_a_known_entrypoint(name: str) -> None:
    steps = instructions(DOCKER / name)
    assert steps and steps[0][0] in ("FROM", "ARG")
    for keyword, rest in steps:
        if keyword == "COPY" and "--from=" not in rest:
            source = rest.split()[0]
            assert (REPO / source).exists(), f"{name}: COPY {source} does not exist"
    entry = next(rest for keyword, rest in steps if keyword == "ENTRYPOINT")
    program = entry.strip('[]"').split('"')[0]
    package = "operator" if name.startswith("operator") else "runtime"
    scripts = tomllib.loads((REPO / package / "pyproject.toml").read_text())["project"]["scripts"]
    assert program in scripts, f"{name}: ENTRYPOINT {program} is not a console script of {package}/"
    # Non-root, the user the operator runs the pods as (and the chart the operator).
    users = [rest for k, rest in steps if k == "USER"]
    assert users and users[-1] == f"{security.RUN_AS}:{security.RUN_AS}", f"{name} runs as {users or 'root'}"


def test_operator_image_and_package_have_no_torch() -> None:
    deps = tomllib.loads((REPO / "operator" / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any(d.lower().startswith("torch") for d in deps)
    installs = [
        rest for k, rest in instructions(DOCKER / "operator.Dockerfile") if k == "RUN" and "pip" in rest
    ]
    assert installs and not any("torch" in rest for rest in installs)
    code = "import sys, lopa_operator.handlers, lopa_operator.__main__; sys.exit('torch' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _build_args(steps: list[tuple[str, str]]) -> dict[str, str | None]:
    args: dict[str, str | None] = {}
    for keyword, rest in steps:
        if keyword == "ARG":
            name, sep, default = rest.partition("=")
            args[name] = default if sep else None
    return args


@pytest.mark.parametrize("name", sorted(p.name for p in DOCKER.glob("*.Dockerfile")))
def test_base_images_are_pinned_to_a_release(name: str) -> None:
    """A base image is an exact release (python:3.11.14-slim-bookworm), or a build argument with no
    moving default: a tag like 3.11-slim or latest would change under a rebuild."""
    steps = instructions(DOCKER / name)
    args = _build_args(steps)
    for keyword, rest in steps:
        if keyword != "FROM":
            continue
        image = rest.split()[0]
        argument = re.fullmatch(r"\$\{?(\w+)\}?", image)
        if argument:
            assert args.get(argument[1], "") is None, f"{name}: FROM {image} has a default"
        else:
            assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*", image), (
                f"{name}: FROM {image} is not a release"
            )


@pytest.mark.parametrize("name", sorted(p.name for p in DOCKER.glob("*.Dockerfile")))
def test_images_install_the_locked_versions(name: str) -> None:
    """Each package directory is installed with the lock's constraints, and the CPU image's torch
    (from the CPU index) is the lock's torch for the image's Python."""
    steps = instructions(DOCKER / name)
    installs = [
        rest for keyword, rest in steps if keyword == "RUN" and re.search(r"\./(runtime|operator)\b", rest)
    ]
    assert installs, f"{name} installs no package directory"
    for rest in installs:
        assert re.search(r"-c \S*constraints\.txt", rest), f"{name}: {rest!r} takes no constraints"
    torch_version = _build_args(steps).get("TORCH_VERSION")
    if name == "runtime-cpu.Dockerfile":
        python = re.search(r"python:(\d+\.\d+\.\d+)", next(r for k, r in steps if k == "FROM"))[1]
        environment = {
            **lock.probe(sys.executable)["environment"],
            "python_full_version": python,
            "python_version": python.rsplit(".", 1)[0],
        }
        assert torch_version == lock.pinned_for(lock.read_lock(), environment)["torch"]
