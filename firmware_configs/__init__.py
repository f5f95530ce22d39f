"""Gateway profiles, one YAML file per gateway kind (see docs/gateways.md).

A package only so that the profiles travel inside the wheel: an installed gateway finds them next to ``shared``
(``shared.profiles.PROFILES_DIR``), exactly where a source checkout has them.
"""
