"""What a kubelet would run for a pod, built from the Pod object the API server holds.

`plan(pod, ...)` resolves the pod's container, and its init containers, as a kubelet does before
starting them:
- env: `envFrom` (ConfigMaps, Secrets) then `env` in order, later entries winning; plain values
  expand `$(VAR)` references to variables defined before them; `valueFrom.fieldRef` is read from the
  pod (metadata.name/namespace/uid, labels['k'], annotations['k'], spec.nodeName,
  spec.serviceAccountName, status.podIP(s), status.hostIP(s)), `configMapKeyRef`/`secretKeyRef`
  from the API server (an optional missing key is left out);
- argv: `command` + `args`, each with `$(VAR)` expanded from that env (`$$` escapes, unknown
  references stay verbatim);
- volumes: configMap, secret, downwardAPI, projected (serviceAccountToken from the TokenRequest
  API bound to the pod, configMap, secret, downwardAPI) and emptyDir, as files with their modes;
  persistentVolumeClaim as the directory of its bound PersistentVolume (hostPath or local: a
  directory of this machine, kept when the pod goes), waiting while the claim is unbound; plus the
  mounts (mountPath, subPath, readOnly) that `pod_sandbox` makes visible in each container.

Where it differs from a kubelet: there is no image. The "image" is this test run's Python
environment (`IMAGE_ENV`: the venv's bin first on PATH, this run's PYTHONPATH, and the ENV lines of
docker/runtime-cpu.Dockerfile); a container must name its `command` (there is no ENTRYPOINT to fall
back on). One container per pod, after its init containers in order (sidecars, restartPolicy Always,
are not supported). `resourceFieldRef` env, volumes other than the
kinds above, `hostAliases` and service links (KUBERNETES_SERVICE_* included) are not supported (they
raise `Unsupported`, or are ignored where the pod would run the same). Of the security contexts,
the users and groups apply (`user`), to init containers too: runAsUser and runAsGroup (the
container's over the pod's) and, as supplementary groups, fsGroup and supplementalGroups; the
volumes get fsGroup's ownership as the kubelet gives it (`pod_sandbox.write_volumes`; a claim's
directory as a driver that supports fsGroup would). Without runAsUser the process runs as root (there
is no image USER); the rest (readOnlyRootFilesystem, capabilities, seccomp) is ignored: the root
filesystem is writable. Volume files are written once at start: plain
files, not the kubelet's `..data` symlinks, and not refreshed when their ConfigMap or Secret
changes.
"""

from __future__ import annotations

import base64
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .kube_api import Api

IMAGE_ENV = {
    "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/sbin:/usr/local/bin",
                             "/usr/sbin:/usr/bin:/sbin:/bin"]),
    # The runtime image sets these (docker/runtime-cpu.Dockerfile).
    "PYTHONUNBUFFERED": "1",
    "HOME": "/tmp",
}
DEFAULT_MODE = 0o644
TOKEN_SECONDS = 3607  # what the ServiceAccount admission plugin puts in its projected volume


class Unsupported(RuntimeError):
    """The pod uses something the harness does not run (the message names it)."""


class NotYet(RuntimeError):
    """Something the container needs does not exist yet (a kubelet would wait and retry too)."""


@dataclass
class Mount:
    volume: str
    path: str  # mountPath inside the pod
    sub_path: str = ""
    read_only: bool = False


@dataclass(frozen=True)
class User:
    """Who the container's process runs as."""

    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary: fsGroup, then supplementalGroups


def user(pod_spec: dict[str, Any], container: dict[str, Any]) -> User | None:
    """The process's user and groups from the security contexts, None when no runAsUser is set."""
    pod_context = pod_spec.get("securityContext") or {}
    own = container.get("securityContext") or {}
    uid = own.get("runAsUser", pod_context.get("runAsUser"))
    if uid is None:
        return None
    gid = own.get("runAsGroup", pod_context.get("runAsGroup", 0))
    extra = [pod_context["fsGroup"]] if "fsGroup" in pod_context else []
    extra += pod_context.get("supplementalGroups") or []
    return User(int(uid), int(gid), tuple(dict.fromkeys(int(g) for g in extra)))


