"""Protected places: one displaced point per camera station, and protection that no later import lifts
(docs/location-privacy.md).

A *place* is what partners and the public see of one camera station. It has a fixed **anchor**: the true position
of the deployment that first made it protected, stored in the ``protected_places`` table (coordinator.storage) and
never moved. Every protected deployment belongs to exactly one place and is shown at the place's one displaced point
(:func:`coordinator.web.location_privacy.displace` of the anchor, keyed on the anchor), or the centre of the
anchor's grid cell. So a station re-deployed thirty times, each time with about 15 m of GPS jitter, shows one point,
not thirty independent ones whose average lands near the truth (the trial: 30 points 635 m off each, their average
85 m off).

A **core** deployment (one that recorded a sensitive species, or a member within J of the anchor of a place that
earned protection) joins, in this order:

1. the place it joined before, while it is still within the join distance J of that place's anchor;
2. else the place whose anchor is nearest, if within J: ``PLACE_JOIN_FRACTION`` (0.5,
   :mod:`coordinator.web.location_privacy`) of the protection radius R, 500 m for the default 1 km;
3. else a new place anchored at its own position.

A **neighbour** (protected only because it lies within R of a core deployment or of an earned place's anchor)
joins the place of the nearest such core deployment or anchor, and keeps it while within R + J of that anchor and
the place is still protected. So one protected area shows one point: the trial's 5 x 5 grid of cameras 200 m
apart around one CR camera used to give 25 places, 25 displaced points whose mean was 60 m from the CR camera.

Why J = R/2: the shown point of a place is its anchor plus one fixed offset, so every
member shows the same point and averaging members gains nothing; only a deployment beyond J starts a second,
independent point. At J = R/10 (100 m) a station re-deployed 30 times with 60 m of GPS jitter got 4 points whose
mean was 75 m from the truth; at R/2 the jitter would have to be 500 m. The bound that J costs: a core member is
within J of the anchor and a neighbour within R + J, and the point is within R of the anchor, so every protected
deployment is shown within R + J + R of its true position (2.5 km for the default; half a grid cell's diagonal
+ J + R for the grid method): :attr:`LocationPolicy.shown_within_m`, one number for all of them so that it does not
tell neighbours from sensitive deployments; the map's dashed circle, the API's ``radius_m`` and Camtrap DP
``coordinateUncertainty`` say so.
Location names (Camtrap DP ``locationName``, Wildlife Insights ``placename``) are not used to join: they are not
unique across packages ("CAM01"), and a name that joined deployments far apart would break that bound. The anchor
is stored, not recomputed: a centroid or a "first by id" would move as re-deployments arrive, and each move would
give the station a new, independent point.

**Protection is earned, and kept.** A place *earns* protection when one of its deployments is found to have
recorded a sensitive species (its import's species or categories, or its detection records: the same test as
before, :func:`is_sensitive_species`), and keeps it whatever later imports say: re-importing a package without its
CR observation used to make every place exact again, name included. Only an operator's explicit act lifts it
(:func:`lift`, ``wildfed-coordinator places lift``), which is logged and kept on the row (who, when, why); a place
whose data still records a sensitive species earns protection again at once. Protection is evaluated, and earned, by
every view (:class:`coordinator.web.views.Viewer`) and by ``import-deployments`` / ``import-detections`` *before*
they write (inside the same transaction), so a re-import cannot erase evidence nobody looked at yet.

Which deployments are protected (for roles without exact locations):

* a deployment that recorded a sensitive species now, or that belongs to a place with earned protection (*core*);
* any deployment within ``radius_m`` of a core deployment or of an earned place's anchor (a neighbour shown exactly
  would point at it). A neighbour joins that place (its one point) but earns nothing: its protection ends when
  the protection near it is lifted.
"""

from __future__ import annotations

import bisect
import datetime as _dt
import json
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.errors import ConfigError
from shared.iucn import IUCNCategory

