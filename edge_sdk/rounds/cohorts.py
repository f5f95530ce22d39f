"""The gateway's half of record-level budgets: which cohort each training record belongs to.

A record joins training in the round of the first task with cohorts (``TrainingTask.cohorts``) that the gateway
trains after the record appeared among its training records (a verified photo, or a confident machine one): it
joins cohort ``task.round`` and keeps it for good. The coordinator charges each cohort separately and halts a
category in a cohort once its records have spent that category's budget (:mod:`coordinator.cohorts`); the task
lists the cohorts that train and what is halted in each, and :meth:`CohortRegistry.mask` turns that into the
records that may be sampled. The coordinator never learns which records joined when: it opens a cohort every
round it sends a task.

A gateway that trained before its coordinator had cohorts gets, in its first task with cohorts, cohort 0: the
records that may have trained then, whose spend is on the site's own ledger stream; every record it holds at that
task joins cohort 0. The registry is part of the gateway's state, like its outbox: a gateway that lost it would let
its records join again with a fresh budget, so back it up and restore it with the rest of ``<state>/``.

A record is trained under the IUCN category it had when it joined. If a person later changes its species to one
of another category, the record stops training (its loss so far was charged under the old category's stream, and
mixing two categories' histories in one record is not what the ledger accounts); it stays for inference and the
web view, and the change is logged.

The registry is ``<state>/cohorts.sqlite`` (:func:`edge_sdk.site_paths.cohort_registry_path`); an assignment is
committed before the round trains (a gateway that stops mid-round keeps it).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shared.protocol import TrainingTask

__all__ = ["CohortRegistry"]

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS cohort_records (
    media_id TEXT PRIMARY KEY,
    cohort INTEGER NOT NULL,
    category INTEGER NOT NULL
)
"""


class CohortRegistry:
    """The durable map from a training record (its Camtrap DP ``mediaID``) to its cohort and category.

    Args:
        path: the SQLite file (created with its folder).

    Raises:
        sqlite3.Error: the file cannot be opened.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the database."""
        self._db.close()

    def assignments(self) -> dict[str, tuple[int, int]]:
        """``{media id: (cohort, IUCN rank)}`` of every record that joined training."""
        with self._lock:
            rows = self._db.execute("SELECT media_id, cohort, category FROM cohort_records").fetchall()
        return {str(m): (int(c), int(k)) for m, c, k in rows}

    def mask(self, media_ids: Sequence[str], categories: np.ndarray, task: TrainingTask) -> np.ndarray | None:
        """The records ``task`` lets train: bool (N,), or None for a task without cohorts (every record may).

        Records never seen before join cohort ``task.round`` first (durably), when the task lists it. A record
        trains when its cohort is listed, its category (``categories``, int8 IUCN ranks (N,)) is the one it
        joined with, and that category is not halted in its cohort.
        """
        if task.cohorts is None:
            return None
        ranks = np.asarray(categories, dtype=np.int64)
        known = self.assignments()
        # the first task with cohorts after the site trained without them lists cohort 0: every record held now
        # may have trained then, so they join it (its spend goes on); later records join their own round's cohort
        joins = 0 if not known and 0 in task.cohorts else task.round
        if joins in task.cohorts:
            new = [(m, joins, int(k)) for m, k in zip(media_ids, ranks) if m not in known]
            if new:
                with self._lock:
                    self._db.execute("BEGIN IMMEDIATE")
                    self._db.executemany("INSERT OR IGNORE INTO cohort_records (media_id, cohort, category) "
                                         "VALUES (?, ?, ?)", new)
                    self._db.execute("COMMIT")
                known.update({m: (c, k) for m, c, k in new})
                log.info("cohorts: %d record(s) join training in cohort %d", len(new), joins)
        halted = {c: {x.rank for x in h} for c, h in task.cohorts.items()}
        out = np.zeros(len(media_ids), dtype=bool)
        relabelled = 0
        for i, (m, k) in enumerate(zip(media_ids, ranks)):
            got = known.get(m)
            if got is None:
                continue
            cohort, joined_as = got
            if joined_as != int(k):
                relabelled += 1
                continue
            out[i] = cohort in halted and int(k) not in halted[cohort]
        log.info("cohorts: round %d: %d training record(s) may be sampled, %d retired or halted", task.round,
                 int(out.sum()), len(media_ids) - int(out.sum()))
        if relabelled:
            log.info("cohorts: %d record(s) changed IUCN category after joining training; they train no more "
                     "(they stay for inference and the web view)", relabelled)
        return out