@dataclass
class InitPlan:
    """An init container: run to completion, in order, before the pod's container."""

    name: str
    argv: list[str]
    env: dict[str, str]
    mounts: list[Mount]
    working_dir: str
    # terminationMessagePolicy FallbackToLogsOnError: a failure's message is its log's tail.
    fallback_to_logs: bool = False
    user: User | None = None  # None: root, as an image without USER


@dataclass
class PodPlan:
    uid: str
    name: str
    namespace: str
    container: str
    argv: list[str]
    env: dict[str, str]
    ports: dict[str, int]  # named container ports
    mounts: list[Mount]
    # volume name -> relative file path -> (content, mode); an emptyDir is an empty mapping.
    volumes: dict[str, dict[str, tuple[bytes, int]]]
    readiness: dict[str, Any] | None
    liveness: dict[str, Any] | None
    hostname: str
    subdomain: str
    grace_seconds: float
    working_dir: str
    share_pid: bool = False  # spec.shareProcessNamespace
    pre_stop_sleep_s: float = 0.0  # lifecycle.preStop.sleep: waited out before SIGTERM
    user: User | None = None  # None: root, as an image without USER
    fs_group: int | None = None  # the volumes' group (securityContext.fsGroup)
    init_containers: list[InitPlan] = field(default_factory=list)
    # persistentVolumeClaim volumes: name -> the bound PersistentVolume's directory on this machine
    host_dirs: dict[str, Path] = field(default_factory=dict)

    def port(self, value: int | str) -> int:
        """A probe's port: a number, or the name of one of the container's ports."""
        if isinstance(value, int) or str(value).isdigit():
            return int(value)
        if value not in self.ports:
            raise Unsupported(f"pod {self.namespace}/{self.name}: no container port named {value!r}")
        return self.ports[value]


def plan(pod: dict[str, Any], api: Api, pod_ip: str, host_ip: str) -> PodPlan:
    """The plan of `pod` once it runs at `pod_ip` on a node at `host_ip`."""
    meta, spec = pod["metadata"], pod["spec"]
    where = f"pod {meta['namespace']}/{meta['name']}"
    if len(spec.get("containers") or []) != 1:
        raise Unsupported(f"{where}: exactly one container is supported")
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        if not c.get("command"):
            raise Unsupported(f"{where}: container {c['name']} has no command (no image entrypoint here)")
        if c.get("restartPolicy"):
            raise Unsupported(f"{where}: sidecar init container {c['name']} is not supported")
    container = spec["containers"][0]
    fields = _field_resolver(pod, pod_ip, host_ip)
    sources = _Sources(api, meta["namespace"])
    hostname = spec.get("hostname") or meta["name"]
    env = _environment(container, fields, sources, hostname)
    argv = _argv(container, env)
    volumes = spec.get("volumes") or []
    return PodPlan(
        uid=meta["uid"],
        name=meta["name"],
        namespace=meta["namespace"],
        container=container["name"],
        argv=argv,
        env=env,
        ports={p["name"]: int(p["containerPort"]) for p in container.get("ports") or [] if p.get("name")},
        mounts=_mounts(container),
        volumes={v["name"]: volume_files(v, pod, fields, sources)
                 for v in volumes if "persistentVolumeClaim" not in v},
        readiness=container.get("readinessProbe"),
        liveness=container.get("livenessProbe"),
        hostname=hostname,
        subdomain=spec.get("subdomain", ""),
        grace_seconds=float(spec.get("terminationGracePeriodSeconds", 30)),
        working_dir=container.get("workingDir") or "/",
        share_pid=bool(spec.get("shareProcessNamespace")),
        pre_stop_sleep_s=_pre_stop_sleep(container, where),
        user=user(spec, container),
        fs_group=(spec.get("securityContext") or {}).get("fsGroup"),
        init_containers=[
            replace(_init_plan(c, fields, sources, hostname), user=user(spec, c))
            for c in spec.get("initContainers") or []
        ],
        host_dirs={v["name"]: sources.claim_dir(v["persistentVolumeClaim"]["claimName"])
                   for v in volumes if "persistentVolumeClaim" in v},
    )


def _init_plan(
    container: dict[str, Any], fields: Callable[[str], str], sources: _Sources, hostname: str
) -> InitPlan:
    env = _environment(container, fields, sources, hostname)
    return InitPlan(container["name"], _argv(container, env), env, _mounts(container),
                    container.get("workingDir") or "/",
                    container.get("terminationMessagePolicy") == "FallbackToLogsOnError")


