"""Exchange formats of the coordinator: MegaDetector batch output in (operator imports), Camtrap DP 1.0 out.

The one place callers import them from; the work is in three modules:

* coordinator.web.megadetector_parse: reading and checking a MegaDetector batch output file (format 1.x);
* coordinator.web.megadetector_import: :func:`import_megadetector`, writing its records to the store (the decisions
  on site, deployment, media id, times, humans and re-import are listed there);
* coordinator.web.camtrap_export: :func:`camtrap_dp_files`, :func:`export_camtrap_dp`, :func:`export_camtrap_dp_zip`,
  the Camtrap DP package of what one :class:`~coordinator.web.views.Viewer` sees.
"""

from __future__ import annotations

from coordinator.web.camtrap_export import (CAMTRAP_DP_PROFILE, CAMTRAP_DP_SCHEMAS, DEPLOYMENT_COLUMNS, MEDIA_COLUMNS,
                                            OBSERVATION_COLUMNS, camtrap_dp_files, export_camtrap_dp,
                                            export_camtrap_dp_zip)
from coordinator.web.megadetector_import import HUMAN_CATEGORIES, ImportSummary, import_megadetector

__all__ = ["ImportSummary", "HUMAN_CATEGORIES", "import_megadetector", "CAMTRAP_DP_PROFILE", "CAMTRAP_DP_SCHEMAS",
           "DEPLOYMENT_COLUMNS", "MEDIA_COLUMNS", "OBSERVATION_COLUMNS", "camtrap_dp_files", "export_camtrap_dp",
           "export_camtrap_dp_zip"]
