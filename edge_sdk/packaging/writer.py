"""Write a built package to disk: in a temporary folder beside OUT, validated, then renamed into place.

OUT holds ``datapackage.json``, ``deployments.csv``, ``media.csv``, ``observations.csv`` (UTF-8, LF, the standard's
column order), ``schemas/*.json`` (the local table schemas, ``shared.camtrap_dp_schema``) and ``media/`` with the
photos' copies. The descriptor carries ``profile`` (the registered ``tabular-data-package``, validated offline; see
``shared.camtrap_dp_schema.LOCAL_PACKAGE_PROFILE``), ``name``, ``id`` (a UUID derived from the site and its media
ids, so the same photos give the same id), ``created``, ``contributors``, ``title``, ``description``, ``temporal``,
``taxonomic`` and the three resources with their schema files.

Nothing is left behind on failure: the temporary folder is removed when validation fails (the errors are raised
with their table, row and field) or anything else goes wrong, and an existing OUT is replaced only with ``force``,
and only once the new package is complete.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from shared.camtrap_dp import CAMTRAP_DP_VERSION, DEPLOYMENTS_COLUMNS, MEDIA_COLUMNS, OBSERVATIONS_COLUMNS
from shared.camtrap_dp_schema import LOCAL_PACKAGE_PROFILE, TABLES, local_resource, write_schema_files
from shared.errors import DatasetError

from edge_sdk.packaging.build import PackageContent
from edge_sdk.packaging.validate import Problem, validate_package

__all__ = ["PackageValidationError", "descriptor", "check_destination", "write_package"]

_COLUMNS = {"deployments": DEPLOYMENTS_COLUMNS, "media": MEDIA_COLUMNS, "observations": OBSERVATIONS_COLUMNS}


class PackageValidationError(DatasetError):
    """The package built does not validate; nothing was written. ``problems`` lists every error."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        first = problems[0]
        where = ", ".join(p for p in (first.table, f"row {first.row}" if first.row else "", first.field or "") if p)
        super().__init__(f"the package does not validate: {len(problems)} error(s), first: {where}: {first.message}",
                         fix="correct the input named in the errors; nothing was written")


def descriptor(content: PackageContent, *, site: str, contributor: str,
               created: _dt.datetime | None = None) -> dict[str, Any]:
    """The ``datapackage.json`` object of ``content`` (see the module docstring)."""
    moment = (created or _dt.datetime.now(_dt.timezone.utc)).astimezone(_dt.timezone.utc)
    ids = ",".join(sorted(row["mediaID"] for row in content.media))
    return {
        "profile": LOCAL_PACKAGE_PROFILE,
        "name": re.sub(r"[^a-z0-9._-]+", "-", f"wildfed-site-{site}".lower()).strip("-"),
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"wildfed-package/{site}/{ids}")),
        "created": moment.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "title": f"Camera-trap photos of site {site}, labelled for training",
        "description": (f"Camtrap DP {CAMTRAP_DP_VERSION} tables (local table schemas in schemas/) built by "
                        "wildfed-edge package from the site's labelled photos; the photos are in media/ and stay on "
                        "the site's gateway."),
        "contributors": [{"title": contributor, "role": "contributor"}],
        "temporal": {"start": content.span[0], "end": content.span[1]},
        "taxonomic": [{"scientificName": name} for name in content.species],
        "resources": [local_resource(table) for table in TABLES],
    }


def check_destination(out: Path, *, force: bool) -> None:
    """Refuse an existing ``out`` unless ``force``.

    Raises:
        DatasetError: ``out`` exists and ``force`` is false, or ``out`` is a file.
    """
    if out.exists() and not out.is_dir():
        raise DatasetError("exists and is not a folder", source=out, fix="choose another OUT")
    if out.exists() and not force:
        raise DatasetError("already exists", source=out, fix="choose another OUT, or pass --force to replace it "
                                                              "once the new package is complete")


def _write_csv(path: Path, columns: tuple[str, ...], rows: list[dict[str, str]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns), lineterminator="\n", restval="",
                                extrasaction="raise")
        writer.writeheader()
        writer.writerows(rows)


def write_package(out: Path, content: PackageContent, *, site: str, contributor: str, force: bool = False,
                  created: _dt.datetime | None = None) -> Path:
    """Write ``content`` as a package at ``out``, validated (see the module docstring).

    Returns:
        ``out``.

    Raises:
        DatasetError: ``out`` exists without ``force`` (:func:`check_destination`).
        PackageValidationError: frictionless finds errors; nothing is written.
        OSError: copying or writing failed; the temporary folder is removed and ``out`` is untouched.
    """
    out = Path(out)
    check_destination(out, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for source, relative in content.copies:
            target = tmp / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
        for table, rows in (("deployments", content.deployments), ("media", content.media),
                            ("observations", content.observations)):
            _write_csv(tmp / f"{table}.csv", _COLUMNS[table], rows)
        write_schema_files(tmp, optional={"deployments": content.relaxed})
        meta = descriptor(content, site=site, contributor=contributor, created=created)
        (tmp / "datapackage.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        problems = validate_package(tmp)
        if problems:
            raise PackageValidationError(problems)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if out.exists():  # --force: the old package goes aside, the new one in, then the old one away
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "package")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