from coordinator.storage import DeploymentRow, DetectionRow, PlaceRow, Store, deployment_key, utcnow
from coordinator.web.location_privacy import EARTH_RADIUS_M, PLACE_JOIN_FRACTION, LocationPolicy, haversine_m

__all__ = ["PLACE_JOIN_FRACTION", "Place", "Protection", "PlaceError", "is_sensitive_species", "evaluate",
           "list_places", "lift"]

log = logging.getLogger(__name__)



class PlaceError(ConfigError):
    """A place operation was refused (unknown place id, missing reason or operator name)."""


@dataclass(frozen=True)
class Place:
    """A protected place (module docstring).

    Attributes:
        place_id: row id. latitude, longitude: the anchor, true WGS 84 decimal degrees (never shown to partners).
        location_name: the anchor deployment's location name. members: the keys
            (:func:`coordinator.storage.deployment_key`, ``"<site>/<deployment>"``) of the deployments that belong to
            it.
        earned: whether its protection is earned now (earned after its last lift, if any).
        earned_at, lifted_at: naive UTC or None. earned_reason, lifted_by, lift_reason: text ("" when none).
    """

    place_id: int
    latitude: float
    longitude: float
    location_name: str
    members: tuple[str, ...]
    earned: bool
    earned_at: _dt.datetime | None
    earned_reason: str
    lifted_at: _dt.datetime | None
    lifted_by: str
    lift_reason: str

    @property
    def key(self) -> str:
        """The displacement key: the anchor itself, so the point depends on nothing that can change later."""
        return f"place:{self.latitude:.7f},{self.longitude:.7f}"

    @classmethod
    def of(cls, row: PlaceRow) -> "Place":
        """The :class:`Place` of a ``protected_places`` row."""
        return cls(place_id=row.id, latitude=row.latitude, longitude=row.longitude,
                   location_name=row.location_name or "", members=tuple(json.loads(row.members_json or "[]")),
                   earned=_earned(row), earned_at=row.earned_at, earned_reason=row.earned_reason or "",
                   lifted_at=row.lifted_at, lifted_by=row.lifted_by or "", lift_reason=row.lift_reason or "")


@dataclass(frozen=True)
class Protection:
    """What :func:`evaluate` decided for every deployment with coordinates.

    Attributes:
        place_of: protected deployment's key (:func:`coordinator.storage.deployment_key`) -> its :class:`Place`.
        sensitive: keys of the deployments that recorded a sensitive species (from the data as it is now).
        species, categories: deployment key -> species recorded / IUCN categories recorded (its imports and its
            own site's records).
    """

    place_of: dict[str, Place]
    sensitive: frozenset[str]
    species: dict[str, set[str]]
    categories: dict[str, set[IUCNCategory]]


def _earned(row: PlaceRow) -> bool:
    return row.earned_at is not None and (row.lifted_at is None or row.earned_at > row.lifted_at)


def is_sensitive_species(name: str | None, policy: LocationPolicy, category_of: Callable[[str], IUCNCategory]) -> bool:
    """Whether a species' places are protected: its category (the federation's species table) is one of
    ``policy.categories``, or the table does not list it (``category_of.known``) and ``policy.protect_unknown``."""
    if not name:
        return False
    if category_of(name) in policy.categories:
        return True
    known = getattr(category_of, "known", None)
    return bool(policy.protect_unknown and known is not None and not known(name))


class _Near:
    """Points (lat, lon, payload) searchable by distance: only those in the latitude band are measured."""

    def __init__(self, points: Iterable[tuple[float, float, object]]) -> None:
        self._pts = sorted(points, key=lambda p: p[0])
        self._lats = [p[0] for p in self._pts]

    def add(self, lat: float, lon: float, payload: object) -> None:
        i = bisect.bisect_left(self._lats, lat)
        self._lats.insert(i, lat)
        self._pts.insert(i, (lat, lon, payload))

    def within(self, lat: float, lon: float, distance_m: float) -> list[tuple[float, object]]:
        """``[(distance in metres, payload), ...]`` of the points within ``distance_m``, nearest first."""
        band = math.degrees(distance_m / EARTH_RADIUS_M) + 1e-9
        lo, hi = bisect.bisect_left(self._lats, lat - band), bisect.bisect_right(self._lats, lat + band)
        found = [(haversine_m(lat, lon, p[0], p[1]), p[2]) for p in self._pts[lo:hi]]
        return sorted(((d, p) for d, p in found if d <= distance_m), key=lambda x: x[0])


