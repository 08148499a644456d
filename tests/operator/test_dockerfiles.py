"""Static checks of the images (no container engine in CI) and of the torch-free operator package."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lopa_operator import security

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
