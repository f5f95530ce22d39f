"""The rangers' review page on the gateway (``wildfed-edge review``; docs/review.md): rangers log in on the site's
own network, see the field loop's events least certain first, look at every photo with its detection boxes, and
give a verdict that becomes human observations in the site's Camtrap DP package, the records training uses.

Modules: :mod:`~edge_sdk.review.accounts` (accounts and sessions, ``<state>/review.sqlite``),
:mod:`~edge_sdk.review.query` (the list's order and filters, the next event to review),
:mod:`~edge_sdk.review.views` (readings, photos and verdicts for the templates),
:mod:`~edge_sdk.review.media` (photos from the package, never from outside it, downscaled),
:mod:`~edge_sdk.review.context` (what every route shares), :mod:`~edge_sdk.review.login` (login, logout),
:mod:`~edge_sdk.review.pages` (the pages and the verdict), :mod:`~edge_sdk.review.app` (the app).
Login policy: :mod:`shared.web_auth`, shared with the coordinator's web view.
"""
