"""Where a group's pods find the checkpoint and the adapter: spec.model.uri and spec.model.adapterUri.

  hf://org/name[@revision]  an init container (`lopa fetch-model`) downloads the revision into the
                            cache volume before the master or a worker starts; the cache is
                            spec.model.cache.claimName (a PVC every pod mounts, kept across restarts:
                            a revision already there is not downloaded again) or else an emptyDir of
                            each pod. spec.model.huggingFace names a mirror (HF_ENDPOINT) and the
                            Secret holding HF_TOKEN (read by the kubelet, never by the operator).
  pvc://claim/path          the claim mounted read-only; the checkpoint is `path` inside it
  /an/absolute/path         a directory the image (or a volume of spec's own) already holds

Without a URI the older fields apply as they are: spec.model.path, spec.model.adapter and
spec.model.pvc. The runtime containers mount everything read-only; the files land under /mnt/models
(KServe's convention): /mnt/models/hf/<org>/<name>/<revision> and /mnt/models/pvc/<claim>/<path>.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from . import security

MODELS_DIR = "/mnt/models"
HF_DIR = f"{MODELS_DIR}/hf"
PVC_DIR = f"{MODELS_DIR}/pvc"
CACHE_VOLUME = "model-cache"
DEFAULT_REVISION = "main"  # what huggingface_hub fetches when a URI names no revision
TOKEN_KEY = "HF_TOKEN"


@dataclass(frozen=True)
class Source:
    """One URI: where its files are in the containers, and how they get there."""

    uri: str
    path: str  # the directory the runtime reads
    claim: str = ""  # pvc://: the claim to mount
    hub: bool = False  # hf://: fetched by an init container


def parse(uri: str) -> Source:
    """The Source of a URI the CRD admitted (it refuses any other shape)."""
    if uri.startswith("hf://"):
        repo, _, revision = uri.removeprefix("hf://").partition("@")
        return Source(uri, f"{HF_DIR}/{repo}/{revision or DEFAULT_REVISION}", hub=True)
    if uri.startswith("pvc://"):
        claim, _, inner = uri.removeprefix("pvc://").partition("/")
        return Source(uri, f"{PVC_DIR}/{claim}/{inner}".rstrip("/"), claim=claim)
    return Source(uri, uri)


def sources(spec: dict[str, Any]) -> dict[str, Source]:
    """{"model": ..., "adapter": ...} for the URIs the spec sets (none without spec.model.uri)."""
    model = spec.get("model") or {}
    named = {"model": model.get("uri"), "adapter": model.get("adapterUri")}
    return {role: parse(uri) for role, uri in named.items() if uri}


def model_path(spec: dict[str, Any]) -> str:
    """What lopa.yaml's model.path names: the URI's directory, else spec.model.path ('' = bundled)."""
    found = sources(spec).get("model")
    return found.path if found else (spec.get("model") or {}).get("path", "")


def adapter_path(spec: dict[str, Any]) -> str:
    found = sources(spec).get("adapter")
    return found.path if found else (spec.get("model") or {}).get("adapter", "")


def _legacy_pvc(spec: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    pvc = (spec.get("model") or {}).get("pvc")
    if not pvc:
        return [], []
    volume = {"name": "model", "persistentVolumeClaim": {"claimName": pvc["claimName"], "readOnly": True}}
    mount: dict[str, Any] = {"name": "model", "mountPath": pvc.get("mountPath", "/models"), "readOnly": True}
    if pvc.get("subPath"):
        mount["subPath"] = pvc["subPath"]
    return [volume], [mount]


def _cache_volume(spec: dict[str, Any]) -> dict[str, Any]:
    cache = (spec.get("model") or {}).get("cache") or {}
    if cache.get("claimName"):
        return {"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache["claimName"]}}
    empty = {"sizeLimit": cache["sizeLimit"]} if cache.get("sizeLimit") else {}
    return {"name": CACHE_VOLUME, "emptyDir": empty}


def volumes(spec: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, the runtime containers' read-only mounts) of the model and adapter sources."""
    found = sources(spec)
    if not found:
        return _legacy_pvc(spec)
    out: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if any(s.hub for s in found.values()):
        out.append(_cache_volume(spec))
        mounts.append({"name": CACHE_VOLUME, "mountPath": HF_DIR, "readOnly": True})
    claims = sorted({s.claim for s in found.values() if s.claim})
    for number, claim in enumerate(claims):
        name = f"model-pvc-{number}"
        out.append({"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": name, "mountPath": f"{PVC_DIR}/{claim}", "readOnly": True})
    return out, mounts


def _hub_env(spec: dict[str, Any]) -> list[dict[str, Any]]:
    hub = (spec.get("model") or {}).get("huggingFace") or {}
    env: list[dict[str, Any]] = []
    if hub.get("endpoint"):
        env.append({"name": "HF_ENDPOINT", "value": hub["endpoint"]})
    secret = hub.get("tokenSecret")
    if secret:
        ref = {"name": secret["name"], "key": secret.get("key", TOKEN_KEY)}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    return env


def init_containers(spec: dict[str, Any], image: str, user_env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One `lopa fetch-model` init container per hf:// source, writing into the cache volume.

    `user_env`: spec.env merged over the writable-directory variables (proxies reach the fetch too).
    Its last log line names what failed (FallbackToLogsOnError), which the group's status repeats."""
    out = []
    for role, source in sources(spec).items():
        if not source.hub:
            continue
        out.append({
            "name": f"fetch-{role}",
            "image": image,
            "imagePullPolicy": spec["imagePullPolicy"],
            "command": ["lopa", "fetch-model", source.uri, "--into", source.path],
            "env": [*copy.deepcopy(user_env), *_hub_env(spec)],
            "volumeMounts": [security.mount(), {"name": CACHE_VOLUME, "mountPath": HF_DIR}],
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "securityContext": security.container_context(spec),
        })
    return out

