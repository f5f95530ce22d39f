"""The coordinator's receiving path: what a gateway publishes, checked, stored and acknowledged, one module per idea.

=================== ==========================================================================================
 module              what it holds
=================== ==========================================================================================
 ``reject``          the reason codes (:class:`~coordinator.inbound.reject.RejectReason`), the ``Reject`` a check
                     raises and the ``Rejected`` a handler returns
 ``site_checks``     the checks of every signed site message: size, envelope, topic / federation / site, header
                     ranges, site keys and signature, replay window
 ``transfers``       the entry point of the update topic: size limit, chunked uploads (manifests, chunks,
                     resume receipts, expiry), download receipts; hands whole updates to ``ingest``
 ``staging``         where the chunks of an upload wait (memory or disk)
 ``ingest``          :class:`~coordinator.inbound.ingest.Ingestor`: the update path, with the table of its checks
                     and reason codes
 ``update_checks``   an update's round binding and content checks, and the charging of refused updates
 ``context``         what ingest knows of the open round (``RoundContext``) and its results (``Accepted``,
                     ``Pending``)
 ``replies``         recording refusals and the signed ACKs / receipts sent back to a site
 ``group_commit``    group commit: accepted updates made durable together, its policy built from the config
 ``workers``         scale-out: ingest worker processes on a shared subscription
 ``partial_sums``    the workers' partial sums and the finaliser's merge of them
 ``health``          presence messages and signed health records (the fleet table reads what it stores)
=================== ==========================================================================================

Layering (checked by import-linter, pyproject.toml): this package is below :mod:`coordinator.rounds`, which imports
it (the round manager opens and closes rounds on the ingestor) and is never imported by it; the web view
(:mod:`coordinator.web`) imports neither. Detection records (:mod:`coordinator.detections`) and secure-aggregation
stages (:mod:`coordinator.global_dp`) use its rejections and site checks.

Nothing is re-exported here: import from the module that defines a name.
"""
