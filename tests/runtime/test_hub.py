"""lopa.hub and `lopa fetch-model`: the bundled model fetched from a Hub mirror on a local port
(tests/kube/hf_mirror.py: the Hub's API as huggingface_hub calls it), kept across starts, and every
failure named."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lopa import hub
from lopa.bundled import bundled_model_dir
from tests.kube.hf_mirror import HubMirror

REPO = "lopa-dev/bundled"


@pytest.fixture
def mirror(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubMirror]:
    with HubMirror() as served:
        served.add(REPO, bundled_model_dir(), revisions=("main", "v1"))
        monkeypatch.setenv("HF_ENDPOINT", served.url)  # for `lopa fetch-model` in a subprocess
        yield served


def fetch(mirror: HubMirror, uri: str, into: Path) -> hub.Fetched:
    """In this process huggingface_hub was imported before HF_ENDPOINT was set: the mirror is named."""
    return hub.fetch(uri, into, mirror.url)


def same_files(fetched: Path, source: Path) -> bool:
    names = {p.name for p in source.iterdir()}
    return all((fetched / n).read_bytes() == (source / n).read_bytes() for n in names)


def test_a_branch_is_downloaded_once_then_found_in_the_cache(mirror: HubMirror, tmp_path: Path) -> None:
    into = tmp_path / "hf" / REPO / "v1"
    done = fetch(mirror, f"hf://{REPO}@v1", into)
    assert done.downloaded and done.commit == mirror.repos[REPO].commit
    assert same_files(into, bundled_model_dir())
    assert hub.held_commit(into) == done.commit
    mirror.requests.clear()
    again = fetch(mirror, f"hf://{REPO}@v1", into)
    assert not again.downloaded and again.commit == done.commit
    # A branch may move: one API call resolves it, no file is fetched.
    assert mirror.requests == [f"GET /api/models/{REPO}/revision/v1"]


def test_a_pinned_commit_in_the_cache_needs_no_network(mirror: HubMirror, tmp_path: Path) -> None:
    commit = mirror.repos[REPO].commit
    into = tmp_path / "pinned"
    assert fetch(mirror, f"hf://{REPO}@{commit}", into).downloaded
    mirror.requests.clear()
    mirror.stop()  # the endpoint is gone: the cache is enough
    assert not fetch(mirror, f"hf://{REPO}@{commit}", into).downloaded
    mirror.start()  # (the fixture stops it again)


def test_the_default_revision_is_main(mirror: HubMirror, tmp_path: Path) -> None:
    assert hub.parse(f"hf://{REPO}") == hub.HubModel(REPO, "main")
    assert fetch(mirror, f"hf://{REPO}", tmp_path / "main").downloaded
    assert any(r.startswith(f"GET /api/models/{REPO}/revision/main") for r in mirror.requests)


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        (f"hf://{REPO}@v9", "revision 'v9' not found in lopa-dev/bundled at http://"),
        ("hf://lopa-dev/missing", "repository lopa-dev/missing not found at http://"),
        ("hf://bundled", "Repository id must be 'namespace/name'"),
        (f"hf://{REPO}/config.json", "names a path inside the repository ('config.json')"),
        ("hf://datasets/lopa-dev/data", "a dataset repository, not a model"),
    ],
)
def test_failures_name_the_uri_and_the_cause(
    mirror: HubMirror, tmp_path: Path, uri: str, expected: str
) -> None:
    with pytest.raises(hub.FetchError) as caught:
        fetch(mirror, uri, tmp_path / "x")
    assert expected in str(caught.value) and uri.split("@")[0].split("/config")[0] in str(caught.value)
    assert hub.held_commit(tmp_path / "x") is None


def test_a_token_the_mirror_refuses_is_named(mirror: HubMirror, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    mirror.token = "right"
    monkeypatch.setenv("HF_TOKEN", "wrong")
    with pytest.raises(hub.FetchError, match=r"not found at .* HF_TOKEN set"):
        fetch(mirror, f"hf://{REPO}@v1", tmp_path / "x")
    monkeypatch.setenv("HF_TOKEN", "right")
    assert fetch(mirror, f"hf://{REPO}@v1", tmp_path / "x").downloaded


def test_an_unreachable_endpoint_is_named(mirror: HubMirror, tmp_path: Path) -> None:
    url = mirror.url
    mirror.stop()
    with pytest.raises(hub.FetchError, match=f"{url} could not be reached"):
        fetch(mirror, f"hf://{REPO}@v1", tmp_path / "x")
    mirror.start()


def test_the_cli_prints_what_it_did_and_fails_with_the_reason(mirror: HubMirror, tmp_path: Path) -> None:
    def cli(uri: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "lopa", "fetch-model", uri, "--into", str(tmp_path / "m")]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)

    first, second = cli(f"hf://{REPO}@v1"), cli(f"hf://{REPO}@v1")
    assert first.returncode == 0 and "downloaded" in first.stdout, first.stderr
    assert second.returncode == 0 and "already held in the cache; no download" in second.stdout
    failed = cli(f"hf://{REPO}@v9")
    assert failed.returncode == 1
    # The last line is the error: what a pod's termination message (FallbackToLogsOnError) carries.
    assert failed.stderr.strip().splitlines()[-1] == (
        f"lopa fetch-model: error: hf://{REPO}@v9: revision 'v9' not found in {REPO} at {mirror.url}")
