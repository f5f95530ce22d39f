"""The broker's TLS material: the federation's CA, the server certificate and the client certificates.

TLS material is made with ``cryptography`` (RFC 5280 profiles): an ECDSA P-256 CA (basicConstraints CA, pathlen 0,
keyCertSign), a server certificate with the host names and IP addresses as subjectAltName and extendedKeyUsage
serverAuth, client certificates with CN = the broker username and extendedKeyUsage clientAuth.

Re-running keeps what is still good: a leaf certificate is reissued only when it no longer verifies with the CA,
names other host names or common name, or has 30 days or less left.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.broker import BrokerCredentials, role_cert_paths
from shared.errors import ConfigError
from shared.keys import PRIVATE_KEY_MODE, write_file_atomic

__all__ = ["validate_hostname", "ensure_ca", "ensure_leaf", "issue_client_certs"]

_RENEW_BEFORE = _dt.timedelta(days=30)
_DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def validate_hostname(name: str) -> str:
    """A host name (RFC 1123 labels) or an IP address, returned as given.

    Raises:
        ConfigError: anything else (names the ``hostname`` field).
    """
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    labels = name.rstrip(".").split(".") if name else []
    if not labels or len(name) > 253 or not all(_DNS_LABEL.match(label) for label in labels):
        raise ConfigError(f"{name!r} is neither a host name nor an IP address", field="hostname",
                          fix="pass the names clients use to reach the broker, e.g. --hostname broker.example.org "
                          "--hostname 10.0.0.5")
    return name


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load_cert(path: Path) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return None


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey | None:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return None
    return key  # type: ignore[return-value]


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _make_ca(federation_id: str, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "WildFed"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"WildFed broker CA ({federation_id})")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def _issue(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, *, common_name: str, days: int,
           server_names: Sequence[str] | None) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A leaf certificate (RFC 5280): server (``server_names`` as subjectAltName, serverAuth) or client
    (clientAuth)."""
    key = _new_key()
    now = _now()
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "WildFed"),
                                        x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()),  # type: ignore[arg-type]
                              critical=False))
    if server_names is not None:
        alt: list[x509.GeneralName] = []
        for name in server_names:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                alt.append(x509.DNSName(name))
        builder = (builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _san_names(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(v) for v in san.get_values_for_type(x509.DNSName)} | {
        str(v) for v in san.get_values_for_type(x509.IPAddress)}


def _leaf_ok(cert_path: Path, key_path: Path, ca: x509.Certificate, *, common_name: str,
             server_names: Sequence[str] | None) -> bool:
    """Whether an existing leaf certificate can be kept: readable with its key, issued by ``ca``, for the same
    name(s), and valid for more than 30 more days."""
    cert, key = _load_cert(cert_path), _load_key(key_path)
    if cert is None or key is None or not _issued_by(cert, ca):
        return False
    if cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) != \
            key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo):
        return False
    if cert.not_valid_after_utc - _now() < _RENEW_BEFORE:
        return False
    cns = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if server_names is not None:
        wanted = {str(ipaddress.ip_address(n)) if _is_ip(n) else n for n in server_names}
        return _san_names(cert) == wanted
    return cns == [common_name]


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def ensure_leaf(cert_path: Path, key_path: Path, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, *,
                 common_name: str, days: int, server_names: Sequence[str] | None) -> bool:
    """Keep or (re)issue a leaf certificate; returns True when a new one was written."""
    if _leaf_ok(cert_path, key_path, ca, common_name=common_name, server_names=server_names):
        return False
    cert, key = _issue(ca, ca_key, common_name=common_name, days=days, server_names=server_names)
    write_file_atomic(key_path, _key_pem(key), PRIVATE_KEY_MODE)
    write_file_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return True


def ensure_ca(tls_dir: Path, federation_id: str, *, ca_cert: Path | None, ca_key: Path | None,
               days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path]:
    """The CA certificate and key: the operator's (``ca_cert`` + ``ca_key``, copied as ``tls/ca.crt``), else the
    existing ``tls/ca.crt``/``tls/ca.key``, else a new one. Returns ``(cert, key, path of tls/ca.crt)``."""
    out_cert, out_key = tls_dir / "ca.crt", tls_dir / "ca.key"
    if (ca_cert is None) != (ca_key is None):
        raise ConfigError("an existing CA needs both its certificate and its key", field="ca_cert",
                          fix="pass both --ca-cert and --ca-key, or neither (a CA is then generated and kept)")
    if ca_cert is not None and ca_key is not None:
        cert, key = _load_cert(Path(ca_cert)), _load_key(Path(ca_key))
        if cert is None:
            raise ConfigError("not a PEM X.509 certificate", source=ca_cert, field="ca_cert", fix="pass the CA's PEM")
        if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
            raise ConfigError("not an unencrypted PEM EC or RSA private key", source=ca_key, field="ca_key",
                              fix="pass the CA's unencrypted PEM key (EC or RSA)")
        basic = None
        try:
            basic = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            pass
        if basic is None or not basic.ca:
            raise ConfigError("certificate is not a CA (basicConstraints CA:TRUE missing)", source=ca_cert,
                              field="ca_cert", fix="pass a CA certificate (RFC 5280 sec. 4.2.1.9)")
        if cert.public_key().public_bytes(serialization.Encoding.DER,
                                          serialization.PublicFormat.SubjectPublicKeyInfo) != \
                key.public_key().public_bytes(serialization.Encoding.DER,
                                              serialization.PublicFormat.SubjectPublicKeyInfo):
            raise ConfigError("the CA key does not match the CA certificate", source=ca_key, field="ca_key",
                              fix="pass the key of that certificate")
        write_file_atomic(out_cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return cert, key, out_cert
    if out_cert.is_file() and out_key.is_file():
        cert, key = _load_cert(out_cert), _load_key(out_key)
        if cert is None or key is None:
            raise ConfigError("the existing CA in the output folder does not load", source=tls_dir, field="out",
                              fix="restore tls/ca.crt and tls/ca.key, or move them away to make a new CA (every "
                              "gateway then needs the new ca.crt)")
        return cert, key, out_cert
    cert, key = _make_ca(federation_id, days)
    write_file_atomic(out_key, _key_pem(key), PRIVATE_KEY_MODE)
    write_file_atomic(out_cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert, key, out_cert


def issue_client_certs(folder: Path, username: str, roles: Mapping[str, BrokerCredentials],
                       ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, *, days: int) -> list[Path]:
    """Keep or issue the client certificate of an identity (``folder/client.crt``, CN = ``username``) and of each
    of its roles (``folder/roles/<role>/client.crt``, CN = the role's username); returns those (re)issued."""
    issued: list[Path] = []
    wanted = [(folder / "client.crt", folder / "client.key", username)]
    wanted += [(*role_cert_paths(folder / "client.crt", role), c.username) for role, c in sorted(roles.items())]
    for cert, key, cn in wanted:
        cert.parent.mkdir(parents=True, exist_ok=True)
        if ensure_leaf(cert, key, ca, ca_key, common_name=cn, days=days, server_names=None):
            issued.append(cert)
    return issued
