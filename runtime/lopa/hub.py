"""A checkpoint named by a Hugging Face URI (`hf://org/name[@revision]`), downloaded into a directory.

`fetch(uri, into)` is what a pod's init container runs (`lopa fetch-model`): it resolves the revision
to its commit, downloads that commit's files into `into` with huggingface_hub (HF_ENDPOINT picks a
mirror, HF_TOKEN authenticates) and then records the commit in `into/.lopa-revision`. A directory that
already records the commit is left as it is: a URI pinned to a commit needs no network at all then,
and a branch or tag costs one API call. Pods of a group that share a cache volume take turns on a
file lock beside the directory, so the first downloads and the others find the files.

Every failure is a FetchError whose message names the URI and what went wrong (no such repository,
no such revision, refused token, unreachable endpoint, a file that did not arrive whole).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MARKER = ".lopa-revision"
DEFAULT_REVISION = "main"  # huggingface_hub's default branch name
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class FetchError(RuntimeError):
    """A checkpoint that could not be fetched; the message says which and why."""


@dataclass(frozen=True)
class Fetched:
    path: Path
    commit: str
    downloaded: bool  # False: the directory already held the commit


@dataclass(frozen=True)
class HubModel:
    repo: str  # org/name
    revision: str  # a branch, tag or commit ("main" when the URI names none)

    @property
    def pinned(self) -> bool:
        """The revision is a commit: what the directory holds can be checked without the network."""
        return bool(_COMMIT.match(self.revision))


def parse(uri: str) -> HubModel:
    """`hf://org/name[@revision]` (huggingface_hub's own URI grammar); FetchError for anything else."""
    from huggingface_hub import parse_hf_uri
    from huggingface_hub.errors import HfUriError

    try:
        parsed = parse_hf_uri(uri)
    except HfUriError as error:
        raise FetchError(str(error)) from None
    if parsed.type != "model":
        raise FetchError(f"{uri}: a {parsed.type} repository, not a model")
    if parsed.path_in_repo:
        raise FetchError(f"{uri}: names a path inside the repository ({parsed.path_in_repo!r}); "
                         "give the repository, hf://org/name[@revision]")
    return HubModel(parsed.id, parsed.revision or DEFAULT_REVISION)


def held_commit(into: Path) -> str | None:
    """The commit a previous fetch completed into `into`, if any."""
    try:
        return (into / MARKER).read_text().strip() or None
    except OSError:
        return None


def endpoint(given: str | None = None) -> str:
    """The Hub's address: `given`, else huggingface_hub's (HF_ENDPOINT, else huggingface.co)."""
    from huggingface_hub import constants

    return given or constants.ENDPOINT


def fetch(uri: str, into: Path, hub_endpoint: str | None = None) -> Fetched:
    """Makes `into` hold the files of `uri`'s revision; see the module's docstring. `hub_endpoint`
    overrides HF_ENDPOINT."""
    from filelock import FileLock

    model = parse(uri)
    into.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(into) + ".lock"):
        held = held_commit(into)
        if model.pinned and held == model.revision:
            return Fetched(into, held, downloaded=False)
        where = endpoint(hub_endpoint)
        commit = _resolve(uri, model, where)
        if held == commit:
            return Fetched(into, commit, downloaded=False)
        _download(uri, model.repo, commit, into, where)
        marker = into / (MARKER + ".tmp")
        marker.write_text(commit + "\n")
        marker.replace(into / MARKER)
        return Fetched(into, commit, downloaded=True)


def _resolve(uri: str, model: HubModel, where: str) -> str:
    from huggingface_hub import HfApi

    with _hub_errors(uri, model, where):
        info = HfApi(endpoint=where).model_info(model.repo, revision=model.revision)
    if not info.sha:
        raise FetchError(f"{uri}: {where} named no commit for revision {model.revision!r}")
    return info.sha


def _download(uri: str, repo: str, commit: str, into: Path, where: str) -> None:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.hf_api import RepoFile

    model = HubModel(repo, commit)
    with _hub_errors(uri, model, where):
        tree = HfApi(endpoint=where).list_repo_tree(repo, recursive=True, revision=commit)
        files = {f.path: f.size for f in tree if isinstance(f, RepoFile)}
        snapshot_download(repo, revision=commit, local_dir=into, endpoint=where)
    # snapshot_download falls back on whatever the directory holds when the endpoint stops answering
    # halfway: the commit is recorded only once every file of its tree is there, whole.
    short = [name for name, size in sorted(files.items())
             if not (into / name).is_file() or (into / name).stat().st_size != size]
    if short:
        raise FetchError(f"{uri}: {len(short)} file(s) of commit {commit} did not arrive whole from "
                         f"{where}: {', '.join(short[:5])}")


@contextlib.contextmanager
def _hub_errors(uri: str, model: HubModel, where: str) -> Iterator[None]:
    """Turns huggingface_hub's exceptions into a FetchError naming the URI, the endpoint and the cause."""
    from httpx2 import TransportError
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    token = "HF_TOKEN set" if os.environ.get("HF_TOKEN") else "no HF_TOKEN"
    try:
        yield
    except GatedRepoError:
        message = f"repository {model.repo} is gated at {where}; its token ({token}) is not granted access"
    except RepositoryNotFoundError:
        message = f"repository {model.repo} not found at {where} (or private and not visible: {token})"
    except RevisionNotFoundError:
        message = f"revision {model.revision!r} not found in {model.repo} at {where}"
    except HfHubHTTPError as error:
        message = f"{where} answered: {_first_line(error)}"
    except (TransportError, LocalEntryNotFoundError) as error:
        message = f"{where} could not be reached: {_first_line(error)}"
    except OSError as error:  # the directory: no space left, not writable, ...
        message = f"{type(error).__name__}: {error}"
    else:
        return
    raise FetchError(f"{uri}: {message}")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
