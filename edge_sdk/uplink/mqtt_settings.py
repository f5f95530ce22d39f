"""Where the gateway's MQTT transport finds its broker: the broker URL (``mqtt://`` or ``mqtts://``) and, for
TLS files the site config leaves out, the ``broker`` section of the installed firmware profile."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from shared.errors import ConfigError

if TYPE_CHECKING:
    from edge_sdk.config import SiteConfig

__all__ = ["parse_mqtt_url", "parse_mqtt_url_tls"]

_URL_FIX = "use mqtt://host:port, or mqtts://host:port for TLS"


def parse_mqtt_url_tls(url: str) -> tuple[str, int, bool]:
    """``mqtt://host:port`` or ``mqtts://host:port`` -> ``(host, port, tls)``; default ports 1883 / 8883.

    Raises:
        ConfigError: another scheme or no host.
    """
    parsed = urlparse(url)
    if parsed.scheme not in ("mqtt", "mqtts") or not parsed.hostname:
        raise ConfigError(f"bad broker URL {url!r}", field="broker_url", fix=_URL_FIX)
    tls = parsed.scheme == "mqtts"
    return parsed.hostname, parsed.port or (8883 if tls else 1883), tls


def parse_mqtt_url(url: str) -> tuple[str, int]:
    """``mqtt://host:port`` (or ``mqtts://``) -> ``(host, port)``.

    Raises:
        ConfigError: another scheme or no host.
    """
    host, port, _ = parse_mqtt_url_tls(url)
    return host, port


def _profile_broker(config: SiteConfig) -> dict[str, Path | None] | None:
    """The ``broker`` section of the site's firmware profile when ``profile`` is a file (an installed bundle's
    ``profile.yaml``), with paths made absolute against the profile's folder; else None."""
    if not config.profile or not str(config.profile).endswith((".yaml", ".yml")):
        return None
    path = Path(config.profile)
    if not path.is_file():
        return None
    from edge_sdk.profiles import load_profile

    broker = getattr(load_profile(path), "broker", None)
    if broker is None:
        return None

    def absolute(p: Path | None) -> Path | None:
        return None if p is None else (p if Path(p).is_absolute() else (path.parent / p).resolve())

    return {"ca_file": absolute(getattr(broker, "ca_file", None)),
            "client_cert": absolute(getattr(broker, "client_cert", None)),
            "client_key": absolute(getattr(broker, "client_key", None))}
