"""WildFed gateway side: local data, training backends, privacy mechanisms, uplink and the agent.

The front door is :class:`edge_sdk.agent.EdgeAgent`, built from a :class:`edge_sdk.config.SiteConfig`.
Sub-packages are imported lazily so that, for example, a radio base station never imports torch.
"""
