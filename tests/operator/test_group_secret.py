"""Each group's Secret and the deployment's NetworkPolicy on a real control plane: made once and
kept, mounted into the group's pods, made again (and the group restarted on it) by a new
spec.restartTrigger or when deleted; the policy accepted by the API server as rendered."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

from cryptography import x509
from lopa_op_helpers import RESYNC_SECONDS, is_available, lopa, pods, wait_status

from kube.cluster import KubeCluster
from lopa_operator import credentials, names, network
from lopa_operator import spec as specs


def deploy(kube: KubeCluster, ns: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    cr = {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": name}, "spec": spec}
    kube.apply(cr, namespace=ns)
    return wait_status(kube, ns, name, is_available, timeout=90, description=f"{name} Available")


def secret(kube: KubeCluster, ns: str, name: str, index: int) -> dict[str, Any]:
    return kube.get_json("secret", names.group_secret(name, index), "-n", ns)


def maybe_secret(kube: KubeCluster, ns: str, name: str, index: int) -> dict[str, Any] | None:
    found = kube.kubectl("get", "secret", names.group_secret(name, index), "-n", ns, "-o", "json",
                         check=False)
    return json.loads(found.stdout) if found.returncode == 0 else None


def data(obj: dict[str, Any]) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in obj["data"].items()}


def uids(items: list[dict[str, Any]]) -> set[str]:
    return {p["metadata"]["uid"] for p in items}


def test_each_group_gets_its_own_secret_once_mounted_in_its_pods(kube: KubeCluster, ns: str) -> None:
    obj = deploy(kube, ns, "sec", {"branchParallelism": 2, "replicas": 2})
    first = [secret(kube, ns, "sec", i) for i in range(2)]
    for index, made in enumerate(first):
        (owner,) = made["metadata"]["ownerReferences"]
        assert owner["uid"] == obj["metadata"]["uid"] and owner["controller"] is True
        assert made["metadata"]["labels"][names.GROUP_LABEL] == str(index)
        assert set(data(made)) == {"secret"} and len(data(made)["secret"]) == 64
    assert data(first[0]) != data(first[1])  # one group's secret opens no other group's workers
    running = uids(pods(kube, ns, "sec") + pods(kube, ns, "sec", "master"))
    time.sleep(5 * RESYNC_SECONDS)  # several reconciles: nothing is made again, no pod rolls
    for index, made in enumerate(first):
        version = secret(kube, ns, "sec", index)["metadata"]["resourceVersion"]
        assert version == made["metadata"]["resourceVersion"]
    assert uids(pods(kube, ns, "sec") + pods(kube, ns, "sec", "master")) == running
    for pod in pods(kube, ns, "sec") + pods(kube, ns, "sec", "master"):
        index = int(pod["metadata"]["labels"][names.GROUP_LABEL])
        volume = next(v for v in pod["spec"]["volumes"] if v.get("secret", {}).get("secretName")
                      == names.group_secret("sec", index))
        (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
        assert mount == {"name": volume["name"], "mountPath": names.GROUP_DIR, "readOnly": True}
        hashed = pod["metadata"]["annotations"][names.SECRET_HASH_ANNOTATION]
        assert hashed == credentials.digest(data(first[index]))
    config = kube.get_json("configmap", "sec-0-config", "-n", ns)["data"][names.CONFIG_FILE]
    assert f"secret_file: {names.GROUP_DIR}/secret" in config and "tls_cert" not in config

    # Each group's NetworkPolicies, as the API server holds them, are the ones rendered (nothing dropped).
    for index in range(2):
        for rendered in network.policies("sec", ns, specs.with_defaults(obj["spec"]), index):
            stored = kube.get_json("networkpolicy", rendered["metadata"]["name"], "-n", ns)
            assert stored["spec"] == rendered["spec"]
    # Scaling down takes the removed group's Secret and NetworkPolicies with it.
    kube.kubectl("patch", "lopadeployment", "sec", "-n", ns, "--type=merge", "-p", '{"spec":{"replicas":1}}')
    kube.wait_for(lambda: maybe_secret(kube, ns, "sec", 1) is None, timeout=30,
                  description="sec-1-group deleted")
    assert secret(kube, ns, "sec", 0)["metadata"]["uid"] == first[0]["metadata"]["uid"]
    fences = kube.get_json("networkpolicies", "-n", ns)["items"]
    assert sorted(p["metadata"]["name"] for p in fences) == ["sec-0-master", "sec-0-worker"]


def test_with_tls_the_link_has_its_own_ca_and_certificate(kube: KubeCluster, ns: str) -> None:
    # (kwok runs no containers: the client API's Secret need not exist for the group to form)
    deploy(kube, ns, "mtls", {"tls": {"secretName": "client-tls"}})
    made = data(secret(kube, ns, "mtls", 0))
    assert set(made) == {"secret", "ca.crt", "tls.crt", "tls.key"}
    cert = x509.load_pem_x509_certificate(made["tls.crt"].encode())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == credentials.dns_names("mtls", ns)
    config = kube.get_json("configmap", "mtls-0-config", "-n", ns)["data"][names.CONFIG_FILE]
    for key, file in (("tls_cert", "tls.crt"), ("tls_key", "tls.key"), ("tls_ca", "ca.crt")):
        assert f"{key}: {names.GROUP_DIR}/{file}" in config
    # The master admits clients (the kubelet's probe too) on the plaintext health port.
    policy = kube.get_json("networkpolicy", names.master("mtls", 0), "-n", ns)["spec"]
    assert {"protocol": "TCP", "port": names.HEALTH_PORT} in policy["ingress"][0]["ports"]


def test_a_new_restart_trigger_restarts_each_group_on_a_new_secret(kube: KubeCluster, ns: str) -> None:
    before = deploy(kube, ns, "rot", {"branchParallelism": 2})
    old = secret(kube, ns, "rot", 0)
    old_pods = uids(pods(kube, ns, "rot") + pods(kube, ns, "rot", "master"))
    kube.kubectl("patch", "lopadeployment", "rot", "-n", ns, "--type=merge",
                 "-p", '{"spec": {"restartTrigger": "rotate-1"}}')
    after = wait_status(
        kube, ns, "rot",
        lambda o: is_available(o) and o["status"]["configHash"] != before["status"]["configHash"],
        timeout=90, description="rolled onto the new trigger",
    )
    new = secret(kube, ns, "rot", 0)
    assert new["metadata"]["uid"] == old["metadata"]["uid"]  # the same object, new data
    assert data(new)["secret"] != data(old)["secret"]
    assert new["metadata"]["annotations"][names.TRIGGER_ANNOTATION] == "rotate-1"
    now = pods(kube, ns, "rot") + pods(kube, ns, "rot", "master")
    assert not uids(now) & old_pods
    assert {p["metadata"]["annotations"][names.SECRET_HASH_ANNOTATION] for p in now} == {
        credentials.digest(data(new))
    }
    assert after["status"]["groupRestarts"] == before["status"]["groupRestarts"]  # a roll, no failure


def test_a_deleted_secret_is_made_again_and_its_group_restarts_on_it(kube: KubeCluster, ns: str) -> None:
    before = deploy(kube, ns, "gone", {"branchParallelism": 2})
    old = secret(kube, ns, "gone", 0)
    old_pods = uids(pods(kube, ns, "gone") + pods(kube, ns, "gone", "master"))
    kube.kubectl("delete", "secret", "gone-0-group", "-n", ns)
    def made_again() -> str | None:
        found = maybe_secret(kube, ns, "gone", 0)
        fresh = found is not None and found["metadata"]["uid"] != old["metadata"]["uid"]
        return credentials.digest(data(found)) if fresh and found else None

    digest = kube.wait_for(made_again, timeout=30, description="the group Secret made again")
    assert data(secret(kube, ns, "gone", 0))["secret"] != data(old)["secret"]

    def restarted(o: dict[str, Any]) -> bool:
        group = pods(kube, ns, "gone") + pods(kube, ns, "gone", "master")
        hashes = {p["metadata"]["annotations"].get(names.SECRET_HASH_ANNOTATION) for p in group}
        return is_available(o) and len(group) == 3 and hashes == {digest} and not uids(group) & old_pods

    after = wait_status(kube, ns, "gone", restarted, timeout=90, description="the group on its new Secret")
    assert after["status"]["groupRestarts"] == before["status"]["groupRestarts"]
    assert lopa(kube, ns, "gone")["status"]["configHash"] == before["status"]["configHash"]


def fence_names(kube: KubeCluster, ns: str) -> list[str]:
    return sorted(p["metadata"]["name"] for p in kube.get_json("networkpolicies", "-n", ns)["items"])


def test_a_disabled_network_policy_is_removed(kube: KubeCluster, ns: str) -> None:
    deploy(kube, ns, "open", {"replicas": 2})
    assert fence_names(kube, ns) == ["open-0-master", "open-0-worker", "open-1-master", "open-1-worker"]
    kube.kubectl("patch", "lopadeployment", "open", "-n", ns, "--type=merge",
                 "-p", '{"spec": {"networkPolicy": {"enabled": false}}}')
    kube.wait_for(lambda: not fence_names(kube, ns), timeout=30, description="the NetworkPolicies removed")
