"""What the gateway agent does with the coordinator's messages, one module per kind of work (the agent,
:mod:`edge_sdk.agent`, holds the loop and dispatches one parsed, verified envelope at a time):

- :mod:`~edge_sdk.rounds.context`: what every part shares: the site's identity, keys, outbox and the envelope
  checks (signature, kind, addressee);
- :mod:`~edge_sdk.rounds.downloads`: chunked task downloads and the receipts that ask for missing chunks;
- :mod:`~edge_sdk.rounds.tasks`: a task's checks before any training (round, hash, privacy switches);
- :mod:`~edge_sdk.rounds.backends`: which training backend trains a task;
- :mod:`~edge_sdk.rounds.camera`: a camera round (local DP-SGD on the site's verified records);
- :mod:`~edge_sdk.rounds.radio_round`: a radio base station's round;
- :mod:`~edge_sdk.rounds.secagg_client`: a Global DP round (the secure-aggregation client);
- :mod:`edge_sdk.uplink.uploader`: updates out through the outbox, ACKs and receipts in.
"""
