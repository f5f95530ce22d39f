"""Signed SDK updates on the gateway: receive a published version, install it beside the running one, check it,
switch, and confirm it or roll it back (docs/gateways.md, "Updating the gateways").

- :mod:`~edge_sdk.updates.layout`: where versions live under the install prefix, the ``current``/``stable`` links
  and the records (standard library only);
- :mod:`~edge_sdk.updates.trial`: a version on trial, confirmed or rolled back (standard library only);
- :mod:`~edge_sdk.updates.launch`: the launcher the systemd unit runs (standard library only);
- :mod:`~edge_sdk.updates.stage`: installing and checking a new version beside the running one;
- :mod:`~edge_sdk.updates.receiver`: the agent's side: the SOFTWARE release from the broker, verified, staged when
  the agent is idle;
- :mod:`~edge_sdk.updates.switch`: the trial begun, the process handed to the launcher.

Nothing is imported here, so that the launcher starts with the standard library alone.
"""
