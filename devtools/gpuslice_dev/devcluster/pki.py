"""Certificates and kubeconfigs for the local control plane.

One CA signs the API server's serving certificate and every client certificate: the admin
(group system:masters), the controller manager and scheduler (their bootstrap RBAC users) and any
tenant identity a test asks for. Client-certificate users are real users to RBAC: CN is the user
name, O entries are the groups.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = dt.timedelta(days=365)


def _write_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _name(cn: str, orgs: Sequence[str] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
    return x509.Name(attrs)


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


class LocalCA:
    """A throw-away CA living in `<dir>/pki`."""

    def __init__(self, pki_dir: Path) -> None:
        self.dir = pki_dir
        self.cert_path = pki_dir / "ca.crt"
        self.key_path = pki_dir / "ca.key"
        if not self.cert_path.exists():
            self._create()
        key = serialization.load_pem_private_key(self.key_path.read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        self._key = key
        self._cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())

    def _create(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        name = _name("gpuslice-devcluster-ca")
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        _write_key(key, self.key_path)
        self.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        stem: str,
        cn: str,
        orgs: Sequence[str] = (),
        *,
        server: bool = False,
        hosts: Sequence[str] = (),
    ) -> CertPair:
        """Issue (or reuse) a certificate `<stem>.crt`/`<stem>.key` in the PKI dir."""
        pair = CertPair(self.dir / f"{stem}.crt", self.dir / f"{stem}.key")
        if pair.cert.exists() and pair.key.exists() and _hosts_of(pair.cert) == set(hosts):
            return pair
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn, orgs))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if hosts:
            sans: list[x509.GeneralName] = []
            for h in hosts:
                try:
                    sans.append(x509.IPAddress(ipaddress.ip_address(h)))
                except ValueError:
                    sans.append(x509.DNSName(h))
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        _write_key(key, pair.key)
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return pair


def _hosts_of(cert_path: Path) -> set[str]:
    """The SANs of an issued certificate, as `issue` takes them (a changed node IP means a new cert)."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(v) for v in sans.get_values_for_type(x509.IPAddress)} | set(
        sans.get_values_for_type(x509.DNSName)
    )


def service_account_keys(pki_dir: Path) -> CertPair:
    """RSA key pair kube-apiserver signs service-account tokens with (cert field holds the public key)."""
    pair = CertPair(pki_dir / "sa.pub", pki_dir / "sa.key")
    if pair.key.exists() and pair.cert.exists():
        return pair
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(key, pair.key)
    pair.cert.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pair


def write_kubeconfig(path: Path, server: str, ca: Path, client: CertPair, user: str) -> Path:
    """A kubeconfig with embedded file paths (not data), so certificates stay in one place."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "gpuslice-dev", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [
            {"name": user, "user": {"client-certificate": str(client.cert), "client-key": str(client.key)}}
        ],
        "contexts": [{"name": f"{user}@gpuslice-dev", "context": {"cluster": "gpuslice-dev", "user": user}}],
        "current-context": f"{user}@gpuslice-dev",
        "preferences": {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path
