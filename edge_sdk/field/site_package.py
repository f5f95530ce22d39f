"""The site's own Camtrap DP package, appended to while it is being read: photos, machine observations and the
rangers' human observations.

The package (``dataset:`` of the site config) is the site's record of what its cameras saw, in the TDWG standard
(Camtrap DP 1.0) that camera-trap tools read; training reads it (:mod:`edge_sdk.data.camtrap_dp`). Two processes
write it: the gateway service (new photos) and the review page (verdicts). Every change happens under an exclusive
``flock`` on ``<package>/.wildfed.lock``, and the tables only grow:

- a row is appended with one ``write`` of whole lines, then ``fsync``; a line cut by a crash (the file does not end
  in a newline) is removed before the next append, so a reader never sees half a row twice;
- ``deployments.csv`` is small and rewritten whole (temporary file, ``fsync``, rename) when a deployment is added
  or its time span grows;
- a photo is copied to ``media/<2 hex>/<mediaID><suffix>`` (temporary file, ``fsync``, rename) before its row is
  appended, so a media row never names a file that is not there.

Rows follow the header already in the file (a package made by another tool may order columns differently); a
column the file lacks is left out, a column the row lacks is written empty.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import fcntl
import io
import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from shared.camtrap_dp import DEPLOYMENTS_COLUMNS, MEDIA_COLUMNS, OBSERVATIONS_COLUMNS
from shared.camtrap_dp_schema import LOCAL_PACKAGE_PROFILE, local_resource, write_schema_files
from shared.errors import DatasetError

__all__ = ["TABLE_COLUMNS", "SitePackage"]

TABLE_COLUMNS: dict[str, tuple[str, ...]] = {"deployments": DEPLOYMENTS_COLUMNS, "media": MEDIA_COLUMNS,
                                             "observations": OBSERVATIONS_COLUMNS}
_LOCK = ".wildfed.lock"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _csv_bytes(columns: Sequence[str], rows: Sequence[Mapping[str, object]], *, header: bool) -> bytes:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    if header:
        writer.writeheader()
    for row in rows:
        writer.writerow({c: ("" if row.get(c) is None else row.get(c)) for c in columns})
    return out.getvalue().encode("utf-8")


class SitePackage:
    """A Camtrap DP package folder that grows (module docstring).

    Args:
        root: the package folder (``dataset:`` of the site config).
        site_id: the site (the package's name when it is created).
    """

    def __init__(self, root: str | Path, *, site_id: str) -> None:
        self.root = Path(root)
        self.site_id = site_id

    # -- locking and creation ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the package's exclusive lock (blocks until the other writer is done)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / _LOCK, "a+b") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def table_path(self, table: str) -> Path:
        """``<root>/<table>.csv``."""
        if table not in TABLE_COLUMNS:
            raise ValueError(f"Camtrap DP has no table {table!r}")
        return self.root / f"{table}.csv"

    def ensure(self) -> None:
        """Create the package if it is absent: ``datapackage.json``, the local table schemas
        (:mod:`shared.camtrap_dp_schema`, so the package validates offline with ``frictionless validate``) and the
        three tables with their headers. An existing package is left as it is.

        Deployments appear as photos arrive, before an operator may have given their coordinates, so this
        package's deployments schema marks ``latitude``/``longitude`` optional and says so in its description
        (fill them in, ``field.deployments`` in the site config, before publishing the package)."""
        with self.locked():
            for table, columns in TABLE_COLUMNS.items():
                path = self.table_path(table)
                if not path.exists():
                    _write_atomic(path, _csv_bytes(columns, [], header=True))
            descriptor = self.root / "datapackage.json"
            if not descriptor.exists():
                write_schema_files(self.root, optional={"deployments": ("latitude", "longitude")})
                _write_atomic(descriptor, json.dumps(self._descriptor(), indent=2).encode("utf-8"))

    def _descriptor(self) -> dict[str, object]:
        created = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
        name = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in self.site_id.lower())
        return {"profile": LOCAL_PACKAGE_PROFILE, "name": name, "created": created,
                "title": f"Camera-trap records of site {self.site_id} (kept on its gateway)",
                "resources": [local_resource(t) for t in TABLE_COLUMNS]}

    # -- reading ----------------------------------------------------------------------------------------------
    def header(self, table: str) -> list[str]:
        """The column names of a table as the file has them.

        Raises:
            DatasetError: the table is missing or has no header.
        """
        path = self.table_path(table)
        try:
            with path.open(newline="", encoding="utf-8-sig") as handle:
                first = next(csv.reader(handle), None)
        except OSError as exc:
            raise DatasetError(f"cannot read the {table} table: {exc}", source=str(path),
                               fix="restore the package folder, or remove it so the gateway creates a new one") from exc
        if not first:
            raise DatasetError(f"the {table} table has no header row", source=str(path),
                               fix=f"write the Camtrap DP header ({', '.join(TABLE_COLUMNS[table][:3])}, ...)")
        return first

    def rows(self, table: str) -> list[dict[str, str]]:
        """Every row of a table (a complete last line only)."""
        path = self.table_path(table)
        with path.open(newline="", encoding="utf-8-sig") as handle:
            text = handle.read()
        if text and not text.endswith("\n"):
            text = text[: text.rfind("\n") + 1]
        return list(csv.DictReader(io.StringIO(text)))

    def media_ids(self) -> set[str]:
        """The ``mediaID`` of every media row."""
        return {r["mediaID"] for r in self.rows("media") if r.get("mediaID")}

    # -- writing (callers hold :meth:`locked`) ----------------------------------------------------------------
    def store_photo(self, data: bytes, media_id: str, suffix: str) -> str:
        """Write a photo's bytes into the package (atomically); returns its ``filePath`` (relative, POSIX)."""
        rel = Path("media") / media_id[:2] / f"{media_id}{suffix.lower()}"
        target = self.root / rel
        if not target.exists():
            _write_atomic(target, data)
        return rel.as_posix()

    def append(self, table: str, rows: Sequence[Mapping[str, object]]) -> None:
        """Append rows to a table (whole lines, one write, ``fsync``); a torn last line is removed first."""
        if not rows:
            return
        path = self.table_path(table)
        columns = self.header(table)
        with path.open("r+b") as handle:
            size = handle.seek(0, os.SEEK_END)
            if size:
                handle.seek(size - 1)
                if handle.read(1) != b"\n":  # a line cut by a crash: drop it
                    handle.seek(0)
                    keep = handle.read().rfind(b"\n") + 1
                    handle.truncate(keep)
                    handle.seek(keep)
            handle.write(_csv_bytes(columns, rows, header=False))
            handle.flush()
            os.fsync(handle.fileno())

    def upsert_deployment(self, deployment_id: str, *, timestamp: str, latitude: float | None = None,
                          longitude: float | None = None, location_name: str = "",
                          timestamp_issue: bool = False) -> None:
        """Add a deployment, or widen its ``deploymentStart``/``deploymentEnd`` to include ``timestamp`` (ISO 8601
        with offset); coordinates are filled where given and the row has none; ``timestamp_issue`` (the photo's
        time is only a file time) sets the deployment's ``timestampIssues`` true."""
        from edge_sdk.field.events import epoch_seconds

        rows = self.rows("deployments")
        columns = self.header("deployments")
        row = next((r for r in rows if r.get("deploymentID") == deployment_id), None)
        if row is None:
            row = {"deploymentID": deployment_id, "locationName": location_name, "deploymentStart": timestamp,
                   "deploymentEnd": timestamp, "timestampIssues": "false"}
            rows.append(row)
        else:
            t = epoch_seconds(timestamp)
            start, end = row.get("deploymentStart") or timestamp, row.get("deploymentEnd") or timestamp
            if epoch_seconds(start) <= t <= epoch_seconds(end) and (latitude is None or row.get("latitude")) \
                    and (not timestamp_issue or row.get("timestampIssues") == "true"):
                return
            row["deploymentStart"] = timestamp if t < epoch_seconds(start) else start
            row["deploymentEnd"] = timestamp if t > epoch_seconds(end) else end
        if timestamp_issue:
            row["timestampIssues"] = "true"
        if latitude is not None and not row.get("latitude"):
            row["latitude"], row["longitude"] = f"{latitude:.6f}", f"{longitude:.6f}"
        _write_atomic(self.table_path("deployments"), _csv_bytes(columns, rows, header=True))

    def fill_coordinates(self, locations: Mapping[str, tuple[float, float, str]]) -> list[str]:
        """Give coordinates (``{deploymentID: (latitude, longitude, location name)}``) to the deployments that have
        none yet (callers hold :meth:`locked`); returns the ids changed. A deployment with coordinates keeps them."""
        rows = self.rows("deployments")
        changed = []
        for row in rows:
            loc = locations.get(row.get("deploymentID", ""))
            if loc is not None and not (row.get("latitude") or "").strip():
                row["latitude"], row["longitude"] = f"{loc[0]:.6f}", f"{loc[1]:.6f}"
                if loc[2] and not row.get("locationName"):
                    row["locationName"] = loc[2]
                changed.append(row["deploymentID"])
        if changed:
            _write_atomic(self.table_path("deployments"), _csv_bytes(self.header("deployments"), rows, header=True))
        return changed
