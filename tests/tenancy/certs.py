"""A throwaway PKI for the TLS tests, built with ``cryptography``: one CA, a server
certificate for 127.0.0.1 / localhost, and client certificates with a chosen CN and SAN URIs."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path

    def read(self) -> tuple[bytes, bytes]:
        return self.cert.read_bytes(), self.key.read_bytes()


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pair:
    cert_path, key_path = path.with_suffix(".crt"), path.with_suffix(".key")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return Pair(cert_path, key_path)


class CA:
    def __init__(self, directory: Path, name: str = "kv-sidecar test CA") -> None:
        self.dir = directory
        self.key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                              key_encipherment=False, data_encipherment=False, key_agreement=False,
                              encipher_only=False, decipher_only=False),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.pair = _write(directory / name.replace(" ", "-"), self.cert, self.key)

    @property
    def cert_file(self) -> Path:
        return self.pair.cert

    def issue(self, name: str, *, cn: str, dns: tuple[str, ...] = (), ips: tuple[str, ...] = (),
              uris: tuple[str, ...] = (), client: bool = False) -> Pair:
        key = _key()
        now = dt.datetime.now(dt.timezone.utc)
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        sans += [x509.UniformResourceIdentifier(u) for u in uris]
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH]),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return _write(self.dir / name, builder.sign(self.key, hashes.SHA256()), key)

    def server(self) -> Pair:
        return self.issue("server", cn="localhost", dns=("localhost",), ips=("127.0.0.1",))
