"""What the ranger asked the event list for: order, reviewed or not, deployment, status and page, read from the query
string, written back into links and forms, and used to find the next event to review.

The default is the review queue: unreviewed events, **least certain first** (uncertainty sampling: the events the
model is least sure of are the ones a verdict teaches it most; Settles 2009, "Active Learning Literature Survey",
section 3.1), ``newest`` first on request. After a verdict the ranger goes to the next unreviewed event in the
same order and with the same filters (:func:`next_unreviewed`): the first one after the event just reviewed, or the
first of the queue when none comes after it.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

from shared.errors import ConfigError

from edge_sdk.field.store import EventEntry, FieldStore

__all__ = ["ORDERS", "SHOW", "PAGE_SIZE", "ListQuery", "next_unreviewed"]

ORDERS = ("uncertain", "newest")
#: ``show`` value -> FieldStore's ``reviewed`` argument.
SHOW: dict[str, bool | None] = {"unreviewed": False, "reviewed": True, "all": None}
PAGE_SIZE = 24


@dataclass(frozen=True)
class ListQuery:
    """The event list's parameters.

    Attributes:
        order: one of :data:`ORDERS`. show: one of :data:`SHOW`. deployment: a deployment id or None (all).
        status: one of ``FieldStore.STATUSES`` or None (all). page: 1-based page number.
    """

    order: str = "uncertain"
    show: str = "unreviewed"
    deployment: str | None = None
    status: str | None = None
    page: int = 1

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> "ListQuery":
        """Read the parameters (absent or empty ones take their defaults).

        Raises:
            ConfigError: an unknown order, show or status, or a page that is not a positive integer (the message
                names the parameter and its allowed values).
        """
        order = params.get("order") or "uncertain"
        show = params.get("show") or "unreviewed"
        status = params.get("status") or None
        if order not in ORDERS:
            raise ConfigError(f"order {order!r} is unknown", field="order", fix=f"use one of {', '.join(ORDERS)}")
        if show not in SHOW:
            raise ConfigError(f"show {show!r} is unknown", field="show", fix=f"use one of {', '.join(SHOW)}")
        if status is not None and status not in FieldStore.STATUSES:
            raise ConfigError(f"status {status!r} is unknown", field="status",
                              fix=f"use one of {', '.join(FieldStore.STATUSES)}")
        raw_page = params.get("page") or "1"
        if not raw_page.isdigit() or int(raw_page) < 1 or len(raw_page) > 9:
            raise ConfigError(f"page {raw_page!r} is not a page number", field="page", fix="use 1, 2, 3, ...")
        return cls(order, show, params.get("deployment") or None, status, int(raw_page))

    def params(self, **changes: object) -> dict[str, str]:
        """The non-default parameters, with ``changes`` applied (other keys, such as ``saved``, are added when not
        None), for a link or hidden form fields."""
        values = {"order": self.order, "show": self.show, "deployment": self.deployment, "status": self.status,
                  "page": self.page, **changes}
        defaults = {"order": "uncertain", "show": "unreviewed", "page": 1}
        return {k: str(v) for k, v in values.items() if v is not None and v != defaults.get(k)}

    def url(self, path: str = "/events", **changes: object) -> str:
        """``path`` with these parameters as its query string."""
        q = urllib.parse.urlencode(self.params(**changes))
        return f"{path}?{q}" if q else path

    def events(self, store: FieldStore, page_size: int = PAGE_SIZE) -> tuple[list[EventEntry], int]:
        """This page's events and how many match in all."""
        reviewed = SHOW[self.show]
        total = store.count_events(reviewed=reviewed, deployment_id=self.deployment, status=self.status)
        items = store.events(order=self.order, reviewed=reviewed, deployment_id=self.deployment, status=self.status,
                             limit=page_size, offset=(self.page - 1) * page_size)
        return items, total


def next_unreviewed(store: FieldStore, query: ListQuery, after: str) -> EventEntry | None:
    """The next event to review after ``after`` (module docstring): unreviewed, in ``query``'s order and with its
    deployment and status filters; None when every such event is reviewed."""
    common = {"order": query.order, "reviewed": False, "deployment_id": query.deployment, "status": query.status,
              "limit": 1}
    found = store.events(after=after, **common) or store.events(**common)  # type: ignore[arg-type]
    return found[0] if found else None
