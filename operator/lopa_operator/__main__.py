"""`lopa-operator` / `python -m lopa_operator`: runs the kopf operator with namespace options."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

import kopf

from . import __version__


class _QuietResync(logging.Filter):
    """Drops kopf's per-tick "Timer 'resync' succeeded" lines (one per object per resync)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timer 'resync' succeeded")


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (0 would make the resync timer spin)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 and finite, got {text}")
    return value


# In a pod the ServiceAccount's namespace is the operator's own (the watch scope by default).
OWN_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _namespace(text: str) -> str:
    """One exact namespace name: kopf's globs and negations need the namespace list, which the
    operator neither watches nor is granted."""
    if not _NAMESPACE.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a namespace name (lowercase letters, digits and '-'; no patterns)"
        )
    return text


def scope(args: argparse.Namespace, own_namespace_file: Path = OWN_NAMESPACE_FILE) -> list[str]:
    """The namespaces to watch ([] = all): the named ones, every one with --all-namespaces, else the
    operator's own (its ServiceAccount's). SystemExit naming the flags when none can be told."""
    if args.all_namespaces and args.namespace:
        raise SystemExit("lopa-operator: error: --namespace and --all-namespaces exclude each other")
    if args.all_namespaces:
        return []
    if args.namespace:
        return list(dict.fromkeys(args.namespace))
    try:
        own = own_namespace_file.read_text().strip()
    except OSError:
        own = ""
    if not own:
        raise SystemExit(
            "lopa-operator: error: name the namespaces to watch (--namespace, repeatable) or pass "
            f"--all-namespaces (outside a pod there is no own namespace: {own_namespace_file} is missing)"
        )
    return [own]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    # long: the operator's flags, one after another
    p = argparse.ArgumentParser(prog="lopa-operator", description=__doc__)
    version = f"lopa-operator {__version__} (kopf {kopf.__version__})"
    p.add_argument("--version", action="version", version=version)
    p.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        type=_namespace,
        help="namespace to watch (repeatable, exact names); default: the operator's own namespace",
    )
    p.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="watch every namespace (needs cluster-wide RBAC: docs/guides/operator-security.md)",
    )
    p.add_argument(
        "--liveness",
        default=os.environ.get("LOPA_OPERATOR_LIVENESS", "http://0.0.0.0:8080/healthz"),
        help="kopf liveness endpoint URL ('' disables; default %(default)s)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus /metrics port (0 disables; default: LOPA_OPERATOR_METRICS_PORT, else 9090)",
    )
    p.add_argument(
        "--render",
        metavar="FILE",
        help="print the children of the LoPADeployment(s) in FILE ('-' = stdin) as YAML and exit",
    )
    p.add_argument(
        "--resync-seconds", type=_seconds, default=None,
        help="seconds between resyncs (> 0; default: LOPA_OPERATOR_RESYNC_SECONDS, else 10)"
    )
    p.add_argument(
        "--retry-refused-seconds",
        type=_seconds,
        default=None,
        help="seconds before a rendering the API server refused (or a missing InferencePool CRD) is "
        "tried again; an edit is tried at once (> 0; default: LOPA_OPERATOR_RETRY_REFUSED_SECONDS, else 60)",
    )
    p.add_argument(
        "--log-level",
        default=os.environ.get("LOPA_OPERATOR_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning"],
        help="default %(default)s",
    )
    return p.parse_args(argv)


def render_file(source: str) -> str:
    """The children the operator would apply for every LoPADeployment in `source` (no cluster)."""
    import yaml

    from . import inference_pool, names, render
    from . import spec as specs

    text = sys.stdin.read() if source == "-" else Path(source).read_text()
    out = []
    for doc in yaml.safe_load_all(text):
        if doc and doc.get("kind") == names.KIND:
            meta = doc["metadata"]
            name, namespace, spec = meta["name"], meta.get("namespace", "default"), doc.get("spec") or {}
            out += render.children(name, namespace, spec)
            if inference_pool.enabled(spec):
                out.append(inference_pool.render(name, namespace, specs.with_defaults(spec)))
    return yaml.safe_dump_all(out, sort_keys=False)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.render:
        print(render_file(args.render), end="")
        return
    namespaces = scope(args)  # before anything starts: a bad scope is a usage error
    from . import network

    try:
        network.default_metrics_from()
    except ValueError as error:
        raise SystemExit(f"lopa-operator: error: {error}") from None
    from . import handlers, settings

    try:
        chosen = settings.from_environment().with_flags(
            metrics_port=args.metrics_port, resync_s=args.resync_seconds,
            retry_refused_s=args.retry_refused_seconds,
        )
    except ValueError as error:
        raise SystemExit(f"lopa-operator: error: {error}") from None
    settings.install(chosen)
    handlers.register(chosen)

    kopf.configure(debug=args.log_level == "debug", quiet=args.log_level == "warning", log_prefix=True)
    if args.log_level != "debug":
        logging.getLogger("kopf.objects").addFilter(_QuietResync())
    watched = ", ".join(namespaces) if namespaces else "all namespaces"
    logging.getLogger("lopa_operator").info("lopa-operator %s watching %s", __version__, watched)
    kopf.run(
        standalone=True,  # one replica (Recreate): no peering objects, no peering RBAC
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness or None,
    )


if __name__ == "__main__":
    main()