def _environment(
    container: dict[str, Any], fields: Callable[[str], str], sources: _Sources, hostname: str
) -> dict[str, str]:
    env = dict(IMAGE_ENV)
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]  # the "image" runs this checkout's code
    env["HOSTNAME"] = hostname  # what the container runtime sets
    env.update(container_env(container, fields, sources))
    return env


def _argv(container: dict[str, Any], env: Mapping[str, str]) -> list[str]:
    return [expand(part, env) for part in [*container["command"], *(container.get("args") or [])]]


def _mounts(container: dict[str, Any]) -> list[Mount]:
    return [Mount(m["name"], m["mountPath"], m.get("subPath", ""), bool(m.get("readOnly")))
            for m in container.get("volumeMounts") or []]


def _pre_stop_sleep(container: dict[str, Any], where: str) -> float:
    hook = (container.get("lifecycle") or {}).get("preStop")
    if not hook:
        return 0.0
    if set(hook) != {"sleep"}:
        raise Unsupported(f"{where}: a preStop hook other than sleep is not supported: {sorted(hook)}")
    return float(hook["sleep"]["seconds"])


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: `$$` is a literal `$`, unknown references stay as written."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            if text[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            if text[i + 1] == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    out.append(env[name] if name in env else text[i : end + 1])
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


