"""A group's own certificate authority and the one certificate its master and workers share.

The master-worker link of a group is mutual TLS: each worker serves the certificate, the master
presents the same one as its client certificate, and both sides trust only the group's CA. The
certificate names the workers' DNS names (a wildcard under the headless Service, with and without
the cluster domain) and is usable for both ends (extended key usage serverAuth and clientAuth).
The CA's private key is not kept: a new certificate means a new CA, issued with it.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=3650)
RENEW_BEFORE = dt.timedelta(days=30)  # a certificate this close to its end is issued again
_SKEW = dt.timedelta(minutes=5)  # nodes' clocks may lag the operator's


@dataclass(frozen=True)
class Issued:
    ca_pem: str  # ca.crt
    cert_pem: str  # tls.crt
    key_pem: str  # tls.key (PKCS#8, unencrypted)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "lopa"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])


def issue(common_name: str, dns_names: list[str], now: dt.datetime | None = None) -> Issued:
    """A fresh CA and a certificate it signed for `dns_names` (ECDSA P-256: fast to make, and
    every TLS stack gRPC uses verifies it)."""
    start = (now or dt.datetime.now(dt.timezone.utc)) - _SKEW
    end = start + VALIDITY
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{common_name} CA")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return Issued(
        ca_pem=ca.public_bytes(serialization.Encoding.PEM).decode(),
        cert_pem=cert.public_bytes(serialization.Encoding.PEM).decode(),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode(),
    )


def _key_usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign, crl_sign=cert_sign,
        encipher_only=False, decipher_only=False,
    )


def still_good(cert_pem: str, dns_names: list[str], now: dt.datetime | None = None) -> bool:
    """The certificate parses, names exactly `dns_names` and is valid beyond RENEW_BEFORE."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem.encode())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    when = now or dt.datetime.now(dt.timezone.utc)
    return sorted(names.get_values_for_type(x509.DNSName)) == sorted(dns_names) and (
        cert.not_valid_after_utc - when > RENEW_BEFORE
    )
