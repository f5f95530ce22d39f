"""The review page (edge_sdk.review) through FastAPI's TestClient, on a site the field loop built
(tests/edge/review/support.py): every route with and without a login, the session cookie's flags, CSRF refusals,
login throttling, the list's order, filters and paging checked against an order computed here, the event page's
photos, boxes and verdict forms, verdicts checked against hand-written observation rows and the training loader,
photos re-encoded without EXIF, and paths outside the package refused."""

from __future__ import annotations

import csv
import io
import re
import sqlite3
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from shared.web_auth import LoginThrottle

from edge_sdk.data.camtrap_dp import load_camtrap_dp
from edge_sdk.field.events import epoch_seconds
from edge_sdk.field.store import FieldStore
from edge_sdk.review.accounts import ReviewAccounts
from edge_sdk.review.app import create_app
from edge_sdk.review.context import LOGIN_CSRF_COOKIE, SESSION_COOKIE
from edge_sdk.site_paths import field_index_path, review_accounts_path
from tests.edge.review.support import BOX, HASHER, PASSWORD, Site, build_site

BASE = "http://gateway.local:8081"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Site:
    """A site nobody changes (read-only tests)."""
    return _with_accounts(build_site(tmp_path_factory.mktemp("review")))


@pytest.fixture
def fresh(tmp_path: Path) -> Site:
    """A site of its own (tests that give verdicts or tamper with files)."""
    return _with_accounts(build_site(tmp_path))


def _with_accounts(site: Site) -> Site:
    accounts = ReviewAccounts(review_accounts_path(site.config), hasher=HASHER)
    accounts.create("rita", PASSWORD)
    accounts.create("sam", PASSWORD)
    accounts.close()
    return site


def _app(site: Site, **kwargs):
    return create_app(site.config, hasher=HASHER, **kwargs)


def csrf_field(html: str) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', html).group(1)


def login(app, user: str = "rita", password: str = PASSWORD, *, next: str = "/events",
          client: TestClient | None = None):
    c = client or TestClient(app, base_url=BASE)
    token = csrf_field(c.get("/login").text)
    r = c.post("/login", data={"username": user, "password": password, "csrf_token": token, "next": next},
               follow_redirects=False)
    return c, r


def logged_in(app, user: str = "rita") -> TestClient:
    c, r = login(app, user)
    assert r.status_code == 303, r.text
    return c


def rows_of(html: str) -> list[str]:
    """Event ids of the list's rows, in page order."""
    return re.findall(r'<tr data-event="([^"]+)"', html)


def observations(site: Site) -> list[dict[str, str]]:
    with (Path(site.config.dataset) / "observations.csv").open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def expected_order(site: Site, order: str, **filters) -> list[str]:
    """The review queue computed here from the index's rows (not by the store's SQL)."""
    store = FieldStore(field_index_path(site.config))
    try:
        events = store.events(reviewed=None, limit=1000, order="newest")
    finally:
        store.close()
    if "status" in filters:
        events = [e for e in events if e.status == filters["status"]]
    if "deployment" in filters:
        events = [e for e in events if e.deployment_id == filters["deployment"]]
    if filters.get("show", "unreviewed") == "unreviewed":
        events = [e for e in events if e.verdict is None]
    key = {"uncertain": lambda e: (-e.uncertainty, -epoch_seconds(e.end), e.event_id),
           "newest": lambda e: (-epoch_seconds(e.end), e.event_id)}[order]
    return [e.event_id for e in sorted(events, key=key)]


