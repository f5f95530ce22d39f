"""How readings read (edge_sdk.review.views.reading: every status, written out by hand) and the list's parameters
(edge_sdk.review.query.ListQuery: defaults, refusals naming the parameter, links that keep only what differs)."""

from __future__ import annotations

import pytest

from shared.errors import ConfigError

from edge_sdk.review.query import ListQuery
from edge_sdk.review.views import reading

NAMES = {0: "Lycaon pictus", 1: "Equus quagga", 2: "Panthera leo"}


@pytest.mark.parametrize("status, index, confidence, label, species, guess, badge", [
    ("confident", 0, 0.934, "Lycaon pictus 0.93", "Lycaon pictus", None, None),
    ("unexpected", 2, 0.71, "Panthera leo 0.71", "Panthera leo", None, "unexpected at this site"),
    ("unknown", 1, 0.42, "unknown (best guess Equus quagga 0.42)", None, "Equus quagga", None),
    ("blank", None, None, "blank", None, None, None),
    ("unclassified", None, None, "not classified (no model yet)", None, None, None),
    (None, None, None, "not classified (no model yet)", None, None, None),
    ("confident", 7, 0.9, "class 7 0.90", "class 7", None, None),  # a class without a name
])
def test_readings(status, index, confidence, label, species, guess, badge) -> None:
    r = reading(status, index, confidence, NAMES)
    assert (r["label"], r["species"], r["guess"], r["badge"]) == (label, species, guess, badge)


def test_list_query_parameters() -> None:
    q = ListQuery.parse({})
    assert q == ListQuery("uncertain", "unreviewed", None, None, 1) and q.url() == "/events"
    q = ListQuery.parse({"order": "newest", "deployment": "site-1/river", "status": "", "page": "3"})
    assert q.url() == "/events?order=newest&deployment=site-1%2Friver&page=3"
    assert q.url("/events/e1", page=1, saved="e0") == "/events/e1?order=newest&deployment=site-1%2Friver&saved=e0"
    assert q.params(page=None) == {"order": "newest", "deployment": "site-1/river"}
    for params, name in (({"order": "oldest"}, "order"), ({"show": "some"}, "show"), ({"status": "maybe"}, "status"),
                         ({"page": "0"}, "page"), ({"page": "-1"}, "page"), ({"page": "1e9"}, "page"),
                         ({"page": "9" * 12}, "page")):
        with pytest.raises(ConfigError, match=name) as err:
            ListQuery.parse(params)
        assert err.value.field == name and err.value.fix
