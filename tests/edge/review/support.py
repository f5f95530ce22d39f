"""A site for the review page's tests, made by the field loop's real code: photos dropped into ``incoming/`` and
processed by :class:`edge_sdk.field.service.FieldService` with a stub detector (it boxes the one saturated square a
test photo carries) and a stub backbone (the crop's mean colour), and a species head chosen so that the events
read confident, unexpected at this site, unknown and blank.

Site species table: Lycaon pictus (class 0, EN) and Equus quagga (class 1, NT); the federation's class 2 is
Panthera leo, which this site does not list. Every photo is 160 x 120 with its square at (40, 30)-(80, 70), so every
box is ``(0.25, 0.25, 0.25, 0.333333)`` (40/160, 30/120, 40/160, 40/120).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from argon2 import PasswordHasher
from PIL import Image

from shared.keys import generate_signing_key, save_private_key, save_public_key

from edge_sdk.config import SiteConfig, global_model_path, load_site_config
from edge_sdk.field.photos import PhotoClassifier
from edge_sdk.field.service import FieldService
from edge_sdk.global_model import save_global_model
from edge_sdk.inference.detector import Box

HASHER = PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)  # fast for tests; the default is 64 MiB x 3
PASSWORD = "a long ranger password"
SPECIES = [{"scientific_name": "Lycaon pictus", "class_index": 0, "iucn_category": "EN"},
           {"scientific_name": "Equus quagga", "class_index": 1, "iucn_category": "NT"}]
CLASS_NAMES = {0: "Lycaon pictus", 1: "Equus quagga", 2: "Panthera leo"}
BOX = ("0.250000", "0.250000", "0.250000", "0.333333")  # bboxX, bboxY, bboxWidth, bboxHeight as written

RED, GREEN, BLUE, OLIVE = (250, 10, 10), (10, 250, 10), (10, 10, 250), (215, 250, 10)
#: event name -> (deployment folder or None, [(capture time, square colour or None)], expected status)
PLAN = {
    "dogs": ("river", [("2024:05:01 10:00:00", RED), ("2024:05:01 10:00:20", RED)], "confident"),
    "lion": ("river", [("2024:05:01 12:00:00", BLUE)], "unexpected"),
    "unsure": ("road", [("2024:05:02 09:00:00", OLIVE), ("2024:05:02 09:00:30", OLIVE)], "unknown"),
    "zebra": ("road", [("2024:05:02 11:00:00", GREEN)], "confident"),
    "empty": (None, [("2024:05:03 08:00:00", None)], "blank"),
}


class SquareDetector:
    """One box around the saturated square a test photo carries (max - min channel > 150), none without one."""

    detector_id, batch_size = "square", 1

    def detect(self, images):
        out = []
        for image in images:
            a = np.asarray(image).astype(int)
            ys, xs = np.nonzero(a.max(axis=2) - a.min(axis=2) > 150)
            out.append([Box(float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1), 0.9)]
                       if len(xs) else [])
        return out


class MeanColour:
    """A stub backbone: the crop's mean RGB in [0, 1], in the first three of 1280 dimensions."""

    name, backbone_id, input_size = "stub", "stub-backbone", 128

    def embed_images(self, images):
        out = np.zeros((len(images), 1280), np.float32)
        for i, im in enumerate(images):
            out[i, :3] = np.asarray(im, np.float32).reshape(-1, 3).mean(axis=0) / 255.0
        return out


def photo_bytes(colour: tuple[int, int, int] | None, when: str, shade: int = 0) -> bytes:
    """A 160 x 120 JPEG with EXIF DateTimeOriginal ``when`` and a 40 x 40 square of ``colour`` at (40, 30)."""
    image = Image.new("RGB", (160, 120), (20 + shade, 120, 40))
    if colour is not None:
        image.paste(colour, (40, 30, 80, 70))
    exif = Image.Exif()
    exif.get_ifd(0x8769)[36867] = when
    buf = io.BytesIO()
    image.save(buf, "JPEG", exif=exif, quality=100, subsampling=0)  # sharp edges: the box is exact
    return buf.getvalue()


@dataclass
class Site:
    """The built site: its config file and config, and per planned event its id and its photos' media ids."""

    config_path: Path
    config: SiteConfig
    events: dict[str, str]
    media: dict[str, list[str]]


def build_site(root: Path) -> Site:
    """Write the site config and keys, run the field loop over :data:`PLAN`'s photos, and check that each event
    reads as planned (AssertionError otherwise)."""
    key = generate_signing_key()
    save_private_key(key, root / "keys" / "site.key")
    save_public_key(generate_signing_key().public_key(), root / "keys" / "coordinator.pub")
    config = {"federation_id": "fed", "site_id": "site-1", "dataset": "package", "incoming": "incoming",
              "species": SPECIES, "num_classes": 3, "class_names": CLASS_NAMES, "private_key": "keys/site.key",
              "coordinator_public_key": "keys/coordinator.pub", "outbox": "state/outbox.sqlite",
              "field": {"settle_s": 5, "publish_detections": False,
                        "confidence_threshold": 0.7}}
    (root / "site.yaml").write_text(yaml.safe_dump(config))
    cfg = load_site_config(root / "site.yaml")
    # logits = W [r, g, b] + bias over (Lycaon, Equus, Panthera): red -> Lycaon, green -> Equus, blue -> Panthera
    # (strong enough to beat the 0.1 prior of a species the site does not list); olive (215, 250, 10) -> about
    # 0.53 / 0.47 between Lycaon and Equus, under the site's threshold of 0.7: unknown
    w = np.zeros((3, 1280), np.float32)
    w[0, 0], w[1, 1], w[2, 2] = 14.0, 14.0, 30.0
    save_global_model(global_model_path(cfg), {"psi.weight": w, "psi.bias": np.array([0.0, -2.0, -7.0], np.float32)},
                      round_=1, model_hash_hex="cd" * 32)
    now = [0.0]
    classifier = PhotoClassifier(detector=SquareDetector(), embedder=MeanColour(), model_path=global_model_path(cfg),
                                 class_names=cfg.names_by_class, site_classes={0, 1}, threshold=cfg.field.confidence_threshold,
                                 outside_prior=0.1)
    service = FieldService(cfg, classifier=classifier, queue=None, clock=lambda: now[0])
    media: dict[str, list[str]] = {}
    try:
        from shared.camtrap_dp import media_id

        for name, (folder, shots, _) in PLAN.items():
            for i, (when, colour) in enumerate(shots):
                data = photo_bytes(colour, when, shade=i)
                target = Path(cfg.incoming) / (folder or "") / f"{name}-{i}.jpg"
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                media.setdefault(name, []).append(media_id(data))
        service.incoming.scan()
        now[0] += 10
        assert service.poll() == sum(len(s) for _, s, _ in PLAN.values())
        events = {}
        for name, ids in media.items():
            (event_id,) = {service.store.photo(m).event_id for m in ids}
            events[name] = event_id
            assert service.store.event(event_id).status == PLAN[name][2], (name, service.store.event(event_id))
    finally:
        service.close()
    return Site(root / "site.yaml", cfg, events, media)
