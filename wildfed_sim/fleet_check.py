"""The end of a demo: every gateway holds the coordinator's final model, and says so in its health record.

A gateway keeps each model the coordinator releases (coordinator.model_delivery) and sends a health record when it
does (edge_sdk.uplink.health), so the coordinator's fleet table (coordinator.fleet) shows, for each site, whether the
model it holds is the one released to it. :func:`wait_for_final_models` waits, bounded, until every enrolled site's
record says so, while the gateways still run.
"""

from __future__ import annotations

import time
from typing import Any

from coordinator.fleet import fleet_rows

__all__ = ["wait_for_final_models"]


def wait_for_final_models(coordinator: Any, *, timeout_s: float = 60.0, console: Any = None) -> dict[str, Any]:
    """Wait until each enrolled site's newest health record names the model released to it, or ``timeout_s``.

    Args:
        coordinator: a started :class:`coordinator.service.Coordinator` (its store and registry are read).
        console: a rich console to log the outcome on (None: silent).

    Returns:
        ``{"sites": n, "holding_final_model": k, "missing": [site ids]}``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        rows = fleet_rows(coordinator.store, coordinator.registry)
        missing = sorted(r.site_id for r in rows if r.model_current is not True)
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    out = {"sites": len(rows), "holding_final_model": len(rows) - len(missing), "missing": missing}
    if console is not None:
        console.log(f"gateways holding the coordinator's final model (their health records): "
                    f"{out['holding_final_model']}/{out['sites']}" + (f"; not (yet): {', '.join(missing)}"
                                                                     if missing else ""))
    return out
