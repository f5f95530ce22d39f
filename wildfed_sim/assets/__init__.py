"""Real camera-trap photos shipped with the laboratory (see ``ena24/README.md`` for source and licence)."""
