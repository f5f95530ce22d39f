"""The review page's pages: the event list, one event with its photos and the verdict forms, the verdict itself, and
the photos.

=============================================== ==================================================================
 ``GET /``                                        to ``/events``
 ``GET /events``                                  the events (:mod:`edge_sdk.review.query`: ``order``, ``show``,
                                                  ``deployment``, ``status``, ``page``), a thumbnail per event
 ``GET /events/{event_id}``                       every photo of the event with its boxes, its readings, the
                                                  verdict forms (the list's parameters ride along)
 ``POST /events/{event_id}/verdict``              ``verdict`` (species, blank, unknown, person, vehicle) and
                                                  ``species`` (from the site's species table), CSRF token: written
                                                  by ``edge_sdk.field.verdicts.apply_verdict`` under the ranger's
                                                  name; then to the next unreviewed event in the same order
 ``GET /media/{media_id}/{thumb|view|full}.jpg``  the photo, re-encoded (:mod:`edge_sdk.review.media`)
=============================================== ==================================================================

Every route needs a session. Person photos are shown like any other: they never leave the gateway.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Form, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from shared.errors import ConfigError

from edge_sdk.field.verdicts import VERDICTS, apply_verdict
from edge_sdk.review.context import ReviewState, review_state
from edge_sdk.review.media import SIZES, OutsidePackageError, photo_file
from edge_sdk.review.query import ORDERS, SHOW, ListQuery, next_unreviewed
from edge_sdk.review.views import (STATUS_LABELS, VERDICT_LABELS, event_reading, photo_view, species_options,
                                   verdict_view)

__all__ = ["router"]

log = logging.getLogger(__name__)

router = APIRouter()


def _query(params: dict[str, str]) -> ListQuery:
    try:
        return ListQuery.parse(params)
    except ConfigError as exc:
        raise HTTPException(status_code=422, detail=str(exc)) from None


def _saved(st: ReviewState, event_id: str | None) -> dict | None:
    """The notice after a verdict: which event, what was recorded."""
    event = st.store.event(event_id) if event_id else None
    return None if event is None or event.verdict is None else {"event_id": event.event_id,
                                                                "verdict": verdict_view(event)}


@router.get("/")
def index(request: Request) -> Response:
    """To the event list."""
    review_state(request).need(request)
    return RedirectResponse("/events", status_code=303)


@router.get("/events", response_class=HTMLResponse)
def events_page(request: Request) -> Response:
    """The event list (module docstring)."""
    st = review_state(request)
    ws = st.need(request)
    q = _query(dict(request.query_params))
    items, total = q.events(st.store, st.page_size)
    rows = []
    for e in items:
        photos = st.store.event_photos(e.event_id)
        rows.append({"event": e, "reading": event_reading(e, st.names), "verdict": verdict_view(e),
                     "thumb": photos[0].media_id if photos else None, "url": q.url(f"/events/{e.event_id}")})
    pages = max(1, -(-total // st.page_size))
    return st.page(request, "events.html", ws, rows=rows, total=total, q=q, pages=pages,
                   prev=q.url(page=q.page - 1) if q.page > 1 else None,
                   next=q.url(page=q.page + 1) if q.page < pages else None,
                   deployments=list(st.store.deployments()), statuses=STATUS_LABELS, orders=ORDERS, shows=list(SHOW),
                   saved=_saved(st, request.query_params.get("saved")))


@router.get("/events/{event_id}", response_class=HTMLResponse)
def event_page(request: Request, event_id: str) -> Response:
    """One event: its photos with their boxes and readings, and the verdict forms."""
    st = review_state(request)
    ws = st.need(request)
    q = _query(dict(request.query_params))
    event = st.store.event(event_id)
    if event is None:
        raise HTTPException(status_code=404, detail=f"no event {event_id}")
    reading = event_reading(event, st.names)
    table = st.config.species_table
    confirmable = reading["species"] if reading["species"] in table else None
    skip = next_unreviewed(st.store, q, event_id)
    return st.page(request, "event.html", ws, event=event, reading=reading, verdict=verdict_view(event),
                   photos=[photo_view(p, st.names) for p in st.store.event_photos(event_id)], q=q,
                   hidden=q.params(page=None), confirmable=confirmable, species=species_options(st.config.species),
                   verdict_labels={k: VERDICT_LABELS[k] for k in VERDICTS if k != "species"},
                   skip=q.url(f"/events/{skip.event_id}") if skip and skip.event_id != event_id else None,
                   back=q.url(), saved=_saved(st, request.query_params.get("saved")))


@router.post("/events/{event_id}/verdict")
def give_verdict(request: Request, event_id: str, csrf_token: str = Form(""), verdict: str = Form(""),
                 species: str = Form(""), order: str = Form(""), show: str = Form(""), deployment: str = Form(""),
                 status: str = Form("")) -> Response:
    """Write the ranger's verdict (``apply_verdict``) and go to the next unreviewed event in the same order."""
    st = review_state(request)
    ws = st.need(request)
    st.check_csrf(request, ws, csrf_token)
    q = _query({"order": order, "show": show, "deployment": deployment, "status": status})
    try:
        rows = apply_verdict(st.store, st.package, event_id, verdict=verdict, reviewer=ws.username,
                             species=species or None, species_table=st.config.species_table)
    except KeyError:
        raise HTTPException(status_code=404, detail=f"no event {event_id}") from None
    except ValueError as exc:
        raise HTTPException(status_code=422, detail=f"verdict: {exc}") from None
    log.info("review: %s gave event %s the verdict %s%s (%d observation rows)", ws.username, event_id, verdict,
             f" {species}" if species else "", rows)
    following = next_unreviewed(st.store, q, event_id)
    target = q.url(f"/events/{following.event_id}" if following else "/events", saved=event_id)
    return RedirectResponse(target, status_code=303)


@router.get("/media/{media_id}/{size}.jpg")
def media(request: Request, media_id: str, size: str) -> Response:
    """A photo from the package, downscaled (``thumb``, ``view``) or at its stored size (``full``)."""
    st = review_state(request)
    st.need(request)
    photo = st.store.photo(media_id)
    if photo is None or size not in SIZES:
        raise HTTPException(status_code=404, detail="no such photo")
    try:
        path = photo_file(st.package.root, photo.file_path)
    except OutsidePackageError as exc:
        log.warning("review: refused to serve media %s: %s", media_id, exc)
        raise HTTPException(status_code=403, detail="this photo's path leads outside the package") from None
    except FileNotFoundError:
        raise HTTPException(status_code=404, detail="the photo's file is missing from the package") from None
    try:
        data = st.renderer.render(media_id, path, size)
    except OSError as exc:
        raise HTTPException(status_code=415, detail=f"the photo does not decode: {exc}") from None
    return Response(data, media_type="image/jpeg")
