"""The Helm chart: lint, install, least-privilege RBAC, and the generated install bundle."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from lopa_op_helpers import (
    CHART,
    RELEASE,
    RELEASE_NAMESPACE,
    REPO,
    SAMPLES,
    SERVICE_ACCOUNT,
    ensure_chart,
    inference_extension,
    keda_crds,
)

from kube.cluster import KubeCluster

SA_USER = f"system:serviceaccount:{RELEASE_NAMESPACE}:{SERVICE_ACCOUNT}"


def test_helm_lint_clean(kube: KubeCluster) -> None:
    for values in (
        [], ["--set", "watchNamespaces={team-a,team-b}"], ["--set", "watchAllNamespaces=true"],
        ["--set", "metrics.podMonitor.enabled=true", "--set", "metrics.prometheusRule.enabled=true"],
    ):
        result = kube.helm("lint", "--strict", str(CHART), *values)
        assert "0 chart(s) failed" in result.stdout, result.stdout
        assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("resyncSeconds=0", "/resyncSeconds"),  # the operator would resync in a busy loop
        ("retryRefusedSeconds=0", "/retryRefusedSeconds"),
        ("logLevel=loud", "/logLevel"),  # the operator would exit at start (argparse choices)
        ("metrics.port=70000", "/metrics/port"),
        ("metrics.podMonitor.interval=15", "/metrics/podMonitor/interval"),  # Prometheus wants 15s
        ("resyncSecond=5", "'resyncSecond' not allowed"),  # a typo was silently ignored
        ("watchNamespaces={Team_A}", "/watchNamespaces/0"),
        ("image.pullPolicy=sometimes", "/image/pullPolicy"),
        ("livenessPort=9090", "metrics.port and livenessPort must differ"),  # two listeners, one port
        ("watchAllNamespaces=true,watchNamespaces={team-a}", "exclude each other"),
        ("watchAllNamespaces=yes", "/watchAllNamespaces"),
        ("networkPolicy.metricsFrom[0].podSelectr.app=x", "/networkPolicy/metricsFrom/0"),
    ],
)
def test_bad_values_are_refused_naming_the_key(kube: KubeCluster, value: str, named: str) -> None:
    """Before values.schema.json these rendered a Deployment that crash-looped or misbehaved."""
    result = kube.helm("template", RELEASE, str(CHART), "--kube-version", "1.30.0", "--set", value,
                       check=False)
    assert result.returncode != 0 and named in result.stderr, result.stderr


def test_helm_install(kube: KubeCluster) -> None:
    ensure_chart(kube)
    status = kube.helm("status", RELEASE, "-n", RELEASE_NAMESPACE, "-o", "json")
    assert '"status":"deployed"' in status.stdout.replace(" ", "")
    crd = kube.get_json("crd", "lopadeployments.lopa.dev")
    assert crd["spec"]["names"]["shortNames"] == ["lopa"]
    deployment = kube.get_json("deployment", RELEASE, "-n", RELEASE_NAMESPACE)
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == SERVICE_ACCOUNT
    assert "--all-namespaces" in pod["containers"][0]["args"]
    assert pod["containers"][0]["livenessProbe"]["httpGet"]["path"] == "/healthz"


@pytest.mark.parametrize(
    ("verb", "resource", "allowed"),
    [
        ("patch", "lopadeployments.lopa.dev/status", True),
        ("watch", "lopadeployments.lopa.dev", True),
        ("create", "statefulsets.apps", True),
        ("delete", "pods", True),
        ("create", "events", True),
        ("delete", "statefulsets.apps", True),  # scale-down removes a group's children
        ("list", "configmaps", True),
        ("get", "services", True),  # a child's name is checked before it is first applied
        ("get", "secrets", True),  # a group's Secret is read back (its data is kept)
        ("delete", "secrets", True),  # with its group
        ("patch", "networkpolicies.networking.k8s.io", True),
        ("create", "inferencepools.inference.networking.k8s.io", True),
        ("create", "podgroups.scheduling.k8s.io", True),  # spec.scheduling.gang: Workload
        ("delete", "workloads.scheduling.k8s.io", True),
        ("get", "localqueues.kueue.x-k8s.io", True),  # gang: Kueue, read only
        ("get", "workloads.kueue.x-k8s.io", True),
        ("delete", "workloads.kueue.x-k8s.io", False),
        ("create", "localqueues.kueue.x-k8s.io", False),
        # Not needed, so not granted: least privilege.
        ("delete", "services", False),
        ("update", "statefulsets.apps", False),
        ("list", "secrets", False),  # group Secrets are read by name: no enumerating the namespace's
        ("watch", "secrets", False),
        ("list", "networkpolicies.networking.k8s.io", False),
        ("create", "pods", False),
        ("delete", "lopadeployments.lopa.dev", False),
        ("list", "customresourcedefinitions.apiextensions.k8s.io", False),
    ],
)
def test_rbac_is_least_privilege(kube: KubeCluster, verb: str, resource: str, allowed: bool) -> None:
    ensure_chart(kube)
    if resource.startswith("inferencepools."):
        inference_extension(kube)  # kubectl resolves a resource by discovery: the CRD must be there
    if resource.endswith(".kueue.x-k8s.io"):  # Kueue is not installed here: ask the API server itself
        plural, group = resource.split(".", 1)
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                  "spec": {"resourceAttributes": {"verb": verb, "group": group, "resource": plural}}}
        answer = kube.kubectl("create", "--validate=false", "-o", "json", "-f", "-", f"--as={SA_USER}",
                              input=json.dumps(review))
        assert json.loads(answer.stdout)["status"]["allowed"] is allowed, (verb, resource, answer.stdout)
        return
    result = kube.kubectl("auth", "can-i", verb, resource, "-A", f"--as={SA_USER}", check=False)
    assert result.stdout.strip() == ("yes" if allowed else "no"), (
        verb,
        resource,
        result.stdout,
        result.stderr,
    )


@pytest.mark.parametrize(
    ("role", "verb", "subresource", "allowed"),
    [
        ("edit", "create", "", True),
        ("edit", "patch", "scale", True),
        ("edit", "delete", "", True),
        ("edit", "patch", "status", False),  # the operator's to write
        ("view", "list", "", True),
        ("view", "get", "scale", True),
        ("view", "create", "", False),
    ],
)
def test_the_built_in_user_roles_cover_lopadeployments(
    kube: KubeCluster, namespace: str, role: str, verb: str, subresource: str, allowed: bool
) -> None:
    """A namespace's editors manage and scale LoPADeployments, its viewers read them, through the
    chart's aggregated ClusterRoles (before: the built-in roles granted nothing on them)."""
    ensure_chart(kube)
    user = f"someone-{role}"
    kube.kubectl("create", "rolebinding", user, f"--clusterrole={role}", f"--user={user}", "-n", namespace)

    def answer() -> str | None:
        result = kube.kubectl("auth", "can-i", verb, "lopadeployments.lopa.dev", "-n", namespace,
                              f"--subresource={subresource}", f"--as={user}", check=False)
        said = result.stdout.strip()
        return said if said == ("yes" if allowed else "no") else None

    # The controller-manager aggregates the rules into the built-in role within moments.
    kube.wait_for(answer, timeout=30, interval=0.5, description=f"{role} may {verb} {subresource}: {allowed}")


