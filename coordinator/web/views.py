"""What one viewer may see: every page, API route and export of the web view reads through :class:`Viewer`, so the
rules of each role are written once (docs/web.md; the roles are in :mod:`coordinator.web.auth`).

For a role that does not see exact locations (partner, public), a deployment is *sensitive* when it recorded a
species of a sensitive IUCN category, from either source:

* the species (and categories) its import recorded (``deployments.species_json``/``categories_json``,
  :mod:`coordinator.web.deployments`), or
* the species in the detection records stored for it (``detections.species_json``),

looked up in the federation's species table (the one that sets privacy budgets). A species the table does not list
counts as sensitive unless ``web.unknown_species`` is ``ne`` (fail closed: a table that lags behind what the cameras
record must not expose those places).

Then, for those roles, everything that could place a sensitive deployment is withheld or protected:

============================ ========================================================================
 field                        shown to partner/public
============================ ========================================================================
 coordinates                  displaced within the radius, or the grid-cell centre (``fuzzed`` true): one
                              point per place (:mod:`coordinator.web.places`), neighbours within the radius
                              protected too, protection once earned kept until an operator lifts it
 deployment's location name   replaced by its id (names such as "waterhole north" place a camera)
 IUCN categories recorded     withheld (they would say which markers hide a sensitive species)
 image file path at the site  withheld (folder names often name places)
 capture time of a record     the date only, for records of a sensitive deployment
 event id of a record         withheld with the capture time (a gateway's event id may spell a time or place)
 best guess of an ``unknown``  withheld (it is no species of the record, so it protects no place; shown with
 species                      it, a guess of a CR species would name it at an exact location)
 image metadata               none: re-encoded from the pixels (:func:`coordinator.web.media.strip_metadata`)
============================ ========================================================================

Only records stored by the verified ingest path (a good Ed25519 signature of an enrolled site,
:mod:`coordinator.detections`) or imported by an operator (:mod:`coordinator.web.formats`) are in the table;
rejected ones are in ``rejections`` and no view reads that table except the operator's.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from coordinator.storage import DeploymentRow, DetectionRow, SiteRow, Store, deployment_key
from coordinator.web.auth import Role
from coordinator.config import CoordinatorConfig
from coordinator.web.deployments import CategoryOf, species_table_categories
from coordinator.web.location_privacy import LocationPolicy, load_or_create_secret, protect
from coordinator.web.places import Protection, evaluate, is_sensitive_species
from coordinator.web.filters import (MAX_PAGE_SIZE, REF_SEPARATOR, TIME_NOTES, DetectionFilter, policy_from_config,
                                     time_note)

__all__ = ["DetectionFilter", "Viewer", "MAX_PAGE_SIZE", "REF_SEPARATOR", "TIME_NOTES", "policy_from_config",
           "time_note"]


class Viewer:
    """The web view's data as one role may see it (module docstring).

    Args:
        store: coordinator state. role: the viewer's :class:`~coordinator.web.auth.Role`.
        policy: :class:`~coordinator.web.location_privacy.LocationPolicy`. secret: the location secret (32 bytes).
        category_of: species name -> IUCN category (the federation's species table).
        class_names: the model's class index -> species name (the species table), to name the best guess of a
            box whose species is ``unknown``; a missing index is shown as ``class N``.
    """

    def __init__(self, store: Store, role: Role, *, policy: LocationPolicy, secret: bytes,
                 category_of: CategoryOf, class_names: Mapping[int, str] | None = None) -> None:
        self.store = store
        self.role = role
        self.policy = policy
        self._secret = secret
        self._category_of = category_of
        self._class_names = dict(class_names or {})

    @classmethod
    def for_config(cls, store: Store, role: Role, config: CoordinatorConfig) -> "Viewer":
        """The viewer of a resolved coordinator config: its policy (:func:`policy_from_config`), location secret
        (``web.location_secret_path``, created on first use) and species table.

        Raises:
            ConfigError: the location secret is unreadable or readable by group/others.
        """
        secret_path = config.web.location_secret_path or (Path(config.data_dir) / "location-secret")
        return cls(store, role, policy=policy_from_config(config), secret=load_or_create_secret(secret_path),
                   category_of=species_table_categories(config.species),
                   class_names={e.class_index: e.scientific_name for e in config.species or []})

    # ---- deployments ---------------------------------------------------------------------------------------
    def sensitive_species(self, name: str | None) -> bool:
        """Whether a species' places are protected: its category is sensitive under the policy, or the species
        table does not list it and the policy protects unknown species
        (:func:`coordinator.web.places.is_sensitive_species`)."""
        return is_sensitive_species(name, self.policy, self._category_of)

    def _protection(self) -> Protection:
        """Evaluate (and record) which places are protected (:func:`coordinator.web.places.evaluate`). A
        concurrent writer that created the same place first makes the insert fail: evaluated once more, it is
        then found."""
        for attempt in range(3):
            try:
                with self.store.session() as s:
                    return evaluate(s, self.policy, self._category_of)
            except IntegrityError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def deployments(self) -> list[dict[str, Any]]:
        """Every deployment as this role may see it, by site and id: ``site_id`` (the site whose package it is
        from; ``""`` when unassigned, coordinator.schema_upgrade), ``deployment_id``, ``name``, ``latitude``,
        ``longitude`` (decimal degrees, WGS 84), ``fuzzed``, ``method`` (exact/displace/grid), ``radius_m`` (for
        a displaced point the most it can be from the truth, :attr:`LocationPolicy.shown_within_m`, else 0),
        ``detections`` (records stored), and for rangers and operators ``categories`` (IUCN codes recorded),
        ``unlisted_species`` (recorded species the species table does not list: their category is unknown, not
        "NE"), ``place`` (the id of its protected place, or None) and ``source``; ``start``/``end`` (ISO 8601, the
        date only for a fuzzed place) of the deployment when its import gave them, else None.

        Protection is per *place* (:mod:`coordinator.web.places`): a deployment is protected when it recorded a
        sensitive species, belongs to a place that earned protection (never lifted by a later import), or lies
        within ``policy.radius_m`` of either; every protected deployment of one place (a camera station, however
        often re-deployed) is shown at the place's one point, so co-located deployments cannot be averaged toward
        the truth. Evaluating this records protection earned, for every role.
        """
        protection = self._protection()
        with self.store.session() as s:
            rows = list(s.scalars(select(DeploymentRow).order_by(DeploymentRow.site_id, DeploymentRow.deployment_id)))
            counts = {(site, dep): n for site, dep, n in s.execute(
                select(DetectionRow.site_id, DetectionRow.deployment_id, func.count()).group_by(
                    DetectionRow.site_id, DetectionRow.deployment_id)).all()}
        known = getattr(self._category_of, "known", None)
        out = []
        for r in rows:
            key = deployment_key(r.site_id, r.deployment_id)
            place = protection.place_of.get(key)
            if place is None or self.role.sees_exact_locations:
                shown = protect(r.latitude, r.longitude, deployment_id=key, recorded=set(),
                                exact_allowed=True, policy=self.policy, secret=self._secret)
            else:  # the place's one point, drawn around its fixed anchor
                shown = protect(place.latitude, place.longitude, deployment_id=place.key,
                                recorded=set(self.policy.categories), exact_allowed=False, policy=self.policy,
                                secret=self._secret)
            item: dict[str, Any] = {
                "site_id": r.site_id,
                "deployment_id": r.deployment_id,
                "name": r.deployment_id if shown.fuzzed else (r.location_name or r.deployment_id),
                # a fuzzed point to 1e-5 degrees (about a metre): more digits would only look like precision
                "latitude": round(shown.latitude, 5) if shown.fuzzed else shown.latitude,
                "longitude": round(shown.longitude, 5) if shown.fuzzed else shown.longitude,
                "fuzzed": shown.fuzzed,
                "method": shown.method,
                "radius_m": self.policy.shown_within_m if shown.method == "displace" else 0.0,
                "detections": int(counts.get((r.site_id, r.deployment_id), 0)),
                # the period of a protected place is given by its dates only, like its records' times
                "start": (r.start or "")[:10] if shown.fuzzed else r.start,
                "end": (r.end or "")[:10] if shown.fuzzed else r.end}
            if self.role.sees_exact_locations:
                item["categories"] = sorted(c.value for c in protection.categories.get(key, set()))
                item["unlisted_species"] = sorted(n for n in protection.species.get(key, set())
                                                  if known and not known(n))
                item["place"] = place.place_id if place is not None else None
                item["source"] = r.source
            out.append(item)
        return out

    def _deployment_index(self) -> dict[tuple[str, str], dict[str, Any]]:
        """:meth:`deployments` by ``(site_id, deployment_id)``: a record joins its own site's deployment."""
        return {(d["site_id"], d["deployment_id"]): d for d in self.deployments()}

    # ---- detections ----------------------------------------------------------------------------------------
    def _time_withheld(self, row: DetectionRow, deployments: Mapping[tuple[str, str], dict[str, Any]]) -> bool:
        """Whether this role is shown only the date of ``row``'s capture: a record of a fuzzed place, or (an
        unplaced deployment has no coordinates to fuzz) a record of a sensitive species."""
        dep = deployments.get((row.site_id, row.deployment_id))
        return bool(dep and dep["fuzzed"]) or (not self.role.sees_exact_locations and any(
            self.sensitive_species(n) for n in json.loads(row.species_json or "[]")))

    def record_ref(self, row: DetectionRow) -> int | str:
        """How this role names a record in URLs and JSON: the row id for rangers and operators; for partners and
        the public ``"<site id>~<media id>"``, since row ids are given out in arrival order, and arrival order
        (gateways send records as they are captured) would bracket a withheld capture time between its neighbours'
        exact ones. The media id is a hash of the image (or of its path), so it says nothing of time."""
        return row.id if self.role.sees_exact_locations else f"{row.site_id}{REF_SEPARATOR}{row.media_id}"

    def _box_view(self, d: Mapping[str, Any]) -> dict[str, Any]:
        """One box of a record as this role may see it: its species as the gateway read it (``species_status``),
        and for an ``unknown`` one the classifier's best guess, to roles that see exact locations only (the
        guess is no species of the record, so it does not make its place protected)."""
        status = d.get("species_status")
        box: dict[str, Any] = {"category": d.get("category"), "confidence": d.get("confidence"), "bbox": d.get("bbox"),
                               "species": d.get("species"), "species_confidence": d.get("species_confidence"),
                               "species_status": status, "best_guess": None, "best_guess_confidence": None}
        if status == "unknown":
            box["species_confidence"] = None  # the probability is the guess's, shown with it or not at all
            if self.role.sees_exact_locations:
                index = d.get("species_index")
                box["best_guess"] = (self._class_names.get(index, f"class {index}") if index is not None
                                     else None)
                box["best_guess_confidence"] = d.get("species_confidence")
        if self.role.sees_exact_locations:
            box["iucn_category"] = self._category_of(d["species"]).value if d.get("species") else None
        return box

    def _row_view(self, row: DetectionRow, deployments: Mapping[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
        record = json.loads(row.record_json)
        dep = deployments.get((row.site_id, row.deployment_id))
        fuzzed = bool(dep and dep["fuzzed"])
        top = row.top_species
        sensitive = self._time_withheld(row, deployments)
        boxes = [self._box_view(d) for d in record.get("detections", [])]
        source = record.get("timestamp_source") or ""
        item: dict[str, Any] = {
            "id": self.record_ref(row), "site_id": row.site_id, "media_id": row.media_id, "deployment_id": row.deployment_id,
            "deployment_name": dep["name"] if dep else row.deployment_id,
            "latitude": dep["latitude"] if dep else None, "longitude": dep["longitude"] if dep else None,
            "fuzzed": fuzzed,
            "captured_at": row.captured_at[:10] if sensitive else row.captured_at, "time_withheld": sensitive,
            "num_detections": row.num_detections, "max_confidence": row.max_confidence,
            "top_species": top, "top_species_confidence": row.top_species_confidence,
            "failure": row.failure, "has_image": row.image_sha256 is not None,
            "source": "gateway" if row.source == "gateway" else "import",
            "width": record.get("width"), "height": record.get("height"),
            "detections": boxes,
            # the most confident box's reading: "unknown" (below the site's threshold) or "unexpected" (not in the
            # site's species table) or "confident"; None for records that do not say
            "top_species_status": boxes[0]["species_status"] if boxes else None,
            "top_best_guess": boxes[0]["best_guess"] if boxes else None,
            "time_note": time_note(source),
            # an event id may spell a time or a place: withheld with the time
            "event_id": None if sensitive else record.get("event_id"),
            "detector": record.get("detector", ""),
        }
        if self.role.sees_exact_locations:  # the IUCN category would say which records hide a threatened species
            item["category"] = self._category_of(top).value if top else None
            item["file"] = row.file
            item["timestamp_source"] = record.get("timestamp_source")
        return item

    def _query(self, f: DetectionFilter):  # noqa: ANN202 - a Select
        q = select(DetectionRow)
        if f.site:
            q = q.where(DetectionRow.site_id == f.site)
        if f.species:
            q = q.where(func.lower(DetectionRow.top_species) == f.species.lower())
        if f.min_confidence is not None:
            q = q.where(DetectionRow.max_confidence >= f.min_confidence)
        if f.date_from:
            q = q.where(func.substr(DetectionRow.captured_at, 1, 10) >= f.date_from.isoformat())
        if f.date_to:
            q = q.where(func.substr(DetectionRow.captured_at, 1, 10) <= f.date_to.isoformat())
        return q

    def _matching_rows(self, f: DetectionFilter) -> list[DetectionRow]:
        with self.store.session() as s:
            rows = list(s.scalars(self._query(f).order_by(DetectionRow.captured_at.desc(), DetectionRow.id.desc())))
        if f.category is not None:
            rows = [r for r in rows if r.top_species and self._category_of(r.top_species) is f.category]
        return rows

    def _visible_order(self, rows: list[DetectionRow], deployments: Mapping[tuple[str, str], dict[str, Any]]
                       ) -> None:
        """Sort ``rows`` in place by what this role may see: newest date first; within a date,
        the records shown with their time newest first, then the records shown by date only in the order of
        (site id, media id), a key that says nothing of the withheld time. Sorting those by their full timestamp
        among the others placed each between two exact times, about 30 minutes apart in a busy reserve."""
        withheld = {r.id: self._time_withheld(r, deployments) for r in rows}
        rows.sort(key=lambda r: (r.site_id, r.media_id))
        rows.sort(key=lambda r: ((r.captured_at or "")[:10], not withheld[r.id],
                                 "" if withheld[r.id] else (r.captured_at or "")), reverse=True)  # stable

    def detections(self, f: DetectionFilter = DetectionFilter()) -> tuple[list[dict[str, Any]], int]:
        """One page of records matching ``f`` as this role may see them, and the number that match in all.

        Order: for rangers and operators newest capture first; for partners and the public by what they see
        (:meth:`_visible_order`: newest date first, and within a date the records with a shown time before those
        shown by date only), so neither the order nor the paging reveals a withheld time.

        Each item: ``id`` (:meth:`record_ref`), ``site_id``, ``media_id``, ``deployment_id``, ``deployment_name``,
        ``latitude``/``longitude`` (the deployment's, as shown to this role; None when unknown), ``fuzzed``,
        ``captured_at``, ``num_detections``, ``max_confidence``, ``top_species``, ``top_species_confidence``,
        ``category``, ``failure``, ``has_image``, ``source``, ``width``/``height`` (pixels), ``detections`` (boxes:
        ``bbox`` normalised ``[x_min, y_min, width, height]``, ``confidence``, ``species``, ``species_status``,
        ``best_guess``, ...: :meth:`_box_view`), ``top_species_status`` and ``top_best_guess`` (the most confident
        box's), ``time_note`` (:func:`time_note`: None when the time is the camera's), ``event_id`` (the gateway's
        event, None when absent or when the time is withheld), ``detector``; rangers and operators also get
        ``file`` and ``timestamp_source``."""
        rows = self._matching_rows(f)
        deployments = self._deployment_index()
        if not self.role.sees_exact_locations:
            self._visible_order(rows, deployments)
        page = rows[f.offset:f.offset + f.limit]
        return [self._row_view(r, deployments) for r in page], len(rows)

    def _row(self, ref: int | str) -> DetectionRow | None:
        """The row a reference of this role names (:meth:`record_ref`), or None. Partners and the public cannot
        use row ids (they would enumerate records in arrival order)."""
        text = str(ref).strip()
        with self.store.session() as s:
            if REF_SEPARATOR in text:
                site, _, media = text.rpartition(REF_SEPARATOR)
                return s.scalars(select(DetectionRow).where(DetectionRow.site_id == site,
                                                            DetectionRow.media_id == media)).first()
            if self.role.sees_exact_locations and text.isdigit() and len(text) < 19:
                return s.get(DetectionRow, int(text))
        return None

    def detection(self, ref: int | str) -> dict[str, Any] | None:
        """One record as :meth:`detections` shows it, or None when this role has no record of that reference."""
        row = self._row(ref)
        return None if row is None else self._row_view(row, self._deployment_index())

    def image_sha256(self, ref: int | str) -> str | None:
        """The blob name of a record's image when the coordinator holds one, else None."""
        row = self._row(ref)
        return None if row is None else row.image_sha256

    def species_names(self) -> list[str]:
        """Top species of the stored records, sorted (for the filter form)."""
        with self.store.session() as s:
            return sorted(n for n in s.scalars(select(DetectionRow.top_species).distinct()) if n)

    def site_ids(self) -> list[str]:
        """Sites that have stored records, sorted."""
        with self.store.session() as s:
            return sorted(s.scalars(select(DetectionRow.site_id).distinct()))

    # ---- summaries -----------------------------------------------------------------------------------------
    def species_counts(self) -> dict[str, dict[str, int]]:
        """``{species: {"YYYY-MM": records whose top species it is, captured that month}}`` (records without
        a species are left out). Months, not days: exact days of sensitive species are withheld from some roles."""
        out: dict[str, Counter[str]] = defaultdict(Counter)
        with self.store.session() as s:
            for species, captured in s.execute(select(DetectionRow.top_species, DetectionRow.captured_at)):
                if species:
                    out[species][captured[:7]] += 1
        return {k: dict(sorted(v.items())) for k, v in sorted(out.items())}

    def site_summaries(self) -> list[dict[str, Any]]:
        """Per enrolled site (and any site with records), by id: ``site_id``, ``records``, ``with_animals``
        (records with at least one ``animal`` box), ``failures``, ``deployments`` (ids), ``top_species`` (up to 5
        ``[name, records]``), ``first``/``last`` capture date (None when no record has a time)."""
        per: dict[str, dict[str, Any]] = {}

        def entry(site: str) -> dict[str, Any]:
            return per.setdefault(site, {"site_id": site, "records": 0, "with_animals": 0, "failures": 0,
                                         "deployments": set(), "species": Counter(), "first": None, "last": None})

        with self.store.session() as s:
            for site in s.scalars(select(SiteRow.site_id)):
                entry(site)
            for site, dep, species, captured, failure, record_json in s.execute(select(
                    DetectionRow.site_id, DetectionRow.deployment_id, DetectionRow.top_species,
                    DetectionRow.captured_at, DetectionRow.failure, DetectionRow.record_json)):
                e = entry(site)
                e["records"] += 1
                e["with_animals"] += int(any(d.get("category") == "animal"
                                             for d in json.loads(record_json).get("detections", [])))
                e["failures"] += int(failure is not None)
                e["deployments"].add(dep)
                if species:
                    e["species"][species] += 1
                day = (captured or "")[:10]
                if day:
                    e["first"] = day if e["first"] is None or day < e["first"] else e["first"]
                    e["last"] = day if e["last"] is None or day > e["last"] else e["last"]
        return [{"site_id": site, "records": e["records"], "with_animals": e["with_animals"],
                 "failures": e["failures"], "deployments": sorted(e["deployments"]),
                 "top_species": [list(x) for x in e["species"].most_common(5)], "first": e["first"],
                 "last": e["last"]} for site, e in sorted(per.items())]
