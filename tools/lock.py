"""The lock of what `make install` puts into .venv: read it, derive the images' constraints, check a venv.

`requirements/lock.txt` pins every package of the development environment (runtime, operator, the
dev extra, pip and uv) to one version and its file hashes, for Python 3.10 and up: where a newer
release dropped a Python version, the lock carries one line per range of Python versions
(`; python_full_version < '3.11'`). `make lock` writes it with uv and derives the two files beside
it; `make install` installs uv from `uv.txt` with pip, the lock with uv, both checking every
file's hash, then runs `check`.

    python tools/lock.py check [--python PYTHON]   # the venv holds exactly the lock (exit 1: drift)
    python tools/lock.py constraints               # constraints.txt: the lock without hashes
    python tools/lock.py bootstrap                 # uv.txt: the lock's uv, with its hashes

The check runs a standard-library snippet in the target interpreter, so any venv can be checked,
even one without `packaging`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "lock.txt"
CONSTRAINTS = REPO / "requirements" / "constraints.txt"
BOOTSTRAP = REPO / "requirements" / "uv.txt"
# Installed from the working tree (editable), not from the index.
LOCAL_PACKAGES = frozenset({"lopa", "lopa-operator"})

# Prints the interpreter's marker environment (PEP 508) and its installed distributions as JSON.
_PROBE = """
import importlib.metadata as md, json, os, platform, sys
info = sys.implementation.version
version = f"{info.major}.{info.minor}.{info.micro}"
if info.releaselevel != "final":
    version += info.releaselevel[0] + str(info.serial)
environment = {
    "implementation_name": sys.implementation.name,
    "implementation_version": version,
    "os_name": os.name,
    "platform_machine": platform.machine(),
    "platform_release": platform.release(),
    "platform_system": platform.system(),
    "platform_version": platform.version(),
    "python_full_version": platform.python_version(),
    "platform_python_implementation": platform.python_implementation(),
    "python_version": ".".join(platform.python_version_tuple()[:2]),
    "sys_platform": sys.platform,
}
distributions = {}
for dist in md.distributions():
    name = dist.metadata["Name"]
    if name:
        distributions[name] = dist.version
print(json.dumps({"environment": environment, "distributions": distributions}))
"""


@dataclass(frozen=True)
class Pin:
    """One line of the lock: a package at one version, for the interpreters its marker selects."""

    name: str
    version: str
    marker: str | None
    hashes: tuple[str, ...]

    def applies_to(self, environment: dict[str, str]) -> bool:
        return self.marker is None or Marker(self.marker).evaluate(environment)

    def constraint(self) -> str:
        line = f"{self.name}=={self.version}"
        return f"{line} ; {self.marker}" if self.marker else line

    def requirement(self) -> str:
        """The pin as a hash-checked requirement line."""
        return " \\\n    ".join([self.constraint(), *(f"--hash={h}" for h in self.hashes)]) + "\n"


def read_lock(path: Path = LOCK) -> list[Pin]:
    """The pins of a lock in pip's requirements format (`name==version ; marker` + `--hash` lines)."""
    entries: list[list[str]] = []
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        if raw[:1].isspace() and entries:
            entries[-1].append(line.rstrip("\\").strip())
        else:
            entries.append([line.rstrip("\\").strip()])
    pins = []
    for first, *options in entries:
        requirement = Requirement(first)
        specifiers = list(requirement.specifier)
        if len(specifiers) != 1 or specifiers[0].operator != "==":
            raise ValueError(f"{path}: {first!r} is not pinned to one version (name==version)")
        hashes = tuple(option.removeprefix("--hash=") for option in options if option.startswith("--hash="))
        if not hashes:
            raise ValueError(f"{path}: {requirement.name} has no --hash (uv pip compile --generate-hashes)")
        marker = str(requirement.marker) if requirement.marker else None
        pins.append(Pin(canonicalize_name(requirement.name), specifiers[0].version, marker, hashes))
    return pins


def pinned_for(pins: list[Pin], environment: dict[str, str]) -> dict[str, str]:
    """The version the lock gives each package on an interpreter with this marker environment."""
    chosen: dict[str, str] = {}
    for pin in pins:
        if pin.applies_to(environment):
            if pin.name in chosen:
                raise ValueError(f"the lock pins {pin.name} twice for {environment['python_full_version']}")
            chosen[pin.name] = pin.version
    return chosen


def drift(pinned: dict[str, str], installed: dict[str, str]) -> list[str]:
    """What differs between a venv's distributions and the lock's pins for it, one line each."""
    installed = {canonicalize_name(name): version for name, version in installed.items()}
    problems = []
    for name, version in sorted(pinned.items()):
        if name not in installed:
            problems.append(f"{name}: missing (the lock pins {version})")
        elif installed[name] != version:
            problems.append(f"{name}: {installed[name]} installed, the lock pins {version}")
    for name in sorted(set(installed) - set(pinned) - LOCAL_PACKAGES):
        problems.append(f"{name}: {installed[name]} installed, not in the lock")
    return problems


def probe(python: str) -> dict:
    """The marker environment and the installed distributions of an interpreter."""
    result = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"{python} could not list its distributions: {result.stderr.strip()}")
    return json.loads(result.stdout)


def check(python: str = sys.executable, lock: Path = LOCK) -> list[str]:
    """Every difference between the interpreter's venv and the lock (empty: they are equal)."""
    state = probe(python)
    problems = drift(pinned_for(read_lock(lock), state["environment"]), state["distributions"])
    unmet = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    if unmet.returncode != 0:
        problems += [f"pip check: {line}" for line in unmet.stdout.splitlines() if line.strip()]
    return problems


def constraints_text(pins: list[Pin]) -> str:
    header = (
        "# The versions of requirements/lock.txt without their hashes, for `pip install -c` where a\n"
        "# hash cannot apply (the images install ./runtime and ./operator from a directory).\n"
        "# Written by `make lock` (python tools/lock.py constraints); do not edit.\n"
    )
    return header + "".join(f"{pin.constraint()}\n" for pin in pins)


def bootstrap_text(pins: list[Pin]) -> str:
    header = (
        "# The lock's uv with its hashes: `make install` installs it with pip (hash-checking mode),\n"
        "# then installs requirements/lock.txt with it. Written by `make lock`; do not edit.\n"
    )
    return header + "".join(pin.requirement() for pin in pins if pin.name == "uv")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/lock.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check_parser = commands.add_parser("check", help="exit 1 unless the venv holds exactly the lock")
    check_parser.add_argument("--python", default=sys.executable, help="the venv's interpreter")
    commands.add_parser("constraints", help="print the lock's versions as a constraints file")
    commands.add_parser("bootstrap", help="print the lock's uv pin with its hashes")
    args = parser.parse_args(argv)
    if args.command in ("constraints", "bootstrap"):
        text = constraints_text if args.command == "constraints" else bootstrap_text
        sys.stdout.write(text(read_lock()))
        return 0
    problems = check(args.python)
    if problems:
        print(f"{args.python} differs from {LOCK.relative_to(REPO)}:", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        print(
            "`make install` rebuilds .venv from the lock; `make lock` refreshes the lock "
            "after a change of the pyproject files (CONTRIBUTING.md).",
            file=sys.stderr,
        )
        return 1
    print(f"{args.python}: every package as {LOCK.relative_to(REPO)} pins it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