def _key(r: DeploymentRow) -> str:
    return deployment_key(r.site_id, r.deployment_id)


def _evidence(s: Session, rows: list[DeploymentRow], category_of: Callable[[str], IUCNCategory]
              ) -> tuple[dict[str, set[str]], dict[str, set[IUCNCategory]]]:
    """Per deployment key: the species its import and its own site's records recorded, and their categories."""
    detected: dict[str, set[str]] = defaultdict(set)
    for site, dep, species_json in s.execute(select(DetectionRow.site_id, DetectionRow.deployment_id,
                                                    DetectionRow.species_json).distinct()):
        detected[deployment_key(site, dep)].update(json.loads(species_json or "[]"))
    species = {_key(r): set(json.loads(r.species_json or "[]")) | detected.get(_key(r), set()) for r in rows}
    categories = {_key(r): {IUCNCategory(c) for c in json.loads(r.categories_json or "[]")}
                  | {category_of(n) for n in species[_key(r)]} for r in rows}
    return species, categories


def evaluate(s: Session, policy: LocationPolicy, category_of: Callable[[str], IUCNCategory], *,
             now: _dt.datetime | None = None) -> Protection:
    """Decide which deployments are protected, give each a place, and record protection earned (module
    docstring). Writes to ``protected_places`` in the caller's session ``s`` (committed with it); idempotent.

    Args:
        s: an open SQLAlchemy session of the coordinator's store.
        policy: the location policy (radius, sensitive categories, unknown species).
        category_of: the federation's species table (:class:`coordinator.web.deployments.SpeciesCategories`).
        now: naive UTC time of an earning (default now).

    Returns:
        The :class:`Protection` of every deployment with coordinates.
    """
    moment = now or utcnow()
    rows = list(s.scalars(select(DeploymentRow).order_by(DeploymentRow.site_id, DeploymentRow.deployment_id)))
    species, categories = _evidence(s, rows, category_of)
    sensitive = frozenset(_key(r) for r in rows if categories[_key(r)] & policy.categories
                          or any(is_sensitive_species(n, policy, category_of) for n in species[_key(r)]))
    places = list(s.scalars(select(PlaceRow).order_by(PlaceRow.id)))
    members: dict[int, list[str]] = {p.id: list(json.loads(p.members_json or "[]")) for p in places}
    by_id = {p.id: p for p in places}
    place_of: dict[str, PlaceRow] = {}
    for p in places:
        for dep in members[p.id]:
            place_of.setdefault(dep, p)
    join_m, radius_m = policy.join_m, policy.radius_m
    by_dep = {_key(r): r for r in rows}

    def dist(r: DeploymentRow, p: PlaceRow) -> float:
        return haversine_m(r.latitude, r.longitude, p.latitude, p.longitude)

    def leave(dep: str) -> None:
        members[place_of[dep].id] = [d for d in members[place_of[dep].id] if d != dep]
        del place_of[dep]

    # a sensitive deployment stays in its place while within J of the anchor; any other while within R + J (it
    # joined as a neighbour); farther, it is another place now
    for dep, p in list(place_of.items()):
        r = by_dep.get(dep)
        if r is not None and dist(r, p) > (join_m if dep in sensitive else radius_m + join_m):
            leave(dep)
    # core: sensitive now, or within J of the anchor of a place that earned protection
    core = set(sensitive) | {dep for dep, p in place_of.items()
                             if dep in by_dep and _earned(p) and dist(by_dep[dep], p) <= join_m}
    # a member that is not core is shown at its place only while that place is still protected (earned, or with
    # a core member); else it is shown at the place it neighbours (below) but stays listed where it was (a
    # neighbour's own place of before, or a lifted one), so `places lift` can say which place protects it
    live = {p.id for p in places if _earned(p)} | {place_of[d].id for d in core if d in place_of}
    parked = set()
    for dep, p in list(place_of.items()):
        if dep not in core and p.id not in live:
            del place_of[dep]
            parked.add(dep)
    near_core = _Near([(by_dep[d].latitude, by_dep[d].longitude, d) for d in core]
                      + [(p.latitude, p.longitude, p.id) for p in places if _earned(p)])
    protected = [r for r in rows if _key(r) in core or near_core.within(r.latitude, r.longitude, radius_m)]
    # anchors are chosen in a fixed order: sensitive deployments first, then by start and key
    protected.sort(key=lambda r: (_key(r) not in sensitive, r.start or "~", _key(r)))
    anchors = _Near([(p.latitude, p.longitude, p.id) for p in places])

    def place_at(r: DeploymentRow) -> PlaceRow:
        nearest = anchors.within(r.latitude, r.longitude, join_m)
        if nearest:
            return by_id[nearest[0][1]]
        row = PlaceRow(latitude=r.latitude, longitude=r.longitude, location_name=_name(r), members_json="[]",
                       created_at=moment)
        s.add(row)
        s.flush()  # its id; a concurrent writer's equal anchor fails here (unique), and the caller retries
        by_id[row.id], members[row.id] = row, []
        anchors.add(row.latitude, row.longitude, row.id)
        return row

    def join(r: DeploymentRow, p: PlaceRow) -> None:
        if _key(r) not in parked:
            members[p.id].append(_key(r))
        place_of[_key(r)] = p

    # 1. core deployments: the nearest anchor within J, else a new place anchored at the deployment
    for r in protected:
        if _key(r) in core and _key(r) not in place_of:
            join(r, place_at(r))
    # 2. neighbours join the place of the nearest core deployment (or earned anchor) within R that made them
    #    protected, so one protected area shows one point
    core_places = _Near([(by_dep[d].latitude, by_dep[d].longitude, place_of[d].id) for d in core if d in place_of]
                        + [(p.latitude, p.longitude, p.id) for p in places if _earned(p)])
    for r in protected:
        if _key(r) in place_of:
            continue
        nearest = core_places.within(r.latitude, r.longitude, radius_m)
        join(r, by_id[nearest[0][1]] if nearest else place_at(r))
    for dep in sorted(sensitive):
        p = place_of.get(dep)
        if p is not None and not _earned(p):
            what = sorted({n for n in species[dep] if is_sensitive_species(n, policy, category_of)}
                          | {f"a {c.value} species" for c in categories[dep] & policy.categories})
            p.earned_at = moment
            p.earned_reason = f"deployment {dep} recorded {', '.join(what)}"
            log.info("web: place %s earned protection: %s", p.id, p.earned_reason)
    for pid, deps in members.items():
        text = json.dumps(sorted(set(deps)))
        if by_id[pid].members_json != text:
            by_id[pid].members_json = text
    s.flush()
    shown = {_key(r) for r in protected}
    return Protection(place_of={dep: Place.of(p) for dep, p in place_of.items() if dep in shown},
                      sensitive=sensitive, species=species, categories=categories)


