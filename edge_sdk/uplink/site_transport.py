"""The gateway's MQTT transport built from its site config (:func:`transport_from_config`): broker URL and failover
nodes, TLS files (the site config's, else the installed profile's), the site's account or a role account from its
broker credentials, and the site's presence (last will and retained online/offline status). The transport itself is
:class:`edge_sdk.uplink.mqtt.MqttTransport`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.broker import load_broker_credentials, role_cert_paths, site_username
from shared.errors import ConfigError
from shared.topics import status_topic

from edge_sdk.uplink.mqtt import MqttTransport
from edge_sdk.uplink.mqtt_settings import _profile_broker, parse_mqtt_url_tls

if TYPE_CHECKING:
    from edge_sdk.config import SiteConfig

__all__ = ["transport_from_config"]


def transport_from_config(config: SiteConfig, *, client_id: str | None = None, presence: bool = True,
                          role: str | None = None) -> MqttTransport:
    """The gateway's :class:`MqttTransport`, built from its site config: broker URL, TLS files, credentials and the
    site's status topic (last will + retained online/offline).

    TLS files come from ``broker_ca_file`` / ``broker_cert_file`` / ``broker_key_file``, else from the installed
    profile's ``broker`` section (``ca_file``, ``client_cert``, ``client_key``) for ``mqtts://`` URLs. The username
    is ``broker_username``, else the one in ``broker_password_file``.

    Args:
        config: the site config.
        client_id: MQTT client id when the broker needs no credentials (default ``wildfed-<federation>-<site>``,
            plus ``-<role>`` for a role). With credentials the client id is the username (module docstring).
        presence: set the last will and publish status (False for a second, auxiliary client of the same site,
            e.g. ``wildfed-edge detect``, whose coming and going says nothing about the gateway). A role client
            never has presence.
        role: a second client of the site (``detect``): its role account from ``broker_password_file``, and
            with a client certificate ``roles/<role>/client.crt`` beside ``broker_cert_file``.

    Raises:
        ConfigError: bad URL, TLS files or credentials file, or no account (or certificate) for ``role``.
    """
    ca, cert, key = config.broker_ca_file, config.broker_cert_file, config.broker_key_file
    tls = parse_mqtt_url_tls(config.broker_url)[2]
    if tls and ca is None and cert is None:
        fallback = _profile_broker(config)
        if fallback:
            ca, cert, key = fallback["ca_file"], fallback["client_cert"], fallback["client_key"]
    username, password = config.broker_username, None
    if role is not None and config.broker_username is not None and config.broker_password_file is None:
        raise ConfigError(f"broker_username {config.broker_username!r} is the gateway's own account; a second "
                          f"client ({role}) on it would disconnect the gateway", field="broker_username",
                          fix="leave broker_username unset and point broker_password_file at the site's "
                          "broker-credentials.yaml from broker-config (it holds the role accounts)")
    if config.broker_password_file is not None:
        own = load_broker_credentials(config.broker_password_file)
        if own.username != site_username(config.site_id):
            raise ConfigError(f"the credentials are for broker user {own.username!r}, this site's is "
                              f"{site_username(config.site_id)!r}: the broker's ACL would drop everything it "
                              "publishes", source=config.broker_password_file, field="broker_password_file",
                              fix=f"use sites/{config.site_id}/broker-credentials.yaml from `wildfed-coordinator "
                              "broker-config`")
        if role is not None:
            creds = load_broker_credentials(config.broker_password_file, role=role)
            username, password = creds.username, creds.password
        else:
            username, password = username or own.username, own.password
    if role is not None and cert is not None:
        cert, key = role_cert_paths(cert, role)
        if not (cert.is_file() and key.is_file()):
            raise ConfigError(f"no client certificate for role {role!r} at {cert}", source=cert,
                              field="broker_cert_file", fix=f"copy roles/{role}/ from sites/{config.site_id}/ of "
                              "broker-config --client-certs beside the site's client.crt")
    presence = presence and role is None
    default_id = f"wildfed-{config.federation_id}-{config.site_id}" + (f"-{role}" if role else "")
    return MqttTransport(config.broker_url, client_id=username or client_id or default_id,
                         ca_file=ca, cert_file=cert, key_file=key, username=username, password=password,
                         status_topic=status_topic(config.federation_id, config.site_id) if presence else None,
                         site_id=config.site_id if presence else None, max_drops=config.max_chunk_requests,
                         broker_max_packet_bytes=config.broker_max_packet_bytes,
                         failover_urls=config.broker_failover_urls)
