"""``wildfed-coordinator``: the operator's command line (typer + rich), for a real federation.

Commands, one module per group of operator tasks::

    status.py      status                             rounds, accepted updates, rejections by reason, halts + why,
                                                      models by digest, links and the round mode they fit
    federation.py  init DIR --federation-id ID        config + coordinator key pair (0600) + database
                   run                                run the configured rounds with a progress bar
                   service [--no-web] [--print-unit]  the long-lived coordinator: ingest at all times, rounds on
                                                      the schedule, the web view (one systemd unit)
                   budget [--accountant rdp|pld] [--plot FILE]
                                                      site x IUCN category: budget, spent, remaining, rounds left;
                                                      textbook / seed formulas beside them (comparison only)
                   ingest-worker --worker-id W        one of N ingest workers (ingest_workers: N; docs/transport.md)
    sites.py       enrol SITE --public-key FILE [--metadata JSON]
                   keys SITE                          a site's keys and their validity
                   rotate-key SITE --public-key FILE [--grace-hours H]   new current key; old one valid H hours
                   revoke-key SITE [--fingerprint F]  revoke one key, or all of the site's
                   provision SITE --profile P ...     a gateway's signed bundle and its enrolment, together
    broker.py      broker-config --out DIR [--hostname H ...] [--client-certs] ...
                                                      Mosquitto 2.x config, ACL, passwords and TLS material from
                                                      the registry (coordinator/broker_config.py, docs/security.md)
    web.py         serve [--host H] [--port P]        the rangers' web view (FastAPI; docs/web.md)
    users.py       user add|list|set-role|set-password|disable|enable (mounted by web.py)
                                                      web-view accounts (Argon2id; coordinator/web/auth.py)
                   import-deployments PATH [--format camtrap-dp|wildlife-insights]   deployments for the map
                   import-detections FILE --site S --deployment D [--images DIR] [--utc-offset +HH:MM]
                                                      MegaDetector batch output for the web view
                   export-camtrap-dp OUT --role R     the detections as a Camtrap DP 1.0 package, as role R sees
                                                      them (sensitive locations fuzzed for partner/public)
                   places list|lift                   the web view's protected places; lift earned protection
    clusters.py    clusters show|recluster|pin        NIRA's clusters (coordinator/strategies/nira.py)
    fleet.py       fleet [--silent-hours H]           the gateways' health: presence, versions, models, backlogs,
                                                      disk, last error; silent sites flagged (coordinator/fleet.py)
                   publish-update [--wheel W]         a new SDK version for the gateways: signed, retained, checked
                                                      and rolled back on the gateway (coordinator/software_delivery.py)

``common.py`` holds what they share (consoles, ``--config``, the error presentation, option parsing); it imports
none of them. Every command but ``init`` reads ``--config`` (default ``$WILDFED_COORDINATOR_CONFIG`` or
``./coordinator.yaml``). User errors (:class:`shared.errors.WildFedError`) print one red line naming the file, field
and fix, and exit with status 2.

The laboratory's commands (the demo, the experiments, the privacy audit, the metadata checks) are ``wildfed``'s
(wildfed_sim/cli.py): they run both sides on one machine, so they are not the operator's.
"""

from __future__ import annotations

import typer

from coordinator.cli import broker, clusters, federation, fleet, sites, status, web

__all__ = ["app"]

app = typer.Typer(name="wildfed-coordinator", help="WildFed coordinator: federated rounds, ledger, registry.",
                  no_args_is_help=True, add_completion=False)
for _group in (federation, status, sites, broker, web, fleet):
    app.add_typer(_group.app)  # no name: the group's commands stand at the top level (typer >= 0.15)
app.add_typer(clusters.app, name="clusters")
