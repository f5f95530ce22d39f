"""``python -m coordinator.cli``: the same as ``wildfed-coordinator``."""

from coordinator.cli import app

app()
