"""Renders the one config file (`docs/lopa.yaml` shape, snake_case keys) that master and workers read."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from . import model_source, names
from . import spec as specs

# camelCase spec key -> snake_case config key, in the order of docs/lopa.yaml.
DECODING_KEYS = {
    "blockSize": "block_size",
    "maxNewTokens": "max_new_tokens",
    "tauAdd": "tau_add",
    "tauAct": "tau_act",
    "tauConf": "tau_conf",
    "branches": "branches",
    "conf": "conf",
    "alpha": "alpha",
    "beta": "beta",
    "branchScore": "branch_score",
    "branchPolicy": "branch_policy",
    "attention": "attention",
    "temperature": "temperature",
    "topP": "top_p",
    "topK": "top_k",
    "minP": "min_p",
    "seed": "seed",
}
LIMIT_KEYS = {
    "maxBranches": "max_branches",
    "maxNewTokens": "max_new_tokens",
    "maxPromptTokens": "max_prompt_tokens",
    "queueSize": "queue_size",
    "maxBatch": "max_batch",
    "maxStepTokens": "max_step_tokens",
    "requestTimeoutSeconds": "request_timeout_s",
    "maxModelLen": "max_model_len",
}
FLOAT_KEYS = {"tau_add", "tau_act", "tau_conf", "alpha", "beta", "temperature", "top_p", "min_p"}


def _number(key: str, value: Any) -> Any:
    # JSON has one number type: the API server may hand back 1 for 1.0; the runtime wants floats.
    return float(value) if key in FLOAT_KEYS else value


def render(name: str, namespace: str, spec: dict[str, Any], index: int) -> dict[str, Any]:
    """The config document of group `index` of deployment `name`; `spec` must have its defaults
    applied. Groups differ only in their workers' addresses."""
    # long: the config document, one key after another
    workers = spec["branchParallelism"]
    doc: dict[str, Any] = {
        "model": {
            "path": model_source.model_path(spec),
            "adapter": model_source.adapter_path(spec),
            "dtype": specs.dtype(spec),
            "device": specs.device(spec),
            # Only when the spec sets it (as decoding keys): a group's config, hence its pods, do not
            # change for a spec that leaves it out.
            **({"weights": spec["model"]["weights"]} if spec["model"].get("weights") else {}),
        },
        # Only the keys the spec sets: the runtime fills the others from the model's lopa_defaults.json.
        "decoding": {
            snake: _number(snake, spec["decoding"][camel])
            for camel, snake in DECODING_KEYS.items()
            if spec["decoding"].get(camel) is not None
        },
        "limits": {snake: spec["limits"][camel] for camel, snake in LIMIT_KEYS.items()},
        "master": {"listen": f"0.0.0.0:{names.CLIENT_PORT}", "metrics_port": names.METRICS_PORT},
        "workers": {
            "count": workers,
            "addresses": [
                f"{names.worker_host(name, namespace, index, rank)}:{names.WORKER_PORT}"
                for rank in range(workers)
            ],
            "listen_port": names.WORKER_PORT,
            "metrics_port": names.METRICS_PORT,
            "backend": specs.backend(spec),
            "rendezvous": f"{names.worker_host(name, namespace, index, 0)}:{names.RENDEZVOUS_PORT}",
            "join_timeout_s": spec["collective"]["joinTimeoutSeconds"],
            "step_timeout_s": spec["collective"]["stepTimeoutSeconds"],
            # The group Secret (credentials.py), mounted in every pod of the group.
            "secret_file": f"{names.GROUP_DIR}/secret",
        },
    }
    tls = spec.get("tls")
    if tls:
        # With the client API on TLS the master-worker link is mutual TLS too, on the group's own CA.
        doc["workers"].update(
            tls_cert=f"{names.GROUP_DIR}/tls.crt",
            tls_key=f"{names.GROUP_DIR}/tls.key",
            tls_ca=f"{names.GROUP_DIR}/ca.crt",
        )
        doc["tls"] = {
            "cert": f"{names.TLS_DIR}/tls.crt",
            "key": f"{names.TLS_DIR}/tls.key",
            "client_ca": f"{names.TLS_DIR}/ca.crt" if tls.get("requireClientCert") else "",
        }
        # The kubelet's gRPC readiness probe speaks plaintext: the master repeats its health there.
        doc["master"]["health_port"] = names.HEALTH_PORT
    if (spec.get("service") or {}).get("httpPort"):
        doc["master"]["http_port"] = names.HTTP_PORT  # the Service maps httpPort onto it
        doc["master"]["model_name"] = name  # OpenAI clients name the LoPADeployment as the model
        doc["master"].update(model_aliases=[], access_log=True)  # the runtime's defaults, spelled out
        doc["master"].update(HTTP_BOUNDS)
    doc["master"].update(GRPC_BOUNDS)
    return doc


# The HTTP port's connection bounds, spelled out as the runtime's defaults (docs/lopa.yaml): the
# rendered file says what a pod runs with.
HTTP_BOUNDS = {"http_max_connections": 1024, "http_header_timeout_s": 10.0, "http_keepalive_timeout_s": 75.0,
               "http_body_timeout_s": 30.0, "http_min_body_rate": 16384,
               "http_max_connections_per_client": 256}
# The gRPC client port's connection bounds, likewise.
GRPC_BOUNDS = {"grpc_max_connections": 1024, "grpc_handshake_timeout_s": 10.0, "grpc_idle_timeout_s": 75.0,
               "grpc_max_connection_age_s": 3600.0}


def dump(doc: dict[str, Any]) -> str:
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def digest(*parts: Any) -> str:
    """A short stable hash of JSON-serialisable parts (config text, pod-relevant spec)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
