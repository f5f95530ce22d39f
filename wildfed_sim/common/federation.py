"""The per-process cache of simulated federations: embedding a seed's images takes a while, and a worker runs many
configurations on the same seed."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["FederationCache"]


class FederationCache:
    """Federations by key (e.g. ``(seed, sites)``), built on first use.

    Args:
        keep_one: hold only the latest federation (memory: a worker moves from seed to seed), else every one.
    """

    def __init__(self, *, keep_one: bool = True) -> None:
        self.keep_one = keep_one
        self._held: dict[Hashable, Any] = {}

    def get(self, key: Hashable, load: Callable[[], Any]) -> Any:
        """The federation of ``key``: the held one, else ``load()`` (after dropping the others when ``keep_one``)."""
        if key not in self._held:
            if self.keep_one:
                self._held.clear()
            self._held[key] = load()
        return self._held[key]

    def held(self, key: Hashable) -> Any | None:
        """The federation of ``key`` if it is held, else None (nothing is loaded)."""
        return self._held.get(key)
