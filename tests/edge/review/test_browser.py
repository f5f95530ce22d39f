"""The review page driven by a real headless Chromium: a ranger logs in through the form, opens the least certain
event from the list, corrects it to another species of the site's table, skips one, confirms the model's species on
the next, and the training loader then returns exactly those photos with those labels. Also checked in the browser:
the boxes drawn over each photo sit on the detected square (measured from the rendered page), the cookie's flags,
logout.

The site is built by the field loop's real code (tests/edge/review/support.py). Debian's chromium through
Playwright's executable_path; skipped with a reason when absent (tests/browser_support.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edge_sdk.data.camtrap_dp import load_camtrap_dp
from edge_sdk.review.accounts import ReviewAccounts
from edge_sdk.review.app import create_app
from edge_sdk.review.context import SESSION_COOKIE
from edge_sdk.site_paths import review_accounts_path
from tests.browser_support import LAUNCH_ARGS, UvicornServer, artifacts_dir, require_chromium
from tests.edge.review.support import HASHER, PASSWORD, Site, build_site

pytestmark = pytest.mark.browser

sync_api, CHROMIUM = require_chromium()


@pytest.fixture
def site(tmp_path: Path) -> Site:
    built = build_site(tmp_path)
    accounts = ReviewAccounts(review_accounts_path(built.config), hasher=HASHER)
    accounts.create("rita", PASSWORD)
    accounts.close()
    return built


@pytest.fixture
def server(site: Site) -> Iterator[UvicornServer]:
    srv = UvicornServer(create_app(site.config, hasher=HASHER)).start()
    yield srv
    srv.stop()


@pytest.fixture
def page(server: UvicornServer) -> Iterator[Any]:
    pw = sync_api.sync_playwright().start()
    try:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        ctx = browser.new_context(viewport={"width": 1280, "height": 900})
        p = ctx.new_page()
        p.set_default_timeout(15_000)
        yield p
        browser.close()
    finally:
        pw.stop()


def submit(page: Any, selector: str) -> Any:
    with page.expect_navigation() as nav:
        page.click(selector)
    return nav.value


def box_fractions(page: Any, media_id: str) -> tuple[float, float, float, float]:
    """Where the first box of a photo is drawn, as fractions of the rendered image (measured by the browser)."""
    return tuple(page.evaluate("""m => {
        const fig = document.querySelector(`figure[data-media="${m}"]`);
        const img = fig.querySelector('img').getBoundingClientRect();
        const box = fig.querySelector('rect.box').getBoundingClientRect();
        return [(box.left - img.left) / img.width, (box.top - img.top) / img.height,
                box.width / img.width, box.height / img.height];
    }""", media_id))


def test_ranger_corrects_one_event_and_confirms_another(site: Site, server: UvicornServer, page: Any) -> None:
    base, ev, media = server.base, site.events, site.media
    shots = artifacts_dir("review")

    # log in through the form, arriving from the list's URL
    page.goto(f"{base}/events")
    assert page.url.startswith(f"{base}/login?next=")
    page.fill("#username", "rita")
    page.fill("#password", PASSWORD)
    final = submit(page, "#login-button")
    assert final.status == 200 and page.url == f"{base}/events"
    cookie = next(c for c in page.context.cookies(base) if c["name"] == SESSION_COOKIE)
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"

    # the list: least certain first; the unexpected species carries its badge; every thumbnail decoded
    rows = page.eval_on_selector_all("table#events tr[data-event]", "els => els.map(e => e.dataset.event)")
    assert rows[0] == ev["unsure"] and set(rows) == set(ev.values())
    assert "unexpected at this site" in page.inner_text(f"tr[data-event='{ev['lion']}']")
    page.wait_for_function("[...document.querySelectorAll('td.thumb img')].every(e => e.complete)")  # loaded
    widths = page.eval_on_selector_all("td.thumb img", "els => els.map(e => e.complete && e.naturalWidth)")
    assert widths == [160] * 5
    page.screenshot(path=str(shots / "events.png"), full_page=True)

    # 1. the least certain event: the model could not name it; the ranger picks Equus quagga from the table
    submit(page, f"tr[data-event='{ev['unsure']}'] a.open")
    assert page.url == f"{base}/events/{ev['unsure']}"
    assert page.locator("#confirm").count() == 0  # nothing named, nothing to confirm
    assert page.locator("figure.photo").count() == 2
    for m in media["unsure"]:
        x, y, w, h = box_fractions(page, m)  # the square (40, 30)-(80, 70) of 160 x 120
        assert abs(x - 0.25) < 0.01 and abs(y - 0.25) < 0.01 and abs(w - 0.25) < 0.01 and abs(h - 1 / 3) < 0.01
    page.screenshot(path=str(shots / "event-unsure.png"), full_page=True)
    page.select_option("#species-select", "Equus quagga")
    submit(page, "#species-save")
    assert page.url == f"{base}/events/{ev['zebra']}?saved={ev['unsure']}"  # the next one in the queue
    assert page.get_attribute("#saved", "data-event") == ev["unsure"]

    # 2. skip the zebra; confirm the wild dogs the model named
    submit(page, "#skip")
    assert page.url == f"{base}/events/{ev['dogs']}"
    assert page.inner_text("#confirm").strip() == "Confirm: Lycaon pictus"
    submit(page, "#confirm")
    assert page.url == f"{base}/events/{ev['lion']}?saved={ev['dogs']}"
    assert page.get_attribute("#summary", "data-reviewed") == "2"
    assert page.get_attribute("#summary", "data-unreviewed") == "3"

    # exactly those photos train, with those labels (Equus quagga = class 1, Lycaon pictus = class 0)
    data = load_camtrap_dp(site.config.dataset, site.config.species_table)
    assert dict(zip(data.media_ids, data.labels.tolist())) == {media["unsure"][0]: 1, media["unsure"][1]: 1,
                                                               media["dogs"][0]: 0, media["dogs"][1]: 0}

    submit(page, "#logout-button")
    assert page.url == f"{base}/login"
    page.goto(f"{base}/events")
    assert page.url.startswith(f"{base}/login?")
