"""The ``field:`` section of a site config: how the gateway service treats photos in its incoming folder.

Example (every key optional; the defaults are shown)::

    incoming: incoming/             # top-level key: the folder the service watches (none: no watching)
    field:
      poll_interval_s: 10           # how often the incoming folder is scanned
      settle_s: 5                   # a file unchanged this long is complete
      give_up_s: 3600               # a complete-looking file that still does not decode moves to .failed/
      event_gap_s: 60               # photos of one deployment closer than this form one event
      detection_threshold: 0.25     # the detector's confidence threshold (its training value)
      confidence_threshold: 0.5     # a species posterior below this is "unknown"
      outside_prior: 0.1            # prior weight of a species the site does not list (1 for listed ones)
      default_deployment: main      # deployment of photos directly in incoming/ (sub-folders name their own)
      utc_offset: "+00:00"          # camera clock zone for EXIF times without one
      publish_detections: true      # publish each photo's signed detection record to the coordinator
      engine: auto                  # auto (TensorRT where present, else ONNX Runtime), tensorrt or ort
      deployments:                  # optional coordinates of each deployment (Camtrap DP requires them)
        main: {latitude: -1.2921, longitude: 36.8219, location_name: Waterhole 3}

Deployment ids are ``<site_id>/<name>``: ``incoming/river/IMG_0001.JPG`` at site ``site-07`` is deployment
``site-07/river``, the naming ``wildfed-edge package`` uses too.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["DeploymentLocation", "FieldSettings"]

_OFFSET = re.compile(r"^[+-]\d{2}:\d{2}$")


class DeploymentLocation(BaseModel):
    """Where a deployment's camera stands (WGS 84 degrees) and its name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    latitude: float = Field(ge=-90, le=90)
    longitude: float = Field(ge=-180, le=180)
    location_name: str = ""


class FieldSettings(BaseModel):
    """How the gateway service handles new photos (module docstring for each field and its default)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    poll_interval_s: float = Field(default=10.0, gt=0)
    settle_s: float = Field(default=5.0, ge=0)
    give_up_s: float = Field(default=3600.0, ge=0)
    event_gap_s: float = Field(default=60.0, ge=0)
    detection_threshold: float = Field(default=0.25, gt=0, lt=1)
    confidence_threshold: float = Field(default=0.5, ge=0, le=1)
    outside_prior: float = Field(default=0.1, gt=0, le=1)
    default_deployment: str = Field(default="main", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    utc_offset: str = "+00:00"
    publish_detections: bool = True
    engine: str = Field(default="auto", pattern=r"^(auto|tensorrt|ort)$")
    deployments: dict[str, DeploymentLocation] = Field(default_factory=dict)

    @field_validator("utc_offset")
    @classmethod
    def _offset(cls, value: str) -> str:
        if not _OFFSET.match(value):
            raise ValueError("must look like +HH:MM or -HH:MM (the camera clock's offset from UTC)")
        return value

    def deployment_id(self, site_id: str, folder: str | None) -> str:
        """``<site_id>/<folder>`` for a photo in a sub-folder of incoming/, ``<site_id>/<default_deployment>``
        otherwise."""
        return f"{site_id}/{folder or self.default_deployment}"
