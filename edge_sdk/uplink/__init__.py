"""The uplink: persistent outbox, the transport interface (in-memory for tests) and the paho-mqtt transport.

Only :mod:`edge_sdk.uplink.mqtt` imports paho.
"""
