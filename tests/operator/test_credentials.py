"""The group Secret's data: made once and kept, made again only when it must, and certificates
that a real TLS handshake between the group's master and a worker accepts (no cluster needed)."""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import tempfile
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from lopa_operator import config, credentials, names, pki, render
from lopa_operator import spec as specs

WORKER = "demo-0-worker-1.demo-workers.ns.svc"  # what the master dials (config.render's address)


def stored(data: credentials.Data, trigger: str = "") -> dict:
    """The Secret as the API server would hand it back."""
    return credentials.secret("demo", "ns", 0, data, {"restartTrigger": trigger})


def test_a_fresh_secret_is_random_and_kept_as_it_is() -> None:
    spec = specs.with_defaults({})
    first = credentials.fresh("demo", "ns", 0, tls=False)
    assert set(first) == {"secret"} and len(first["secret"]) == 64
    assert credentials.fresh("demo", "ns", 0, tls=False) != first
    for _ in range(3):  # every reconcile reads it back: the same data, the same hash
        assert credentials.wanted(stored(first), "demo", "ns", 0, spec) == first
    assert credentials.digest(first) == credentials.digest(dict(first))


def test_a_new_restart_trigger_makes_everything_again() -> None:
    spec = specs.with_defaults({"tls": {"secretName": "t"}, "restartTrigger": "2"})
    old = credentials.fresh("demo", "ns", 0, tls=True)
    new = credentials.wanted(stored(old, trigger="1"), "demo", "ns", 0, spec)
    assert new["secret"] != old["secret"] and new["ca.crt"] != old["ca.crt"]
    assert credentials.secret("demo", "ns", 0, new, spec)["metadata"]["annotations"] == {
        names.TRIGGER_ANNOTATION: "2"
    }
    assert credentials.wanted(credentials.secret("demo", "ns", 0, new, spec), "demo", "ns", 0, spec) == new


def test_tls_added_or_dropped_keeps_the_shared_secret() -> None:
    plain = credentials.fresh("demo", "ns", 0, tls=False)
    tls = specs.with_defaults({"tls": {"secretName": "t"}})
    with_tls = credentials.wanted(stored(plain), "demo", "ns", 0, tls)
    assert with_tls["secret"] == plain["secret"]
    assert set(with_tls) == {"secret", "ca.crt", "tls.crt", "tls.key"}
    dropped = credentials.wanted(stored(with_tls), "demo", "ns", 0, specs.with_defaults({}))
    assert dropped == plain


def test_a_certificate_near_its_end_is_issued_again() -> None:
    spec = specs.with_defaults({"tls": {"secretName": "t"}})
    data = credentials.fresh("demo", "ns", 0, tls=True)
    names_ = credentials.dns_names("demo", "ns")
    assert pki.still_good(data["tls.crt"], names_)
    later = dt.datetime.now(dt.timezone.utc) + pki.VALIDITY - pki.RENEW_BEFORE / 2
    assert not pki.still_good(data["tls.crt"], names_, later)
    renewed = credentials.wanted(stored(data), "demo", "ns", 0, spec, now=later)
    assert renewed["secret"] == data["secret"] and renewed["tls.crt"] != data["tls.crt"]
    # A certificate for other names (say the deployment's namespace differs) is not kept either.
    assert not pki.still_good(data["tls.crt"], credentials.dns_names("demo", "other"))


def test_pending_data_is_made_once_until_applied() -> None:
    memo: dict = {}
    spec = specs.with_defaults({"restartTrigger": "x"})
    first = credentials.pending(memo, None, "demo", "ns", 0, spec)
    assert credentials.pending(memo, None, "demo", "ns", 0, spec) == first  # a refused apply renders the same
    applied = stored(first, trigger="x")
    assert credentials.pending(memo, applied, "demo", "ns", 0, spec) == first  # kept once applied
    assert credentials.pending(memo, None, "demo", "ns", 1, spec) != first  # each group its own
    assert credentials.pending(memo, None, "demo", "ns", 0, spec) != first  # deleted after: made anew