def _named(r: DeploymentRow) -> bool:
    """Whether the deployment has a location name of its own (the importers store the id when it has none)."""
    return bool(r.location_name) and r.location_name != r.deployment_id


def _name(r: DeploymentRow) -> str:
    return r.location_name if _named(r) else ""


def list_places(store: Store) -> list[Place]:
    """Every place, by id."""
    with store.session() as s:
        return [Place.of(p) for p in s.scalars(select(PlaceRow).order_by(PlaceRow.id))]


def shown_by(protection: Protection, place: Place) -> dict[str, int]:
    """``{deployment key: id of the place it is shown at}`` for the members of ``place`` that are protected now
    (``protection`` from :func:`evaluate`); a member shown at another place's point is protected as that place's
    neighbour."""
    return {d: protection.place_of[d].place_id for d in place.members if d in protection.place_of}


def _not_earned(p: PlaceRow, protection: Protection | None) -> str:
    """Why ``p`` cannot be lifted, and what to lift instead (for :class:`PlaceError`)."""
    state = "its protection is already lifted" if p.lifted_at is not None else "it never earned protection"
    if protection is None:
        return f"place {p.id} has nothing to lift: {state}"
    by = shown_by(protection, Place.of(p))
    others = sorted({pid for pid in by.values() if pid != p.id})
    if others:
        return (f"place {p.id} has nothing to lift: {state}; its deployments "
                f"({', '.join(sorted(d for d, q in by.items() if q != p.id))}) are protected as neighbours of place "
                f"{', '.join(map(str, others))}")
    if by:
        return f"place {p.id} has nothing to lift: {state}; its deployments are protected as neighbours"
    return f"place {p.id} has nothing to lift: {state}, and none of its deployments is protected now"


