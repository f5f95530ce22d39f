"""The field loop on a gateway: photos arrive in an incoming folder, are detected, cropped, embedded and classified
with the newest global model, grouped into events and appended to the site's own Camtrap DP package; rangers
review them on site; their verdicts become the verified records that train (docs/field-loop.md).

Modules: :mod:`~edge_sdk.field.predictions` (how a classifier's probabilities are read: threshold, site prior),
:mod:`~edge_sdk.field.events` (photos of one deployment close in time form an event),
:mod:`~edge_sdk.field.incoming` (which files of the incoming folder are complete),
:mod:`~edge_sdk.field.site_package` (appending to the site's Camtrap DP package),
:mod:`~edge_sdk.field.store` (the gateway's index of media, events and verdicts),
:mod:`~edge_sdk.field.verdicts` (a ranger's verdict as human observations),
:mod:`~edge_sdk.field.service` (the loop that ties them together).
"""