def test_the_certificate_serves_both_ends_of_the_link() -> None:
    data = credentials.fresh("demo", "ns", 0, tls=True)
    cert = x509.load_pem_x509_certificate(data["tls.crt"].encode())
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [
        "*.demo-workers.ns.svc", "*.demo-workers.ns.svc.cluster.local"
    ]
    ca = x509.load_pem_x509_certificate(data["ca.crt"].encode())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def _handshake(server: credentials.Data, client: credentials.Data, host: str) -> str:
    """A TLS 1.2+ handshake as the link makes it: the worker serves tls.crt and wants a client
    certificate its CA signed; the master presents its tls.crt and checks the worker's for `host`.
    Returns "" or the error either side saw."""
    with tempfile.TemporaryDirectory() as tmp:
        def files(tag: str, data: credentials.Data) -> tuple[str, str, str]:
            paths = [Path(tmp, f"{tag}-{k}") for k in ("ca.crt", "tls.crt", "tls.key")]
            for path, key in zip(paths, ("ca.crt", "tls.crt", "tls.key"), strict=True):
                path.write_text(data[key])
            return str(paths[0]), str(paths[1]), str(paths[2])

        s_ca, s_cert, s_key = files("worker", server)
        c_ca, c_cert, c_key = files("master", client)
        worker = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        worker.load_cert_chain(s_cert, s_key)
        worker.load_verify_locations(s_ca)
        worker.verify_mode = ssl.CERT_REQUIRED
        master = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        master.load_cert_chain(c_cert, c_key)
        master.load_verify_locations(c_ca)
        left, right = socket.socketpair()
        errors: list[str] = []

        def serve() -> None:
            try:
                with worker.wrap_socket(left, server_side=True) as tls:
                    tls.recv(1)
            except (ssl.SSLError, OSError) as error:
                errors.append(f"worker: {error}")

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            with master.wrap_socket(right, server_hostname=host) as tls:
                tls.sendall(b"x")
        except (ssl.SSLError, OSError) as error:
            errors.append(f"master: {error}")
            left.close()
        thread.join(10)
        return "; ".join(errors)


def test_a_groups_master_and_worker_complete_a_mutual_tls_handshake() -> None:
    group = credentials.fresh("demo", "ns", 0, tls=True)
    assert _handshake(group, group, WORKER) == ""
    assert _handshake(group, group, f"{WORKER}.cluster.local") == ""
    # Another group's certificate (its own CA) is refused both ways, and so is a name outside the
    # headless Service.
    other = credentials.fresh("demo", "ns", 1, tls=True)
    assert "certificate verify failed" in _handshake(group, other, WORKER)
    assert "certificate verify failed" in _handshake(other, group, WORKER)
    assert "Hostname mismatch" in _handshake(group, group, "demo.ns.svc")


def test_config_points_at_the_secrets_keys() -> None:
    spec = specs.with_defaults({"tls": {"secretName": "t"}})
    workers = config.render("demo", "ns", spec, 0)["workers"]
    keys = {k: Path(workers[k]) for k in ("secret_file", "tls_cert", "tls_key", "tls_ca")}
    assert all(p.parent == Path(names.GROUP_DIR) for p in keys.values())
    assert {p.name for p in keys.values()} == {credentials.SECRET, *credentials.TLS_KEYS}
    plain = config.render("demo", "ns", specs.with_defaults({}), 0)["workers"]
    assert plain["secret_file"] == str(keys["secret_file"]) and "tls_cert" not in plain


@pytest.mark.parametrize("tls", [False, True])
def test_rendered_config_with_the_group_secret_loads_in_the_runtime(tls: bool) -> None:
    runtime_config = pytest.importorskip("lopa.serving.shared.config")
    spec = specs.with_defaults({"tls": {"secretName": "t"}} if tls else {})
    loaded = runtime_config.parse_config(config.render("demo", "ns", spec, 0))
    assert loaded.workers.secret_file == f"{names.GROUP_DIR}/secret"
    assert bool(loaded.workers.tls_ca) is tls


def test_pod_templates_carry_the_hash_of_their_groups_secret() -> None:
    data = credentials.fresh("demo", "ns", 0, tls=False)
    children = render.group_children("demo", "ns", {}, 0, data)
    secret, templates = children[0], [c["spec"]["template"] for c in children[2:]]
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "demo-0-group"
    assert credentials.read(secret) == (data, "")
    for template in templates:
        assert template["metadata"]["annotations"][names.SECRET_HASH_ANNOTATION] == credentials.digest(data)
    # The config hash is the spec's alone: the same for every group, whatever their secrets.
    again = render.group_children("demo", "ns", {}, 0, credentials.fresh("demo", "ns", 0, tls=False))
    hashes = {c["spec"]["template"]["metadata"]["annotations"][names.CONFIG_HASH_ANNOTATION]
              for c in children[2:] + again[2:]}
    assert len(hashes) == 1