def lift(store: Store, place_ids: Iterable[int], *, by: str, reason: str,
         now: _dt.datetime | None = None, protection: Protection | None = None) -> list[Place]:
    """An operator's explicit lift of the earned protection of places (module docstring): each row records who,
    when and why, and the lift is logged (WARNING on ``coordinator.web.places``). Protection the data still calls
    for is earned again at the next evaluation; a neighbour's protection ends with the protection near it.

    Args:
        store: the coordinator's store. place_ids: ids from :func:`list_places`.
        by: who lifts (the operator's name). reason: why (kept on the row).
        now: naive UTC time of the lift (default now).
        protection: the current :func:`evaluate` result, to say in a refusal which place protects a neighbour.

    Returns:
        The places as they are after the lift.

    Raises:
        PlaceError: no id, an unknown id, a place whose protection is not earned now (a neighbour's place, or one
            already lifted: lifting it would change nothing a partner sees, so it is refused and the message names
            the place that protects its deployments), or an empty ``by`` or ``reason`` (nothing is changed then).
    """
    ids = sorted({int(i) for i in place_ids})
    if not ids:
        raise PlaceError("no place id given", field="PLACE_ID", fix="list them with `wildfed-coordinator places list`")
    if not (by or "").strip():
        raise PlaceError("no operator name given", field="--by", fix="say who lifts the protection: --by NAME")
    if not (reason or "").strip():
        raise PlaceError("no reason given", field="--reason", fix='say why, e.g. --reason "species table corrected"')
    moment = now or utcnow()
    with store.session() as s:
        rows = {p.id: p for p in s.scalars(select(PlaceRow).where(PlaceRow.id.in_(ids)))}
        missing = [i for i in ids if i not in rows]
        if missing:
            raise PlaceError(f"no place {', '.join(map(str, missing))}", field="PLACE_ID",
                             fix="list them with `wildfed-coordinator places list`")
        idle = [rows[i] for i in ids if not _earned(rows[i])]
        if idle:
            raise PlaceError("; ".join(_not_earned(p, protection) for p in idle), field="PLACE_ID",
                             fix="lift the place whose protection is earned (`wildfed-coordinator places list`, "
                                 "column protection); its neighbours are then shown exactly")
        for pid in ids:
            p = rows[pid]
            p.lifted_at, p.lifted_by, p.lift_reason = moment, by.strip(), reason.strip()
            log.warning("web: protection of place %s (%s) lifted by %s: %s (was: %s)", pid,
                        ", ".join(json.loads(p.members_json or "[]")), p.lifted_by, p.lift_reason,
                        p.earned_reason or "a neighbour")
        return [Place.of(rows[pid]) for pid in ids]
