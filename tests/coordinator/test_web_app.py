"""The web view's server (coordinator.web.app) through FastAPI's TestClient: every route as every role (the access
matrix), what partners may never receive (exact coordinates and names of sensitive deployments, the categories
they recorded, file paths, exact times of sensitive records), sessions and their cookies, CSRF, login throttling,
and that a record with a bad signature appears nowhere.

Expected values come from the seed (tests/coordinator/web_fixtures.py, which reads the real Wildlife Insights
files with the csv module when ../shared/data is present) and from the module docstring's table of routes.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import re
import zipfile

import pytest
from fastapi.testclient import TestClient

from coordinator.storage import DetectionRow, RejectionRow, WebSessionRow
from coordinator.web.app import LOGIN_CSRF_COOKIE, SESSION_COOKIE, create_app
from coordinator.web.auth import AccountStore, LoginThrottle
from coordinator.web.location_privacy import haversine_m
from tests.coordinator.web_fixtures import FORGED_SPECIES, HASHER, PASSWORDS, ROLES, seed

BASE = "https://testserver"


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    return seed(tmp_path_factory.mktemp("web"))


@pytest.fixture(scope="module")
def app(state):
    return create_app(state.config, store=state.store, hasher=HASHER)


def login(app, user: str, password: str | None = None, *, client: TestClient | None = None):
    c = client or TestClient(app, base_url=BASE)
    page = c.get("/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    r = c.post("/login", data={"username": user, "password": password or PASSWORDS[user], "csrf_token": token,
                               "next": "/map"}, follow_redirects=False)
    return c, r


@pytest.fixture(scope="module")
def clients(app):
    out = {}
    for user in ROLES:
        c, r = login(app, user)
        assert r.status_code == 303 and r.headers["location"] == "/map"
        out[ROLES[user]] = c
    out["anonymous"] = TestClient(app, base_url=BASE)
    return out


def csrf_of(client: TestClient) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', client.get("/map").text).group(1)


# ---- the access matrix ------------------------------------------------------------------------------------------
EVERY_ROLE = {"operator": 200, "ranger": 200, "partner": 200, "public": 200}
OPERATOR_ONLY = {"operator": 200, "ranger": 403, "partner": 403, "public": 403}


def matrix(detection_id: int) -> dict[str, tuple[dict[str, int], int]]:
    """GET path -> (status per role, status for an anonymous client). Anonymous pages redirect to the login
    (303); anonymous API and export calls get 401."""
    return {
        "/": ({r: 303 for r in EVERY_ROLE}, 303),
        "/map": (EVERY_ROLE, 303),
        "/detections": (EVERY_ROLE, 303),
        f"/detections/{detection_id}": (EVERY_ROLE, 303),
        f"/detections/{detection_id}/image": ({r: 404 for r in EVERY_ROLE}, 303),  # gateways keep images
        "/species": (EVERY_ROLE, 303),
        "/plots/species.svg": (EVERY_ROLE, 303),
        "/sites": (EVERY_ROLE, 303),
        "/operator/budgets": (OPERATOR_ONLY, 303),
        "/plots/budgets.svg": (OPERATOR_ONLY, 303),
        "/operator/rounds": (OPERATOR_ONLY, 303),
        "/operator/fleet": (OPERATOR_ONLY, 303),
        "/export/camtrap-dp.zip": (EVERY_ROLE, 401),
        "/api/me": (EVERY_ROLE, 401),
        "/api/deployments": (EVERY_ROLE, 401),
        "/api/detections": (EVERY_ROLE, 401),
        f"/api/detections/{detection_id}": (EVERY_ROLE, 401),
        "/api/species-counts": (EVERY_ROLE, 401),
        "/api/sites": (EVERY_ROLE, 401),
        "/api/operator/budgets": (OPERATOR_ONLY, 401),
        "/api/operator/rounds": (OPERATOR_ONLY, 401),
        "/api/operator/fleet": (OPERATOR_ONLY, 401),
        "/login": ({r: 200 for r in EVERY_ROLE}, 200),
        "/healthz": ({r: 200 for r in EVERY_ROLE}, 200),
    }


def test_every_get_route_is_in_the_access_matrix(app, state):
    paths = {re.sub(r"\{[^}]+\}", "1", r.path) for r in app.routes
             if "GET" in getattr(r, "methods", set()) and not r.path.startswith("/static")}
    assert paths == set(matrix(1))


def ref_of(state, role: str, media: str) -> int | str:
    """How ``role`` names the record of ``media``: the row id for rangers and operators, "site~media" for others
    (row ids follow arrival order, which brackets capture times: docs/web.md)."""
    return state.detections[media] if role in ("operator", "ranger") else state.refs[media]


def test_every_route_as_every_role(clients, state):
    media = next(iter(state.detections))
    for role in (*EVERY_ROLE, "anonymous"):
        det = ref_of(state, role, media)
        for path, (per_role, anonymous) in matrix(det).items():
            r = clients[role].get(path, follow_redirects=False)
            expected = anonymous if role == "anonymous" else per_role[role]
            assert r.status_code == expected, (path, role, r.status_code)
            if role == "anonymous" and anonymous == 303 and path != "/":
                assert r.headers["location"].startswith("/login?next=")


def test_partners_and_public_cannot_name_records_by_row_id(clients, state):
    media = next(iter(state.detections))
    for role in ("partner", "public"):
        for path in (f"/detections/{state.detections[media]}", f"/api/detections/{state.detections[media]}"):
            assert clients[role].get(path).status_code == 404, (role, path)
        assert clients[role].get(f"/api/detections/{state.refs[media]}").json()["id"] == state.refs[media]
        ids = [i["id"] for i in clients[role].get("/api/detections").json()["items"]]
        assert ids and all(isinstance(i, str) and "~" in i for i in ids)
    assert clients["ranger"].get(f"/api/detections/{state.refs[media]}").json()["id"] == state.detections[media]


def _everything(client: TestClient, state, role: str = "partner") -> str:
    """Every byte a client can get from every GET route (the export unzipped)."""
    parts = []
    for path in matrix(ref_of(state, role, next(iter(state.detections)))):
        r = client.get(path)
        if path.endswith(".zip") and r.status_code == 200:
            with zipfile.ZipFile(io.BytesIO(r.content)) as z:
                parts += [z.read(n).decode("utf-8") for n in z.namelist()]
        else:
            parts.append(r.text)
    for media in state.detections:
        det = ref_of(state, role, media)
        parts += [client.get(f"/detections/{det}").text, client.get(f"/api/detections/{det}").text]
    return "\n".join(parts)


def _coordinate_strings(value: float) -> set[str]:
    """How an exact coordinate could be written: 5 or 6 decimals (about 1 m) and Python's repr. (Fewer decimals
    match other deployments of the same reserve by chance.)"""
    return {repr(value), f"{value:.5f}", f"{value:.6f}"}


def test_partners_and_public_never_receive_what_places_a_sensitive_deployment(clients, state):
    with state.store.session() as s:
        names = {d: n for d, n in s.execute(__import__("sqlalchemy").text(
            "SELECT deployment_id, location_name FROM deployments"))}
    sensitive = {d: v for d, v in state.deployments.items() if v[2]}
    plain = {d: v for d, v in state.deployments.items() if not v[2]}
    assert sensitive and plain
    used = {r.deployment_id for r in state.store.session().__enter__().query(DetectionRow)}
    for role in ("partner", "public"):
        text = _everything(clients[role], state, role)
        for dep, (lat, lon, _) in sensitive.items():
            # the true position is the pair: one displaced coordinate can match the truth to a metre by chance
            # (the displacement's east-west part is then under a metre), which leaves the point up to 1 km away
            lat_forms, lon_forms = _coordinate_strings(lat), _coordinate_strings(lon)
            found = {s for s in lat_forms | lon_forms if re.search(rf"{re.escape(s)}(?!\d)", text)}
            assert not (found & lat_forms and found & lon_forms), (role, dep, found)
            if names[dep] != dep:  # as a whole token (WI place names are prefixes of the deployment ids)
                assert not re.search(rf"(?<![\w-]){re.escape(names[dep])}(?![\w-])", text), (role, dep, names[dep])
        assert '"categories"' not in text and "IUCN categories recorded" not in text
        # no IUCN category of any record, box or species, on any page, API route or export: it would tell which
        # markers hide a threatened species (docs/location-privacy.md)
        codes = "|".join(("EX", "EW", "CR", "EN", "VU", "NT", "LC", "DD", "NE"))
        assert "iucn_category" not in text and "IUCN" not in text, role
        assert not re.search(rf'"category":\s*"({codes})"', text), role
        assert not re.search(rf"<td>\s*({codes})\s*</td>", text), role
        # the fixture's categories; the CSRF token is random URL-safe base64 and may hold "-LC_" by chance
        bare = re.sub(r'name="csrf_token" value="[^"]*"', 'name="csrf_token" value=""', text)
        assert not re.search(rf"(?<![A-Za-z])(VU|NT|LC)(?![A-Za-z])", bare), role
        assert clients[role].get("/api/detections", params={"category": "VU"}).status_code == 422
        assert clients[role].get("/detections", params={"category": "VU"}).status_code == 422
        assert "IMG_" not in text  # the file path at the site
        # sensitive records carry their date only: no capture time of day of a record at a sensitive deployment
        assert "T06:12:00" not in text and "T22:40:00" not in text
        # non-sensitive deployments stay exact for them
        for dep, (lat, lon, _) in plain.items():
            if dep in used:
                assert f"{lat:.5f}" in text
    ranger = _everything(clients["ranger"], state, "ranger")
    for dep, (lat, lon, _) in sensitive.items():
        assert f"{lat:.5f}" in ranger and f"{lon:.5f}" in ranger
    assert "T06:12:00" in ranger and "IMG_" in ranger
    assert re.search(r'"iucn_category":\s*"VU"', ranger) and re.search(r'"category":\s*"VU"', ranger)
    assert "<td>VU</td>" in ranger


def test_the_api_fuzzes_within_the_radius_and_the_same_way_every_time(clients, state):
    first = {d["deployment_id"]: d for d in clients["partner"].get("/api/deployments").json()}
    again = {d["deployment_id"]: d for d in clients["public"].get("/api/deployments").json()}
    assert first == again
    for dep, (lat, lon, sensitive) in state.deployments.items():
        d = first[dep]
        assert d["fuzzed"] is sensitive
        dist = haversine_m(lat, lon, d["latitude"], d["longitude"])
        # protected: shown at its place's point, within R of the anchor, itself within R + J of it (R = 1 km, J = R/2)
        assert (0 < dist <= 2500.0 and d["radius_m"] == 2500.0) if sensitive else dist == 0.0
    exact = {d["deployment_id"]: d for d in clients["ranger"].get("/api/deployments").json()}
    assert all((exact[d]["latitude"], exact[d]["longitude"]) == v[:2] for d, v in state.deployments.items())


def test_a_record_with_a_bad_signature_appears_nowhere(clients, state):
    with state.store.session() as s:
        assert s.query(RejectionRow).filter_by(reason="bad_signature").count() == 1
        assert s.query(DetectionRow).count() == len(state.detections) == 5
    for role in ("operator", "ranger", "partner", "public"):
        assert FORGED_SPECIES not in _everything(clients[role], state, role)
        assert clients[role].get("/api/detections").json()["total"] == 5


def test_operators_see_budgets_and_rounds_others_do_not_even_as_links(clients):
    assert "/operator/budgets" in clients["operator"].get("/map").text
    for role in ("ranger", "partner", "public"):
        assert "/operator/budgets" not in clients[role].get("/map").text
    rows = clients["operator"].get("/api/operator/budgets").json()
    assert {r["site_id"] for r in rows} == {"site-a", "site-b"} and len(rows) == 2 * 6  # 6 IUCN categories


def test_the_budget_page_shows_the_most_a_record_spent_where_it_exceeds_the_rows(clients, monkeypatch):
    from coordinator.web.routes import operator

    row = {"site_id": "site-a", "category": "LC", "budget": 1.0, "spent": 0.5, "remaining": 0.5, "rounds_left": 2,
           "halted": False, "noise_multiplier": 1.1, "sampling_rate": 0.1, "cohorts_active": 2,
           "cohorts_retired": 1}
    monkeypatch.setattr(operator, "budget_rows", lambda ctx: [{**row, "most_spent": 0.75},
                                                              {**row, "category": "CR", "most_spent": 0.5}])
    text = clients["operator"].get("/operator/budgets").text
    assert text.count("a record: ") == 1 and "a record: 0.750" in text


# ---- filters -----------------------------------------------------------------------------------------------------
def test_filters_select_exactly_the_matching_records(clients, state):
    c = clients["ranger"]
    got = c.get("/api/detections", params={"species": "cuniculus paca"}).json()
    assert got["total"] == 2 and {i["media_id"][:2] for i in got["items"]} == {"a2", "a3"}
    got = c.get("/api/detections", params={"category": "VU"}).json()
    assert [i["media_id"][:2] for i in got["items"]] == ["a1"]
    got = c.get("/api/detections", params={"site": "site-b"}).json()
    assert {i["media_id"][:2] for i in got["items"]} == {"b1", "b2"}
    got = c.get("/api/detections", params={"date_from": "2024-03-10", "date_to": "2024-04-10"}).json()
    assert {i["media_id"][:2] for i in got["items"]} == {"a2", "a3"}
    got = c.get("/api/detections", params={"min_confidence": "0.95"}).json()
    assert got["total"] == 0  # every seeded top confidence is 0.9
    got = c.get("/api/detections", params={"limit": "2", "offset": "1"}).json()
    assert got["total"] == 5 and len(got["items"]) == 2
    # newest capture first
    dates = [i["captured_at"] for i in c.get("/api/detections").json()["items"]]
    assert dates == sorted(dates, reverse=True)


@pytest.mark.parametrize("params,field", [({"category": "XX"}, "category"), ({"date_from": "yesterday"}, "date_from"),
                                          ({"min_confidence": "2"}, "min_confidence"), ({"limit": "0"}, "limit"),
                                          ({"date_from": "2024-05-01", "date_to": "2024-04-01"}, "date_from")])
def test_bad_filters_are_refused_naming_the_field(clients, params, field):
    r = clients["ranger"].get("/api/detections", params=params)
    detail = r.json()["detail"]
    assert r.status_code == 422 and detail.startswith(f"{field}: ") and detail.count(f"{field}:") == 1
    page = clients["ranger"].get("/detections", params=params)
    assert page.status_code == 422 and field in page.text


def test_a_detection_page_shows_its_boxes_and_species(clients, state):
    det = state.detections["a1" * 16]
    item = clients["ranger"].get(f"/api/detections/{det}").json()
    assert item["num_detections"] == 2 and [d["species"] for d in item["detections"]] == ["Tayassu pecari"] * 2
    assert item["category"] == "VU"
    page = clients["ranger"].get(f"/detections/{det}").text
    # box 2 of the 400x300 image: bbox (0.3, 0.2, 0.25, 0.4) -> x 120, y 60, w 100, h 120 pixels
    assert re.search(r'<rect x="120\.0+\d*" y="60\.0+\d*" width="100\.0+\d*" height="120\.0+\d*" class="box"', page)
    assert clients["ranger"].get("/detections/999999").status_code == 404


# ---- sessions, cookies, CSRF, throttling -------------------------------------------------------------------------
def test_the_session_cookie_is_secure_httponly_strict_and_only_its_hash_is_stored(app, state):
    _, r = login(app, "rita")
    cookie = next(h for h in r.headers.get_list("set-cookie") if h.startswith(SESSION_COOKIE + "="))
    flags = {p.strip().lower() for p in cookie.split(";")}
    assert {"httponly", "secure", "samesite=strict", "path=/"} <= flags
    token = cookie.split(";")[0].split("=", 1)[1]
    import hashlib
    with state.store.session() as s:
        stored = {row.token_sha256 for row in s.query(WebSessionRow)}
    assert hashlib.sha256(token.encode()).hexdigest() in stored and token not in stored


def test_login_refuses_a_missing_or_wrong_csrf_token_and_cross_origin_posts(app):
    c = TestClient(app, base_url=BASE)
    assert c.post("/login", data={"username": "rita", "password": PASSWORDS["rita"]}).status_code == 403
    c.get("/login")
    assert c.post("/login", data={"username": "rita", "password": PASSWORDS["rita"],
                                  "csrf_token": "guess"}).status_code == 403
    token = c.cookies.get(LOGIN_CSRF_COOKIE)
    r = c.post("/login", data={"username": "rita", "password": PASSWORDS["rita"], "csrf_token": token},
               headers={"Origin": "https://evil.example"}, follow_redirects=False)
    assert r.status_code == 403 and SESSION_COOKIE not in c.cookies
    r = c.post("/login", data={"username": "rita", "password": PASSWORDS["rita"], "csrf_token": token},
               headers={"Origin": "null"}, follow_redirects=False)  # an opaque origin is never ours
    assert r.status_code == 403 and SESSION_COOKIE not in c.cookies
    r = c.post("/login", data={"username": "rita", "password": PASSWORDS["rita"], "csrf_token": token},
               headers={"Origin": BASE}, follow_redirects=False)  # what a browser sends from our own page
    assert r.status_code == 303 and SESSION_COOKIE in c.cookies


def test_logout_needs_the_session_csrf_token(app):
    c, _ = login(app, "paul")
    assert c.post("/logout", data={"csrf_token": "wrong"}).status_code == 403
    assert c.get("/api/me").json() == {"username": "paul", "role": "partner"}  # still logged in
    r = c.post("/logout", data={"csrf_token": csrf_of(c)}, follow_redirects=False)
    assert r.status_code == 303 and c.get("/api/me").status_code == 401


def test_login_is_throttled_after_repeated_failures_even_with_the_right_password(state):
    now = [0.0]
    throttle = LoginThrottle(max_failures=3, window_s=600, clock=lambda: now[0])
    app = create_app(state.config, store=state.store, hasher=HASHER, throttle=throttle)
    for _ in range(3):
        assert login(app, "rita", "not-the-password")[1].status_code == 401
    c, r = login(app, "rita")
    assert r.status_code == 429 and "Too many failed logins" in r.text and SESSION_COOKIE not in c.cookies
    now[0] = 601.0  # the window has passed
    assert login(app, "rita")[1].status_code == 303


def station(app, address: str) -> TestClient:
    """A browser at client ``address`` (a ranger station's NAT address, say)."""
    return TestClient(app, base_url=BASE, client=(address, 40000))


def test_one_person_failing_cannot_lock_out_a_whole_station_behind_one_address(state):
    """Five failures for one account from the station's address must not lock every account there."""
    app = create_app(state.config, store=state.store, hasher=HASHER)  # the config's limits: 5, and 50 per address
    assert (state.config.web.login_max_failures, state.config.web.login_max_failures_per_address) == (5, 50)
    for _ in range(5):
        assert login(app, "paul", "not-the-password", client=station(app, "10.20.30.40"))[1].status_code == 401
    assert login(app, "paul", client=station(app, "10.20.30.40"))[1].status_code == 429  # paul, there: locked
    for user in ("rita", "olga", "pia"):  # everyone else at the station logs in
        assert login(app, user, client=station(app, "10.20.30.40"))[1].status_code == 303, user
    assert login(app, "paul", client=station(app, "10.9.9.9"))[1].status_code == 303  # paul from elsewhere too


def test_an_address_spraying_many_accounts_meets_the_looser_ceiling(state):
    app = create_app(state.config, store=state.store, hasher=HASHER)
    names = [f"sprayed{i}" for i in range(50)]  # 50 accounts, one wrong password each: no pair reaches 5
    for name in names:
        assert login(app, name, "Winter2024!", client=station(app, "203.0.113.9"))[1].status_code == 401
    r = login(app, "rita", client=station(app, "203.0.113.9"))[1]
    assert r.status_code == 429  # the address is refused for every account, the right password too
    assert login(app, "rita", client=station(app, "198.51.100.1"))[1].status_code == 303


def test_a_session_ends_when_idle_expired_disabled_or_the_password_changes(state):
    now = [_dt.datetime(2026, 1, 1, 12, 0)]
    cfg = state.config.model_copy(update={"web": state.config.web.model_copy(
        update={"session_idle_s": 600.0, "session_ttl_s": 3600.0})})
    app = create_app(cfg, store=state.store, hasher=HASHER, clock=lambda: now[0])
    accounts = AccountStore(state.store, hasher=HASHER)
    accounts.create("sam", "public-password-2", "public")  # its own account: the others' sessions stay
    c, _ = login(app, "sam", "public-password-2")
    now[0] += _dt.timedelta(seconds=599)
    assert c.get("/api/me").status_code == 200
    now[0] += _dt.timedelta(seconds=601)  # idle for more than 600 s
    assert c.get("/api/me").status_code == 401
    c, _ = login(app, "sam", "public-password-2")
    for _ in range(6):  # used every 550 s: never idle, but 3850 s after login the absolute limit has passed
        now[0] += _dt.timedelta(seconds=550)
        assert c.get("/api/me").status_code == 200
    now[0] += _dt.timedelta(seconds=550)
    assert c.get("/api/me").status_code == 401
    c, _ = login(app, "sam", "public-password-2")
    accounts.update("sam", disabled=True)
    assert c.get("/api/me").status_code == 401
    accounts.update("sam", disabled=False)
    c, _ = login(app, "sam", "public-password-2")
    accounts.update("sam", password="a-new-public-password")
    assert c.get("/api/me").status_code == 401


def test_a_role_change_applies_at_the_next_request(app, state):
    accounts = AccountStore(state.store, hasher=HASHER)
    accounts.create("tom", "temporary-password-1", "ranger")
    c, _ = login(app, "tom", "temporary-password-1")
    assert c.get("/api/deployments").json()[0].get("categories") is not None
    accounts.update("tom", role="public")
    assert c.get("/api/me").json()["role"] == "public"
    assert all("categories" not in d for d in c.get("/api/deployments").json())


@pytest.mark.parametrize("target", ["//evil.example/x", "https://evil.example", "/\\evil.example", "map"])
def test_login_never_redirects_off_site(app, target):
    c = TestClient(app, base_url=BASE)
    c.get("/login")
    r = c.post("/login", data={"username": "rita", "password": PASSWORDS["rita"], "next": target,
                               "csrf_token": c.cookies.get(LOGIN_CSRF_COOKIE)}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/map"


def test_security_headers_forbid_scripts_framing_and_caching(clients):
    r = clients["ranger"].get("/map")
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff" and r.headers["cache-control"] == "no-store"
    # not no-referrer: under it Chromium sends "Origin: null" on same-site form posts, which the CSRF check refuses
    assert r.headers["referrer-policy"] == "same-origin"
    assert "<script" not in r.text and "http://" not in r.text.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_the_map_draws_every_deployment_with_its_shown_coordinates(clients, state):
    for role in ("ranger", "partner"):
        shown = {d["deployment_id"]: d for d in clients[role].get("/api/deployments").json()}
        page = clients[role].get("/map").text
        markers = re.findall(r'data-deployment="([^"]+)" data-lat="([^"]+)" data-lon="([^"]+)" '
                             r'data-fuzzed="(true|false)"', page)
        assert {m[0] for m in markers} == set(state.deployments)
        for dep, lat, lon, fuzzed in markers:
            assert float(lat) == pytest.approx(shown[dep]["latitude"], abs=1e-6)
            assert float(lon) == pytest.approx(shown[dep]["longitude"], abs=1e-6)
            assert (fuzzed == "true") is shown[dep]["fuzzed"]


def test_species_counts_and_site_summaries_match_the_seed(clients):
    counts = clients["partner"].get("/api/species-counts").json()
    assert counts == {"Cuniculus paca": {"2024-03": 1, "2024-04": 1}, "Dasypus novemcinctus": {"2024-04": 1},
                      "Tayassu pecari": {"2024-03": 1}}
    sites = {s["site_id"]: s for s in clients["public"].get("/api/sites").json()}
    assert (sites["site-a"]["records"], sites["site-a"]["with_animals"]) == (3, 3)
    assert (sites["site-b"]["records"], sites["site-b"]["with_animals"]) == (2, 1)
    assert json.loads(json.dumps(sites["site-a"]["top_species"])) == [["Cuniculus paca", 2], ["Tayassu pecari", 1]]


def test_the_app_never_fetches_from_the_internet(clients):
    for path in ("/map", "/detections", "/species", "/sites", "/operator/budgets", "/operator/rounds",
                 "/operator/fleet"):
        text = clients["operator"].get(path).text
        assert not re.search(r'(src|href)="(https?:)?//', text), path


def _jpeg_with_gps(path) -> dict:
    """A 64x48 JPEG whose EXIF has a GPS block (latitude 2 deg 14' 26.06" N); returns the GPS tags written."""
    from PIL import Image

    img = Image.new("RGB", (64, 48), (90, 120, 60))
    exif = Image.Exif()
    exif[0x010F] = "Reconyx"  # Make
    gps = {1: "N", 2: (2.0, 14.0, 26.06), 3: "W", 4: (73.0, 46.0, 32.7)}
    exif.get_ifd(0x8825).update(gps)
    img.save(path, "JPEG", exif=exif, quality=95)
    return gps


def test_images_lose_their_gps_for_roles_without_exact_locations(tmp_path):
    from PIL import Image

    from coordinator.web.formats import import_megadetector

    st = seed(tmp_path, real_data=False)
    images = tmp_path / "images"
    images.mkdir()
    gps = _jpeg_with_gps(images / "IMG_0001.JPG")
    batch = {"info": {"format_version": "1.4", "detector": "md_v5a"}, "detection_categories": {"1": "animal"},
             "images": [{"file": "IMG_0001.JPG", "detections": [
                 {"category": "1", "conf": 0.93, "bbox": [0.1, 0.2, 0.3, 0.4]}]}]}
    (tmp_path / "md.json").write_text(json.dumps(batch))
    import_megadetector(st.store, tmp_path / "md.json", site_id="site-a", deployment_id="dep-river",
                        images_dir=images)
    with st.store.session() as s:
        row = s.query(DetectionRow).filter(DetectionRow.source.like("import:%")).one()
    app = create_app(st.config, store=st.store, hasher=HASHER)
    for user, keeps_gps in (("rita", True), ("olga", True), ("paul", False), ("pia", False)):
        det = row.id if keeps_gps else f"{row.site_id}~{row.media_id}"
        c, _ = login(app, user)
        assert f'href="/detections/{det}/image"' in c.get(f"/detections/{det}").text
        r = c.get(f"/detections/{det}/image")
        assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg"
        exif = Image.open(io.BytesIO(r.content)).getexif()
        got = dict(exif.get_ifd(0x8825))
        if keeps_gps:  # rangers and operators get the stored file
            assert got[1] == "N" and [float(x) for x in got[2]] == pytest.approx(list(gps[2]))
            assert exif[0x010F] == "Reconyx"
        else:  # everything but the pixels goes, the camera's make too (tests/coordinator/test_web_media.py)
            assert got == {} and not dict(exif)


def test_places_of_species_the_table_does_not_list_are_protected_by_default(tmp_path):
    from coordinator.web.deployments import import_camtrap_dp, unknown_species

    st = seed(tmp_path, real_data=False, unknown_species="protect")
    pkg = tmp_path / "pkg2"
    pkg.mkdir()
    (pkg / "deployments.csv").write_text("deploymentID,locationName,latitude,longitude\n"
                                         "dep-far,far pan,-2.5000,35.1000\n")
    (pkg / "observations.csv").write_text("observationID,deploymentID,scientificName\no1,dep-far,Mystery beast\n")
    import_camtrap_dp(st.store, pkg, st_category_of(st), site_id="site-a")
    assert unknown_species(st.store, st_category_of(st)) == {"Mystery beast": 1}
    shown = {d["deployment_id"]: d for d in create_app_client(st, "paul").get("/api/deployments").json()}
    assert shown["dep-far"]["fuzzed"] and 0 < haversine_m(-2.5, 35.1, shown["dep-far"]["latitude"],
                                                          shown["dep-far"]["longitude"]) <= 1000.0
    assert not shown["dep-ridge"]["fuzzed"]  # Cuniculus paca: listed, LC
    relaxed = st.config.model_copy(update={"web": st.config.web.model_copy(update={"unknown_species": "ne"})})
    st.config = relaxed
    # the place earned its protection when it was seen protected: a relaxed setting does not lift it ...
    shown = {d["deployment_id"]: d for d in create_app_client(st, "paul").get("/api/deployments").json()}
    assert shown["dep-far"]["fuzzed"]
    # ... an operator's explicit, recorded lift does (coordinator.web.places; tests/coordinator/test_web_places.py)
    from coordinator.web.places import lift, list_places

    place = next(p for p in list_places(st.store) if p.members == ("site-a/dep-far",))
    lift(st.store, [place.place_id], by="olga", reason="Mystery beast is a domestic goat")
    shown = {d["deployment_id"]: d for d in create_app_client(st, "paul").get("/api/deployments").json()}
    assert not shown["dep-far"]["fuzzed"] and (shown["dep-far"]["latitude"], shown["dep-far"]["longitude"]) == (
        -2.5, 35.1)


def st_category_of(st):
    from coordinator.web.deployments import species_table_categories

    return species_table_categories(st.config.species)


def create_app_client(st, user):
    return login(create_app(st.config, store=st.store, hasher=HASHER), user)[0]


def test_partners_get_images_without_the_capture_time_of_protected_places(tmp_path):
    from PIL import Image

    from coordinator.web.formats import import_megadetector

    st = seed(tmp_path, real_data=False)
    images = tmp_path / "images"
    images.mkdir()
    img = Image.new("RGB", (64, 48), (10, 20, 30))
    exif = Image.Exif()
    exif[0x0132] = "2024:05:01 06:12:33"
    exif.get_ifd(0x8769)[0x9003] = "2024:05:01 06:12:33"
    img.save(images / "IMG_0002.JPG", "JPEG", exif=exif)
    batch = {"info": {"format_version": "1.4"}, "detection_categories": {"1": "animal"},
             "classification_categories": {"0": "Tayassu pecari"},
             "images": [{"file": "IMG_0002.JPG", "detections": [
                 {"category": "1", "conf": 0.9, "bbox": [0.1, 0.2, 0.3, 0.4], "classifications": [["0", 0.8]]}]}]}
    (tmp_path / "md.json").write_text(json.dumps(batch))
    import_megadetector(st.store, tmp_path / "md.json", site_id="site-a", deployment_id="dep-river",
                        images_dir=images)
    with st.store.session() as s:
        row = s.query(DetectionRow).filter(DetectionRow.source.like("import:%")).one()
    for user, keeps_time in (("rita", True), ("paul", False)):
        det = row.id if keeps_time else f"{row.site_id}~{row.media_id}"
        c = create_app_client(st, user)
        exif = Image.open(io.BytesIO(c.get(f"/detections/{det}/image").content)).getexif()
        got = (exif.get(0x0132), exif.get_ifd(0x8769).get(0x9003))
        assert got == (("2024:05:01 06:12:33",) * 2 if keeps_time else (None, None)), user
        assert ("06:12:33" in c.get(f"/api/detections/{det}").text) is keeps_time


def test_site_summary_counts_animals_only_and_ignores_records_without_a_time(tmp_path):
    from coordinator.registry import SiteRegistry
    from coordinator.web.formats import import_megadetector
    from shared.keys import generate_signing_key, public_key_to_pem

    st = seed(tmp_path, real_data=False)
    SiteRegistry(st.store).enrol("site-c", public_key_to_pem(generate_signing_key().public_key()))
    batch = {"info": {"format_version": "1.4"}, "detection_categories": {"1": "animal", "2": "person"},
             "images": [{"file": "p.jpg", "datetime": "2024-06-01 10:00:00",
                         "detections": [{"category": "2", "conf": 0.9, "bbox": [0.1, 0.1, 0.2, 0.2]}]},
                        {"file": "x.jpg", "failure": "Failure image access"}]}
    (tmp_path / "md.json").write_text(json.dumps(batch))
    import_megadetector(st.store, tmp_path / "md.json", site_id="site-b", deployment_id="dep-ridge")
    sites = {s["site_id"]: s for s in create_app_client(st, "rita").get("/api/sites").json()}
    # site-b: seeded b1 (armadillo, 2024-04-20) and b2 (blank, 2024-05-01), plus the person (2024-06-01) and the
    # failed image (no time): 4 records, 1 with an animal, 1 failure, dates from the timed records only
    assert (sites["site-b"]["records"], sites["site-b"]["with_animals"], sites["site-b"]["failures"]) == (4, 1, 1)
    assert (sites["site-b"]["first"], sites["site-b"]["last"]) == ("2024-04-20", "2024-06-01")
    assert sites["site-c"] == {"site_id": "site-c", "records": 0, "with_animals": 0, "failures": 0,
                               "deployments": [], "top_species": [], "first": None, "last": None}


def test_deployment_periods_come_from_the_import_and_are_dates_only_at_protected_places(tmp_path):
    import csv as _csv

    from coordinator.web.auth import Role
    from coordinator.web.deployments import import_camtrap_dp
    from coordinator.web.formats import camtrap_dp_files
    from coordinator.web.views import Viewer

    st = seed(tmp_path, real_data=False)
    pkg = tmp_path / "pkg3"
    pkg.mkdir()
    (pkg / "deployments.csv").write_text(
        "deploymentID,locationName,latitude,longitude,deploymentStart,deploymentEnd\n"
        "dep-river,river crossing,-2.3301,34.8302,2024-03-01T08:00:00-05:00,2024-05-31T17:30:00-05:00\n")
    (pkg / "observations.csv").write_text("observationID,deploymentID,scientificName\no1,dep-river,Tayassu pecari\n")
    import_camtrap_dp(st.store, pkg, st_category_of(st), site_id="site-a")
    rows = {}
    for role in (Role.RANGER, Role.PARTNER):
        files = camtrap_dp_files(Viewer.for_config(st.store, role, st.config))
        table = list(_csv.DictReader(io.StringIO(files["deployments.csv"].decode())))
        rows[role] = {r["deploymentID"].removeprefix("site-a/"): r for r in table}  # the package is site-a's
    assert (rows[Role.RANGER]["dep-river"]["deploymentStart"], rows[Role.RANGER]["dep-river"]["deploymentEnd"]) == (
        "2024-03-01T08:00:00-05:00", "2024-05-31T17:30:00-05:00")
    assert (rows[Role.PARTNER]["dep-river"]["deploymentStart"], rows[Role.PARTNER]["dep-river"]["deploymentEnd"]) == (
        "2024-03-01T00:00:00Z", "2024-05-31T00:00:00Z")
    # dep-ridge was imported without a period: its first and last record times, of site-a's one record there (a3
    # of the seed plan; b1 and b2 are site-b's, whose deployments were not imported)
    assert (rows[Role.RANGER]["dep-ridge"]["deploymentStart"], rows[Role.RANGER]["dep-ridge"]["deploymentEnd"]) == (
        "2024-04-02T03:05:00-05:00", "2024-04-02T03:05:00-05:00")
