"""The snippets of docs/getting-started/local.md and docs/guides/coming-from-vllm.md, run as a reader
runs them: the page's `lopa serve` group of the bundled model (2 workers, gRPC and HTTP), then each
marked command against it, whose output must be what the page shows (`...` standing for timings)."""

from __future__ import annotations

import doctest
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lopa.serving.ports import free_ports
from tools.docs import snippets

REPO = Path(__file__).resolve().parents[2]
PAGES = {  # each page and the snippets it must have
    "local": (REPO / "docs" / "getting-started" / "local.md", {"grpc", "http", "openai"}),
    "vllm": (REPO / "docs" / "guides" / "coming-from-vllm.md", {"unauthorized", "openai", "tokenize"}),
}
PAGE_PORTS = (50051, 8000)  # the gRPC and HTTP ports the pages' commands name
START_TIMEOUT_S = 300.0
COMMAND_TIMEOUT_S = 120.0


class Ports:
    """The page's ports mapped to free ones, both ways (the machine may be using the page's)."""

    def __init__(self) -> None:
        self.free = dict(zip(PAGE_PORTS, free_ports(len(PAGE_PORTS)), strict=True))

    def to_free(self, text: str) -> str:
        for page, free in self.free.items():
            text = re.sub(rf"\b{page}\b", str(free), text)
        return text

    def to_page(self, text: str) -> str:
        for page, free in self.free.items():
            text = re.sub(rf"\b{free}\b", str(page), text)
        return text


def shell_env() -> dict[str, str]:
    """The reader's shell after `source .venv/bin/activate`: this Python's bin first on PATH."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


@pytest.fixture(scope="module", params=sorted(PAGES))
def page(request: pytest.FixtureRequest) -> tuple[str, snippets.Snippets]:
    path, names = PAGES[request.param]
    found = snippets.parse(path)
    assert found.server and names <= set(found.runs), found
    for command in (found.server, *found.runs.values()):
        assert any(str(port) in command for port in PAGE_PORTS), f"no page port in {command!r}"
    return request.param, found


def server_command(command: str) -> str:
    """A page's server command with its gRPC port named (vLLM's page leaves --listen at its default,
    50051: named here, it is moved to a free port like every port of the page)."""
    return command if "--listen" in command else f"{command} --listen 127.0.0.1:{PAGE_PORTS[0]}"


@pytest.fixture(scope="module")
def served(page: tuple[str, snippets.Snippets], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ports]:
    """The page's server command, on free ports, until SERVING; stopped with Ctrl-C (SIGINT) after."""
    ports = Ports()
    logs = tmp_path_factory.mktemp("local-page")
    out, err = logs / "serve.out", logs / "serve.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        command = ports.to_free(server_command(page[1].server))
        server = subprocess.Popen(["bash", "-c", f"exec {command}"], stdout=stdout,
                                  stderr=stderr, env=shell_env(), cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "lopa: serving on" not in out.read_text():
            log = err.read_text()[-3000:]
            assert server.poll() is None, f"lopa serve exited {server.returncode}: {log}"
            assert time.monotonic() < deadline, f"not serving after {START_TIMEOUT_S} s: {log}"
            time.sleep(0.2)
        yield ports
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_every_command_of_the_page_prints_what_the_page_shows(
    page: tuple[str, snippets.Snippets], served: Ports
) -> None:
    key, found = page
    for name, command in found.runs.items():
        done = subprocess.run(["bash", "-c", f"set -o pipefail\n{served.to_free(command)}"],
                              capture_output=True, text=True, env=shell_env(), cwd=REPO,
                              timeout=COMMAND_TIMEOUT_S)
        assert done.returncode == 0, f"{name}: exit {done.returncode}: {done.stderr[-3000:]}"
        got = served.to_page(done.stdout + done.stderr)
        want = found.outputs[name]
        checker = doctest.OutputChecker()
        assert checker.check_output(want, got, doctest.ELLIPSIS), (
            f"{PAGES[key][0].relative_to(REPO)}, snippet {name}: the page shows\n{want}\nthe command "
            f"printed\n{got}"
        )


def test_a_marker_without_a_block_is_refused(tmp_path: Path) -> None:
    broken = tmp_path / "page.md"
    broken.write_text("<!-- snippet:run lonely -->\nno fenced block here\n")
    with pytest.raises(snippets.SnippetError, match="not followed by a fenced block"):
        snippets.parse(broken)
    broken.write_text("<!-- snippet:run a -->\n```bash\ntrue\n```\n")
    with pytest.raises(snippets.SnippetError, match="outputs"):
        snippets.parse(broken)