# ---- login, sessions, headers ----------------------------------------------------------------------------------
def test_every_route_needs_a_login(built: Site) -> None:
    app = _app(built)
    anon = TestClient(app, base_url=BASE)
    event = built.events["dogs"]
    for path in ("/", "/events", f"/events/{event}", "/events?order=newest"):
        r = anon.get(path, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"].startswith("/login?next="), (path, r.headers)
    assert anon.get(f"/media/{built.media['dogs'][0]}/thumb.jpg").status_code == 401
    before = observations(built)
    r = anon.post(f"/events/{event}/verdict", data={"verdict": "blank"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/login")
    assert anon.post("/logout", follow_redirects=False).headers["location"].startswith("/login")
    assert observations(built) == before  # nothing written
    for path in ("/healthz", "/login", "/static/review.css"):
        assert anon.get(path).status_code == 200, path

    c = logged_in(app)
    for path in ("/events", f"/events/{event}", "/events?show=all&order=newest"):
        r = c.get(path)
        assert r.status_code == 200 and 'id="whoami">rita<' in r.text, path
    assert c.get("/", follow_redirects=False).headers["location"] == "/events"
    r = c.get(f"/media/{built.media['dogs'][0]}/thumb.jpg")
    assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg"
    assert c.get("/events/no-such-event").status_code == 404
    assert c.get("/events?order=random").status_code == 422 and "order" in c.get("/events?order=random").text
    for bad in ("status=maybe", "show=some", "page=0", "page=x"):
        assert c.get(f"/events?{bad}").status_code == 422, bad


def test_login_cookie_flags_redirects_and_logout(built: Site) -> None:
    app = _app(built)
    c, r = login(app, next="/events?order=newest")
    assert r.status_code == 303 and r.headers["location"] == "/events?order=newest"
    cookie = r.headers["set-cookie"].lower()
    assert cookie.startswith(f"{SESSION_COOKIE}=") and "httponly" in cookie and "samesite=strict" in cookie
    assert "path=/" in cookie and "secure" not in cookie  # plain HTTP: a Secure cookie would never come back
    tls = _app(built, secure_cookies=True)
    _, r = login(tls, client=TestClient(tls, base_url="https://gateway.local:8081"))
    assert r.status_code == 303 and "secure" in r.headers["set-cookie"].lower()  # served over TLS
    _, r = login(tls)  # over plain HTTP the browser keeps Secure cookies to itself: the login's CSRF check fails
    assert r.status_code == 403
    _, r = login(app, next="//evil.example/steal")
    assert r.headers["location"] == "/events"  # no open redirect
    _, r = login(app, password="wrong password!!")
    assert r.status_code == 401 and "Wrong user name or password" in r.text and SESSION_COOKIE not in r.cookies

    page = c.get("/events").text
    assert c.post("/logout", data={"csrf_token": "forged"}).status_code == 403
    r = c.post("/logout", data={"csrf_token": csrf_field(page)}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login"
    assert c.get("/events", follow_redirects=False).status_code == 303  # the session is gone


def test_login_form_csrf(built: Site) -> None:
    app = _app(built)
    c = TestClient(app, base_url=BASE)
    token = csrf_field(c.get("/login").text)
    data = {"username": "rita", "password": PASSWORD, "next": "/events"}
    assert c.post("/login", data={**data, "csrf_token": "other"}).status_code == 403
    assert c.post("/login", data={**data, "csrf_token": token},
                  headers={"origin": "http://evil.example"}).status_code == 403
    c.cookies.delete(LOGIN_CSRF_COOKIE)
    assert c.post("/login", data={**data, "csrf_token": token}).status_code == 403
    c2 = TestClient(app, base_url=BASE)
    token = csrf_field(c2.get("/login").text)
    r = c2.post("/login", data={**data, "csrf_token": token}, headers={"origin": BASE}, follow_redirects=False)
    assert r.status_code == 303


def test_login_throttle(built: Site) -> None:
    now = [0.0]
    app = _app(built, throttle=LoginThrottle(max_failures=3, window_s=600, clock=lambda: now[0]))
    for _ in range(3):
        assert login(app, password="wrong password!!")[1].status_code == 401
    _, r = login(app)  # the right password, but throttled
    assert r.status_code == 429 and "Too many failed logins: wait 10 minutes" in r.text
    assert login(app, "sam")[1].status_code == 303  # another ranger at the same station is not locked out
    now[0] = 601.0
    assert login(app)[1].status_code == 303


def test_security_headers_and_a_disabled_account(fresh: Site) -> None:
    app = _app(fresh)
    c = logged_in(app)
    for path in ("/events", f"/media/{fresh.media['dogs'][0]}/view.jpg", "/login"):
        h = c.get(path).headers
        assert "script-src 'none'" in h["content-security-policy"] and h["x-frame-options"] == "DENY", path
        assert h["cache-control"] == "no-store" and h["x-content-type-options"] == "nosniff", path
    accounts = ReviewAccounts(review_accounts_path(fresh.config), hasher=HASHER)
    accounts.update("rita", disabled=True)  # what `wildfed-edge review-user disable rita` does, while serving
    accounts.close()
    assert c.get("/events", follow_redirects=False).status_code == 303


# ---- the list ----------------------------------------------------------------------------------------------------
def test_list_order_filters_readings_and_summary(built: Site) -> None:
    c = logged_in(_app(built))
    ev = built.events
    html = c.get("/events").text
    assert rows_of(html) == expected_order(built, "uncertain")
    assert rows_of(html)[0] == ev["unsure"]  # the least certain event (0.52) first
    assert rows_of(c.get("/events?order=newest").text) == expected_order(built, "newest") == [
        ev["empty"], ev["zebra"], ev["unsure"], ev["lion"], ev["dogs"]]
    assert rows_of(c.get("/events?status=unknown").text) == [ev["unsure"]]
    assert rows_of(c.get("/events?status=confident&order=newest").text) == [ev["zebra"], ev["dogs"]]
    assert rows_of(c.get("/events?deployment=site-1/road").text) == expected_order(built, "uncertain",
                                                                                 deployment="site-1/road")
    assert 'data-unreviewed="5" data-reviewed="0" data-photos="7"' in html
    row = {e: html[html.index(f'<tr data-event="{e}"'):].split("</tr>")[0] for e in ev.values()}
    # the readings, written out by hand
    assert "Lycaon pictus 1.00" in row[ev["dogs"]] and "badge" not in row[ev["dogs"]]
    assert "Panthera leo 1.00" in row[ev["lion"]] and "unexpected at this site</span>" in row[ev["lion"]]
    assert "unknown (best guess Lycaon pictus 0.52)" in row[ev["unsure"]]
    assert ">blank<" in row[ev["empty"]] and "site-1/main" in row[ev["empty"]]
    assert f'/media/{built.media["dogs"][0]}/thumb.jpg' in row[ev["dogs"]]  # the event's first photo
    assert "<td class=\"num\">2</td>" in row[ev["dogs"]] and "2024-05-01T10:00:00+00:00" in row[ev["dogs"]]
    assert "to 2024-05-01T10:00:20+00:00" in row[ev["dogs"]]


def test_list_paging(built: Site) -> None:
    c = logged_in(_app(built, page_size=2))
    expected = expected_order(built, "uncertain")
    pages = [rows_of(c.get(f"/events?page={n}").text) for n in (1, 2, 3)]
    assert pages == [expected[:2], expected[2:4], expected[4:]]
    html = c.get("/events?page=2&order=uncertain").text
    assert 'href="/events?page=3" id="next"' in html and 'href="/events" id="prev"' in html
    assert "page 2 of 3" in html and rows_of(c.get("/events?page=9").text) == []


# ---- the event page ------------------------------------------------------------------------------------------------
def test_event_page_photos_boxes_and_forms(built: Site) -> None:
    c = logged_in(_app(built))
    ev = built.events
    html = c.get(f"/events/{ev['dogs']}").text
    figures = re.findall(r'<figure class="photo" data-media="([^"]+)" data-boxes="(\d+)"', html)
    assert figures == [(m, "1") for m in built.media["dogs"]]  # every photo, in capture order, one box each
    # the square (40, 30)-(80, 70) of a 160 x 120 photo, in the photo's own pixels
    assert html.count('x="40.00" y="30.00" width="40.00" height="40.00"') == 2
    assert 'viewBox="0 0 160 120"' in html
    assert 'id="confirm" class="primary">Confirm: Lycaon pictus<' in html
    assert re.findall(r'<option value="([^"]+)">', html) == ["Equus quagga", "Lycaon pictus"]  # the site's table
    assert re.findall(r'name="verdict" value="(\w+)" id="verdict-', html) == ["blank", "unknown", "person",
                                                                              "vehicle"]
    lion = c.get(f"/events/{ev['lion']}").text
    assert 'id="confirm"' not in lion and 'id="not-in-table"' in lion and 'id="unexpected-badge"' in lion
    assert 'id="confirm"' not in c.get(f"/events/{ev['unsure']}").text
    empty = c.get(f"/events/{ev['empty']}").text
    assert 'id="confirm"' not in empty and 'data-boxes="0"' in empty and "<rect" not in empty
    # the list's parameters ride along in every form
    html = c.get(f"/events/{ev['dogs']}?order=newest&deployment=site-1/river").text
    assert html.count('<input type="hidden" name="order" value="newest">') == 3
    assert html.count('<input type="hidden" name="deployment" value="site-1/river">') == 3


# ---- verdicts ----------------------------------------------------------------------------------------------------
def _post_verdict(c: TestClient, event_id: str, query: str = "", **form) -> object:
    token = csrf_field(c.get(f"/events/{event_id}{query}").text)
    return c.post(f"/events/{event_id}/verdict", data={"csrf_token": token, **form}, follow_redirects=False)


def test_verdicts_write_human_rows_and_go_to_the_next_event(fresh: Site) -> None:
    c = logged_in(_app(fresh))
    ev, media = fresh.events, fresh.media
    before = len(observations(fresh))
    queue = [ev["unsure"], ev["zebra"], ev["dogs"], ev["lion"], ev["empty"]]  # uncertainty 0.48, 1e-5, 3e-7, 4e-9, 0
    assert expected_order(fresh, "uncertain") == queue

    r = _post_verdict(c, ev["dogs"], verdict="species", species="Equus quagga")  # a correction
    assert r.status_code == 303
    assert r.headers["location"] == f"/events/{ev['lion']}?saved={ev['dogs']}"  # the next one after it
    r = _post_verdict(c, ev["zebra"], verdict="species", species="Equus quagga")  # a confirmation
    assert r.headers["location"] == f"/events/{ev['lion']}?saved={ev['zebra']}"  # (the dogs are reviewed)
    r = _post_verdict(c, ev["empty"], verdict="person")
    assert r.headers["location"] == f"/events/{ev['unsure']}?saved={ev['empty']}"  # wraps to the queue's start

    new = observations(fresh)[before:]
    got = [{k: v for k, v in row.items() if v != "" and k not in ("observationID", "classificationTimestamp")}
           for row in new]
    box = dict(zip(("bboxX", "bboxY", "bboxWidth", "bboxHeight"), BOX))
    common = {"observationLevel": "media", "classificationMethod": "human", "classifiedBy": "rita"}
    expected = [
        {"deploymentID": "site-1/river", "mediaID": media["dogs"][0], "eventID": ev["dogs"],
         "eventStart": "2024-05-01T10:00:00+00:00", "eventEnd": "2024-05-01T10:00:00+00:00",
         "observationType": "animal", "scientificName": "Equus quagga", "count": "1", **box, **common},
        {"deploymentID": "site-1/river", "mediaID": media["dogs"][1], "eventID": ev["dogs"],
         "eventStart": "2024-05-01T10:00:20+00:00", "eventEnd": "2024-05-01T10:00:20+00:00",
         "observationType": "animal", "scientificName": "Equus quagga", "count": "1", **box, **common},
        {"deploymentID": "site-1/road", "mediaID": media["zebra"][0], "eventID": ev["zebra"],
         "eventStart": "2024-05-02T11:00:00+00:00", "eventEnd": "2024-05-02T11:00:00+00:00",
         "observationType": "animal", "scientificName": "Equus quagga", "count": "1", **box, **common},
        {"deploymentID": "site-1/main", "mediaID": media["empty"][0], "eventID": ev["empty"],
         "eventStart": "2024-05-03T08:00:00+00:00", "eventEnd": "2024-05-03T08:00:00+00:00",
         "observationType": "human", **common},
    ]
    assert got == expected

    data = load_camtrap_dp(fresh.config.dataset, fresh.config.species_table)
    assert dict(zip(data.media_ids, data.labels.tolist())) == {media["dogs"][0]: 1, media["dogs"][1]: 1,
                                                               media["zebra"][0]: 1}
    html = c.get(f"/events/{ev['unsure']}?saved={ev['empty']}").text
    assert 'id="saved" data-event="' + ev["empty"] + '" data-verdict="person"' in html
    assert 'data-unreviewed="2" data-reviewed="3" data-photos="7"' in html

    # a later verdict supersedes: the dogs were Lycaon after all (re-reviewed from the reviewed list)
    r = _post_verdict(c, ev["dogs"], "?show=reviewed", verdict="species", species="Lycaon pictus", show="reviewed")
    assert r.status_code == 303 and "show=reviewed" in r.headers["location"]
    data = load_camtrap_dp(fresh.config.dataset, fresh.config.species_table)
    assert dict(zip(data.media_ids, data.labels.tolist())) == {media["dogs"][0]: 0, media["dogs"][1]: 0,
                                                               media["zebra"][0]: 1}
    assert 'data-verdict="species"' in c.get(f"/events/{ev['dogs']}").text
    r = _post_verdict(c, ev["unsure"], verdict="unknown")
    r = _post_verdict(c, ev["lion"], verdict="vehicle")
    assert r.headers["location"] == f"/events?saved={ev['lion']}"  # nothing left: back to the (empty) list
    assert "Nothing left to review here." in c.get(r.headers["location"]).text


def test_bad_verdicts_and_forged_posts_write_nothing(fresh: Site) -> None:
    app = _app(fresh)
    c = logged_in(app)
    other = logged_in(app, "sam")
    event = fresh.events["dogs"]
    before = observations(fresh)
    for form, status in (({"verdict": "species", "species": "Panthera leo"}, 422),  # not in the site's table
                         ({"verdict": "species"}, 422), ({"verdict": "maybe"}, 422),
                         ({"verdict": "blank", "species": "Lycaon pictus"}, 422)):
        assert _post_verdict(c, event, **form).status_code == status, form
    assert _post_verdict(c, "no-such-event", verdict="blank").status_code == 404
    url = f"/events/{event}/verdict"
    assert c.post(url, data={"verdict": "blank"}).status_code == 403  # no token
    assert c.post(url, data={"verdict": "blank", "csrf_token": "forged"}).status_code == 403
    sams = csrf_field(other.get("/events").text)
    assert c.post(url, data={"verdict": "blank", "csrf_token": sams}).status_code == 403  # another session's
    mine = csrf_field(c.get("/events").text)
    assert c.post(url, data={"verdict": "blank", "csrf_token": mine},
                  headers={"origin": "http://evil.example"}).status_code == 403
    assert c.post(url, data={"verdict": "blank", "csrf_token": mine}, headers={"origin": "null"}).status_code == 403
    assert observations(fresh) == before
    assert 'data-reviewed="0"' in c.get("/events").text


# ---- photos --------------------------------------------------------------------------------------------------------
def test_photos_are_re_encoded_without_exif(built: Site) -> None:
    c = logged_in(_app(built))
    mid = built.media["dogs"][0]
    original = Image.open(Path(built.config.dataset) / "media" / mid[:2] / f"{mid}.jpg")
    assert original.getexif().get_ifd(0x8769)  # the stored photo has its EXIF
    for size in ("thumb", "view", "full"):
        r = c.get(f"/media/{mid}/{size}.jpg")
        assert r.status_code == 200
        shown = Image.open(io.BytesIO(r.content))
        assert shown.format == "JPEG" and shown.size == (160, 120) and not shown.getexif()
        red = shown.convert("RGB").crop((45, 35, 75, 65))  # inside the square
        assert all(abs(a - b) < 30 for a, b in zip(red.resize((1, 1)).getpixel((0, 0)), (250, 10, 10)))
    assert c.get(f"/media/{mid}/huge.jpg").status_code == 404
    assert c.get("/media/not-a-media-id/thumb.jpg").status_code == 404


@pytest.mark.parametrize("tamper", ["../site.yaml", "/etc/passwd", "media/../../keys/site.key", "link",
                                    "media/missing.jpg"])
def test_paths_outside_the_package_are_refused(fresh: Site, tamper: str) -> None:
    mid = fresh.media["zebra"][0]
    package = Path(fresh.config.dataset)
    path = tamper
    if tamper == "link":  # a link inside the package that leads out of it
        (package / "media" / "out.jpg").symlink_to(fresh.config_path.parent / "keys" / "site.key")
        path = "media/out.jpg"
    with sqlite3.connect(field_index_path(fresh.config)) as db:
        db.execute("UPDATE media SET file_path = ? WHERE media_id = ?", (path, mid))
    c = logged_in(_app(fresh))
    r = c.get(f"/media/{mid}/full.jpg")
    if tamper == "media/missing.jpg":
        assert r.status_code == 404
    else:
        assert r.status_code == 403 and "outside the package" in r.text, (tamper, r.status_code)
        assert b"PRIVATE KEY" not in r.content and b"root:" not in r.content
