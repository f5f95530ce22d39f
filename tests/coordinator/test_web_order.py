"""The order and the names of records tell partners nothing of a withheld capture time (docs/web.md).

A record at a protected place is shown to partners and the public by its date only. Before the fix the detection
list still sorted it by its full timestamp among the records shown with their time (bracketing it to about 30
minutes in a busy reserve), and its row id (given out in arrival order, and gateways send records as they capture
them) did the same. The test is one of non-interference, through the real HTTP app: two coordinators that differ
only in the time of day of one protected record (05:10 or 20:50 on the same date; records imported in capture
order, so that the row ids differ too) must show a partner byte-identical list pages, record pages and exports,
while a ranger, who may see times, sees the record move.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import zipfile

from coordinator.web.app import create_app
from coordinator.web.formats import import_megadetector
from tests.coordinator.test_web_app import login
from tests.coordinator.web_fixtures import HASHER, seed

DATE = "2024-03-05"
RIDGE_TIMES = ("03:00:00", "09:30:00", "12:00:00", "18:15:00")  # dep-ridge: not protected, times shown


def _coordinator(tmp_path, protected_time: str, secret_from=None):
    """The seeded state plus, on DATE, four records at dep-ridge and one at dep-river (protected: it recorded a
    vulnerable peccary) at ``protected_time``, imported one file each in capture order."""
    st = seed(tmp_path, real_data=False)
    if secret_from is not None:  # the same location secret, so that displaced points agree
        target = st.config.data_dir / "location-secret"
        shutil.copyfile(secret_from, target)
        target.chmod(0o600)
    plan = [("dep-ridge", f"ridge-{t[:2]}.JPG", t) for t in RIDGE_TIMES] + [("dep-river", "river.JPG", protected_time)]
    plan.sort(key=lambda p: p[2])
    for n, (dep, name, when) in enumerate(plan):
        batch = {"info": {"format_version": "1.4"}, "detection_categories": {"1": "animal"},
                 "classification_categories": {"0": "Cuniculus paca"},
                 "images": [{"file": name, "datetime": f"{DATE} {when}", "detections": [
                     {"category": "1", "conf": 0.9, "bbox": [0.1, 0.2, 0.3, 0.4], "classifications": [["0", 0.8]]}]}]}
        path = tmp_path / f"md-{n}.json"
        path.write_text(json.dumps(batch))
        import_megadetector(st.store, path, site_id="site-a", deployment_id=dep)
    return st, create_app(st.config, store=st.store, hasher=HASHER)


def _seen(app, user: str) -> dict[str, object]:
    """What ``user`` is shown: every list page (two records a page, and one page of all), each record as JSON and
    as HTML (CSRF tokens removed), and the export's media and observations tables."""
    c, _ = login(app, user)
    out: dict[str, object] = {}
    everything = c.get("/api/detections", params={"limit": 500}).json()
    out["all"] = everything
    for offset in range(0, everything["total"], 2):
        out[f"page{offset}"] = c.get("/api/detections", params={"limit": 2, "offset": offset}).json()
        html = c.get("/detections", params={"limit": 2, "offset": offset}).text
        out[f"html{offset}"] = re.sub(r'name="csrf_token" value="[^"]+"', "", html)
    for item in everything["items"]:
        out[f"record {item['id']}"] = c.get(f"/api/detections/{item['id']}").json()
        out[f"page {item['id']}"] = re.sub(r'name="csrf_token" value="[^"]+"', "",
                                          c.get(f"/detections/{item['id']}").text)
    with zipfile.ZipFile(io.BytesIO(c.get("/export/camtrap-dp.zip").content)) as z:
        out["media.csv"], out["observations.csv"] = z.read("media.csv"), z.read("observations.csv")
    return out


def test_partners_learn_nothing_of_a_withheld_time_from_order_paging_or_ids(tmp_path):
    early, app_early = _coordinator(tmp_path / "early", "05:10:00")
    late, app_late = _coordinator(tmp_path / "late", "20:50:00",
                                  secret_from=early.config.data_dir / "location-secret")
    for user in ("paul", "pia"):  # partner, public
        a, b = _seen(app_early, user), _seen(app_late, user)
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == b[key], (user, key)
        on_date = [i for i in a["all"]["items"] if i["captured_at"].startswith(DATE)]
        river = [i for i in on_date if i["deployment_id"] == "dep-river" and i["top_species"] == "Cuniculus paca"]
        assert len(river) == 1 and river[0]["captured_at"] == DATE and river[0]["time_withheld"]
        # within the date: the four exact times newest first, then the record shown by its date only
        assert [i["captured_at"][11:19] for i in on_date if not i["time_withheld"]] == sorted(RIDGE_TIMES)[::-1]
        first_withheld = min(n for n, i in enumerate(on_date) if i["time_withheld"])
        assert all(i["time_withheld"] for i in on_date[first_withheld:]) and river[0] in on_date[first_withheld:]

    # a ranger may see the time, and sees the record sorted by it (so the two coordinators really differ)
    def river_position(app) -> int:
        items = login(app, "rita")[0].get("/api/detections", params={"limit": 500}).json()["items"]
        on_date = [i for i in items if i["captured_at"].startswith(DATE)]
        return next(n for n, i in enumerate(on_date) if i["file"] == "river.JPG")

    assert river_position(app_early) == 4 and river_position(app_late) == 0  # newest first