def test_namespaced_install_renders_roles(kube: KubeCluster) -> None:
    out = kube.helm(
        "template",
        RELEASE,
        str(CHART),
        "-n",
        RELEASE_NAMESPACE,
        "--kube-version",
        "1.30.0",
        "--set",
        "watchNamespaces={team-a,team-b}",
    ).stdout
    kinds = [line for line in out.splitlines() if line.startswith("kind: ")]
    assert kinds.count("kind: Role") == 2 and kinds.count("kind: RoleBinding") == 2
    # Cluster-wide: only the user roles' aggregation (they grant nothing until bound), no binding.
    cluster_roles = [d["metadata"]["name"] for d in yaml.safe_load_all(out)
                     if d and d["kind"] == "ClusterRole"]
    assert cluster_roles == [f"{RELEASE}-edit", f"{RELEASE}-view"]
    assert "kind: ClusterRoleBinding" not in kinds
    assert "--namespace=team-a" in out and "--all-namespaces" not in out


def render_chart(kube: KubeCluster, *values: str) -> list[dict]:
    out = kube.helm("template", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE, "--kube-version", "1.30.0",
                    *[arg for v in values for arg in ("--set", v)]).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_the_default_install_is_namespaced(kube: KubeCluster) -> None:
    """By default the operator watches its own namespace, with a Role there: nothing cluster-wide of
    its own (the user roles' aggregation grants nothing until a namespace binds it), so no Secret
    outside that namespace is within its reach."""
    docs = render_chart(kube)
    by_kind: dict[str, list[dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    assert [(r["metadata"]["name"], r["metadata"]["namespace"]) for r in by_kind["Role"]] == [
        (RELEASE, RELEASE_NAMESPACE)]
    (binding,) = by_kind["RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT,
                                    "namespace": RELEASE_NAMESPACE}]
    assert "ClusterRoleBinding" not in by_kind
    assert [c["metadata"]["name"] for c in by_kind["ClusterRole"]] == [f"{RELEASE}-edit", f"{RELEASE}-view"]
    (deployment,) = by_kind["Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--namespace={RELEASE_NAMESPACE}" in args and "--all-namespaces" not in args
    # Cluster-wide only when asked, with the same rules.
    wide = {d["kind"]: d for d in render_chart(kube, "watchAllNamespaces=true")}
    assert "Role" not in wide and wide["ClusterRoleBinding"]["roleRef"]["name"] == RELEASE
    assert wide["ClusterRole"]["rules"] == by_kind["Role"][0]["rules"]
    assert "--all-namespaces" in wide["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_chart_default_scrapers_are_the_operators(kube: KubeCluster) -> None:
    from lopa_operator import network

    (deployment,) = [d for d in render_chart(kube) if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert json.loads(env[network.METRICS_FROM_ENV]) == network.DEFAULT_METRICS_FROM
    scraper = "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=observability"
    (deployment,) = [d for d in render_chart(kube, scraper) if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert json.loads(env[network.METRICS_FROM_ENV])[0]["namespaceSelector"] == {
        "matchLabels": {"team": "observability"}}


def test_install_bundle_matches_helm_template(kube: KubeCluster, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "HELM": str(kube.bin_dir / "helm"),
        **{k: v for k, v in kube.env().items() if k.startswith("HELM_")},
    }
    subprocess.run([str(REPO / "manifests" / "generate.sh"), str(tmp_path)], env=env, check=True, timeout=120)
    for rel in ("install.yaml", "crds/lopadeployments.lopa.dev.yaml"):
        committed = (REPO / "manifests" / rel).read_text()
        assert committed == (tmp_path / rel).read_text(), (
            f"manifests/{rel} is stale: run manifests/generate.sh"
        )


def test_install_bundle_and_samples_pass_server_validation(kube: KubeCluster, namespace: str) -> None:
    ensure_chart(kube)
    inference_extension(kube)  # inferencepool.yaml's InferencePool
    keda_crds(kube)  # keda.yaml's ScaledObject
    kube.kubectl("apply", "--dry-run=server", "-f", str(REPO / "manifests" / "install.yaml"))
    for sample in sorted(SAMPLES.glob("*.yaml")):
        kube.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(sample))


def test_readme_crd_upgrade_command_replaces_a_helm_installed_crd(kube: KubeCluster) -> None:
    # `helm upgrade` leaves CRDs alone; the chart README's command must update one that helm
    # installed. helm creates it with field manager "helm": stand in for an older chart's CRD by
    # changing one field under that manager.
    ensure_chart(kube)
    readme = (CHART / "README.md").read_text()
    found = re.search(r"`(kubectl apply [^`]*charts/lopa-operator/crds/)`", readme)
    assert found, "the chart README names no command that applies crds/"
    shm = "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/accelerator/properties/shmSize"
    older = json.dumps([{"op": "replace", "path": f"{shm}/description", "value": "an older CRD"}])
    crd = "crd/lopadeployments.lopa.dev"
    kube.kubectl("patch", crd, "--type=json", "--field-manager=helm", "-p", older)
    args = [str(REPO / a) if a.startswith("charts/") else a for a in shlex.split(found.group(1))[1:]]
    result = kube.kubectl(*args, check=False)
    assert result.returncode == 0, (found.group(1), result.stderr)
    schema = kube.get_json(crd)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    accelerator = schema["properties"]["spec"]["properties"]["accelerator"]
    assert accelerator["properties"]["shmSize"]["description"] != "an older CRD"


def test_readme_rbac_lists_the_rendered_rules(kube: KubeCluster) -> None:
    # The chart README's RBAC paragraph is what an admin reviews before granting: every verb of
    # every rendered rule, and nothing more.
    role = next(d for d in render_chart(kube) if d["kind"] == "Role" and d["metadata"]["name"] == RELEASE)
    rendered = {(res, verb) for rule in role["rules"] for res in rule["resources"] for verb in rule["verbs"]}
    readme = (CHART / "README.md").read_text()
    paragraph = readme[readme.index("RBAC (a Role") :].split("\n\n")[0].split(":", 1)[1]
    paragraph = re.sub(r"\s+", " ", re.sub(r"\([^)]*\)", "", paragraph))
    documented = {
        (res, verb)
        for found in re.finditer(r"((?:`[\w/]+`,? )+)([a-z]+(?:/[a-z]+)*)", paragraph)
        for res in re.findall(r"`([\w/]+)`", found.group(1))
        for verb in found.group(2).split("/")
    }
    assert documented == rendered, (sorted(rendered - documented), sorted(documented - rendered))


def test_the_monitors_fit_the_prometheus_operator_crds_and_select_the_rendered_pods(
    kube: KubeCluster, namespace: str
) -> None:
    """metrics.podMonitor: the PodMonitor and ServiceMonitor pass the Prometheus Operator's own CRD
    schemas on the real API server (strict field validation: a misspelt key is an error), and the
    PodMonitor selects the master and worker pods the operator renders, by a port they have."""
    script = REPO / "tools" / "k8s-testenv" / "monitoring-crds.sh"
    crds = Path(subprocess.run([str(script)], check=True, capture_output=True, text=True,
                               timeout=600).stdout.strip().splitlines()[-1])
    for crd in sorted(crds.glob("*.yaml")):
        kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    for name in ("podmonitors", "servicemonitors", "prometheusrules"):
        crd_name = f"crd/{name}.monitoring.coreos.com"
        kube.kubectl("wait", "--for=condition=Established", crd_name, "--timeout=60s")
    ensure_chart(kube)
    values = ["metrics.podMonitor.enabled=true", "metrics.podMonitor.labels.release=kps",
              "metrics.prometheusRule.enabled=true", "metrics.prometheusRule.labels.release=kps",
              f"watchNamespaces={{{namespace}}}"]
    out = kube.helm("template", RELEASE, str(CHART), "-n", namespace, "--kube-version", "1.30.0",
                    *[arg for v in values for arg in ("--set", v)])
    kinds = ("PodMonitor", "ServiceMonitor", "PrometheusRule")
    monitors = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] in kinds]
    assert sorted(d["kind"] for d in monitors) == sorted(kinds)
    for monitor in monitors:
        kube.kubectl("apply", "--validate=strict", "-n", namespace, "-f", "-", input=yaml.safe_dump(monitor))
        stored = kube.get_json(monitor["kind"].lower(), monitor["metadata"]["name"], "-n", namespace)
        assert stored["metadata"]["labels"]["release"] == "kps"
        for key, value in monitor["spec"].items():  # nothing pruned (defaults may be added)
            assert stored["spec"][key] == value, (monitor["kind"], key)

    from lopa_operator import render

    _alerts_read_metrics_that_exist(next(d for d in monitors if d["kind"] == "PrometheusRule"))
    pod_monitor = next(d for d in monitors if d["kind"] == "PodMonitor")
    assert pod_monitor["spec"]["namespaceSelector"] == {"matchNames": [namespace]}
    children = render.children("llm", namespace, {"branchParallelism": 2})
    templates = [c["spec"]["template"] for c in children if c["kind"] in ("StatefulSet", "Deployment")]
    assert len(templates) == 2  # the workers and the master
    for template in templates:
        labels = template["metadata"]["labels"]
        assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert set(pod_monitor["spec"]["podTargetLabels"]) <= set(labels)
        ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} <= ports
        assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def _alerts_read_metrics_that_exist(rule: dict) -> None:
    """Every series an alert reads is one lopa serves, with label values it sets: a misspelt name
    would never fire, and nothing else would tell."""
    from prometheus_client import REGISTRY

    from lopa.serving.shared.metrics import MasterMetrics
    from lopa_operator import metrics as operator_metrics  # registers the operator's metrics

    families = [*MasterMetrics.create().registry.collect(), *REGISTRY.collect()]  # the operator's: global
    # (by family: a labelled series has no sample until it is first set)
    served = {f"{f.name}_total" if f.type == "counter" else f.name for f in families}
    source = "".join(p.read_text() for p in (REPO / "runtime" / "lopa" / "serving" / "master").glob("*.py"))
    exprs = [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]
    assert len(exprs) == 4
    for expr in exprs:
        for name in re.findall(r"\b(lopa_[a-z_]+)\b", expr):
            assert name in served, (name, expr)
        for outcome in re.findall(r'outcome=~?"([^"]+)"', expr):
            for value in outcome.split("|"):
                assert f'"{value}"' in source, (value, expr)  # an outcome the master counts
        for phase in re.findall(r'phase="([^"]+)"', expr):
            assert phase in operator_metrics.PHASES