def container_env(
    container: dict[str, Any], fields: Callable[[str], str], sources: _Sources
) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            data = sources.config_map(source["configMapRef"]["name"], source["configMapRef"].get("optional"))
        else:
            data = sources.secret(source["secretRef"]["name"], source["secretRef"].get("optional"))
        env.update({prefix + key: value.decode() for key, value in data.items()})
    for entry in container.get("env") or []:
        name = entry["name"]
        if "valueFrom" not in entry:
            env[name] = expand(entry.get("value", ""), env)
            continue
        ref = entry["valueFrom"]
        if "fieldRef" in ref:
            env[name] = fields(ref["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in ref or "secretKeyRef" in ref:
            key_ref = ref.get("configMapKeyRef") or ref["secretKeyRef"]
            get = sources.config_map if "configMapKeyRef" in ref else sources.secret
            data = get(key_ref["name"], key_ref.get("optional"))
            if key_ref["key"] in data:
                env[name] = data[key_ref["key"]].decode()
            elif not key_ref.get("optional"):
                raise NotYet(f"env {name}: key {key_ref['key']!r} not in {key_ref['name']}")
        else:
            raise Unsupported(f"env {name}: valueFrom {sorted(ref)} is not supported")
    return env


def volume_files(
    volume: dict[str, Any], pod: dict[str, Any], fields: Callable[[str], str], sources: _Sources
) -> dict[str, tuple[bytes, int]]:
    name = volume["name"]
    if "emptyDir" in volume:
        return {}
    if "configMap" in volume or "secret" in volume:
        source = volume.get("configMap") or volume["secret"]
        data = (
            sources.config_map(source["name"], source.get("optional"))
            if "configMap" in volume
            else sources.secret(source["secretName"], source.get("optional"))
        )
        return _items(data, source.get("items"), source.get("defaultMode", DEFAULT_MODE))
    if "downwardAPI" in volume:
        source = volume["downwardAPI"]
        return _downward(source, fields, source.get("defaultMode", DEFAULT_MODE))
    if "projected" in volume:
        mode = volume["projected"].get("defaultMode", DEFAULT_MODE)
        files: dict[str, tuple[bytes, int]] = {}
        for part in volume["projected"].get("sources") or []:
            if "serviceAccountToken" in part:
                token = part["serviceAccountToken"]
                files[token["path"]] = (sources.token(pod, token), mode)
            elif "configMap" in part:
                src = part["configMap"]
                data = sources.config_map(src["name"], src.get("optional"))
                files.update(_items(data, src.get("items"), mode))
            elif "secret" in part:
                src = part["secret"]
                data = sources.secret(src["name"], src.get("optional"))
                files.update(_items(data, src.get("items"), mode))
            elif "downwardAPI" in part:
                files.update(_downward(part["downwardAPI"], fields, mode))
            else:
                raise Unsupported(f"volume {name}: projected source {sorted(part)} is not supported")
        return files
    kinds = sorted(k for k in volume if k != "name")
    raise Unsupported(f"volume {name}: {kinds} volumes are not supported")


def _items(
    data: dict[str, bytes], items: list[dict[str, Any]] | None, mode: int
) -> dict[str, tuple[bytes, int]]:
    if not items:
        return {key: (value, mode) for key, value in data.items()}
    out: dict[str, tuple[bytes, int]] = {}
    for item in items:
        if item["key"] not in data:
            raise NotYet(f"key {item['key']!r} is missing")
        out[item["path"]] = (data[item["key"]], item.get("mode", mode))
    return out


def _downward(
    source: dict[str, Any], fields: Callable[[str], str], mode: int
) -> dict[str, tuple[bytes, int]]:
    out: dict[str, tuple[bytes, int]] = {}
    for item in source.get("items") or []:
        if "fieldRef" not in item:
            raise Unsupported(f"downwardAPI item {item['path']}: only fieldRef is supported")
        out[item["path"]] = (fields(item["fieldRef"]["fieldPath"]).encode(), item.get("mode", mode))
    return out


_MAP_FIELD = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def _field_resolver(pod: dict[str, Any], pod_ip: str, host_ip: str) -> Callable[[str], str]:
    meta, spec = pod["metadata"], pod["spec"]
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"],
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }

    def resolve(path: str) -> str:
        if path in simple:
            return simple[path]
        match = _MAP_FIELD.match(path)
        if match:
            return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
        if path in ("metadata.labels", "metadata.annotations"):  # the downward API file format
            values = meta.get(path.split(".")[1]) or {}
            return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
        raise Unsupported(f"fieldRef {path!r} is not supported")

    return resolve


class _Sources:
    """ConfigMaps, Secrets and tokens of one namespace, read from the API server."""

    def __init__(self, api: Api, namespace: str) -> None:
        self.api, self.namespace = api, namespace

    def config_map(self, name: str, optional: bool | None) -> dict[str, bytes]:
        obj = self.api.get(f"/api/v1/namespaces/{self.namespace}/configmaps/{name}")
        if obj is None:
            if optional:
                return {}
            raise NotYet(f"ConfigMap {self.namespace}/{name} not found")
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return data

    def secret(self, name: str, optional: bool | None) -> dict[str, bytes]:
        obj = self.api.get(f"/api/v1/namespaces/{self.namespace}/secrets/{name}")
        if obj is None:
            if optional:
                return {}
            raise NotYet(f"Secret {self.namespace}/{name} not found")
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}

    def claim_dir(self, claim: str) -> Path:
        """The directory behind a bound claim: its PersistentVolume's hostPath (or local) path."""
        pvc = self.api.get(f"/api/v1/namespaces/{self.namespace}/persistentvolumeclaims/{claim}")
        if pvc is None:
            raise NotYet(f"PersistentVolumeClaim {self.namespace}/{claim} not found")
        volume = (pvc.get("spec") or {}).get("volumeName")
        if (pvc.get("status") or {}).get("phase") != "Bound" or not volume:
            raise NotYet(f"PersistentVolumeClaim {self.namespace}/{claim} is not bound")
        pv = self.api.get(f"/api/v1/persistentvolumes/{volume}") or {}
        source = (pv.get("spec") or {}).get("hostPath") or (pv.get("spec") or {}).get("local")
        if not source:
            raise Unsupported(f"PersistentVolume {volume}: only hostPath and local volumes are supported")
        return Path(source["path"])

    def token(self, pod: dict[str, Any], source: dict[str, Any]) -> bytes:
        """A token bound to the pod (TokenRequest API), as the kubelet requests for projected volumes."""
        meta = pod["metadata"]
        account = pod["spec"].get("serviceAccountName") or "default"
        spec: dict[str, Any] = {
            "expirationSeconds": int(source.get("expirationSeconds", TOKEN_SECONDS)),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]},
        }
        if source.get("audience"):
            spec["audiences"] = [source["audience"]]
        path = f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{account}/token"
        reply = self.api.post(path, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                     "spec": spec})
        return str(reply["status"]["token"]).encode()
