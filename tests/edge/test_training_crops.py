"""Training and inference embed the same crop: a detection that a ranger confirms trains on exactly the embedding
`wildfed-edge detect` (and the gateway service) classified, bit for bit; verified labels decide what trains."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from shared.camtrap_dp import media_id

from edge_sdk.data.camtrap_dp import load_camtrap_dp
from edge_sdk.data.crops import bbox_square, crop_square, decode_rgb
from edge_sdk.data.embedding import embed_dataset, open_embedder
from edge_sdk.field.photos import PhotoClassifier
from edge_sdk.field.site_package import SitePackage
from edge_sdk.inference.classifier import SpeciesClassifier
from edge_sdk.inference.detector import Box
from edge_sdk.inference.records import DetectionPipeline

PHOTO = Path(__file__).resolve().parents[2] / "wildfed_sim" / "assets" / "ena24" / "2480.jpg"
SPECIES = {"Ursus americanus": (0, "LC"), "Didelphis virginiana": (1, "LC")}


class OneBox:
    """A detector that finds one fixed box (pixels) in every photo."""

    detector_id, batch_size = "fixed-box", 1

    def __init__(self, box: tuple[float, float, float, float]) -> None:
        self.box = box

    def detect(self, images):
        return [[Box(*self.box, score=0.9)] for _ in images]


class Recording:
    """The real backbone embedder, remembering every embedding it returns."""

    def __init__(self, inner) -> None:
        self.inner, self.seen = inner, []
        self.name, self.backbone_id, self.input_size = inner.name, inner.backbone_id, inner.input_size

    def embed_images(self, images):
        out = self.inner.embed_images(images)
        self.seen.append(np.array(out, copy=True))
        return out


@pytest.fixture(scope="module")
def embedder():
    return open_embedder(128)


def _package_with(tmp_path: Path, bbox: tuple[float, ...] | None, method: str = "human") -> Path:
    pkg = SitePackage(tmp_path / "pkg", site_id="s")
    pkg.ensure()
    data = PHOTO.read_bytes()
    mid = media_id(data)
    with pkg.locked():
        rel = pkg.store_photo(data, mid, ".jpg")
        pkg.upsert_deployment("s/main", timestamp="2024-01-01T00:00:00+00:00", latitude=0.0, longitude=0.0)
        pkg.append("media", [{"mediaID": mid, "deploymentID": "s/main", "timestamp": "2024-01-01T00:00:00+00:00",
                              "filePath": rel, "fileName": PHOTO.name}])
        row = {"observationID": "o1", "deploymentID": "s/main", "mediaID": mid, "observationLevel": "media",
               "observationType": "animal", "scientificName": "Ursus americanus", "classificationMethod": method,
               "classificationTimestamp": "2024-01-02T00:00:00+00:00", "classificationProbability": "0.99"}
        if bbox is not None:
            row.update(bboxX=f"{bbox[0]:.6f}", bboxY=f"{bbox[1]:.6f}", bboxWidth=f"{bbox[2]:.6f}",
                       bboxHeight=f"{bbox[3]:.6f}")
        pkg.append("observations", [row])
    return pkg.root


def test_the_confirmed_detection_trains_on_the_embedding_detect_classified(tmp_path: Path, embedder) -> None:
    box = (613.3, 401.7, 1187.9, 902.2)  # pixels, an arbitrary non-integer box inside the 1280x960 photo
    recording = Recording(embedder)
    head = {"psi.weight": np.zeros((2, 1280), np.float32), "psi.bias": np.zeros(2, np.float32)}
    classifier = SpeciesClassifier(recording, head, class_names={0: "Ursus americanus"})
    pipeline = DetectionPipeline(OneBox(box), classifier, deployment_id="s/main")
    (record,) = list(pipeline.run([(PHOTO, PHOTO.name)]))
    detect_embedding = recording.seen[-1][0]

    # the gateway service's path (edge_sdk.field.photos) gives the same crop and embedding
    service = PhotoClassifier(detector=OneBox(box), embedder=recording, model_path=tmp_path / "none",
                              class_names={}, site_classes=set(), threshold=0.5, outside_prior=0.1)
    (classified,) = service.classify(decode_rgb(PHOTO.read_bytes()))
    assert classified.bbox == record.detections[0].bbox
    np.testing.assert_array_equal(service.embed(decode_rgb(PHOTO.read_bytes()), [classified.square])[0],
                                  detect_embedding)

    # a ranger confirms it: a human observation with the detection's box, as stored
    data = load_camtrap_dp(_package_with(tmp_path, record.detections[0].bbox), SPECIES)
    assert data.boxes == ((record.detections[0].bbox,),)
    trained = embed_dataset(data, tmp_path / "cache", embedder=recording)
    np.testing.assert_array_equal(trained.features[0], detect_embedding)  # bit for bit

    # and it is a crop, not the whole frame: the whole-frame embedding differs
    whole = embed_dataset(load_camtrap_dp(_package_with(tmp_path / "w", None), SPECIES), tmp_path / "c2",
                          embedder=recording)
    assert not np.allclose(whole.features[0], detect_embedding, atol=1e-3)


def test_several_boxes_of_one_species_train_as_one_record_on_their_mean(tmp_path: Path, embedder) -> None:
    pkg = _package_with(tmp_path, (0.1, 0.1, 0.2, 0.2))
    rows = (pkg / "observations.csv").read_text().splitlines()
    second = rows[-1].replace("o1,", "o2,").replace("0.100000,0.100000", "0.500000,0.400000")
    (pkg / "observations.csv").write_text("\n".join([*rows, second]) + "\n")
    data = load_camtrap_dp(pkg, SPECIES)
    assert len(data) == 1 and data.boxes[0] == ((0.1, 0.1, 0.2, 0.2), (0.5, 0.4, 0.2, 0.2))
    image = decode_rgb(PHOTO.read_bytes())
    crops = [crop_square(image, bbox_square(b, image.width, image.height)) for b in data.boxes[0]]
    expected = embedder.embed_images(crops).astype(np.float64).mean(axis=0)
    features = embed_dataset(data, tmp_path / "cache", embedder=embedder).features
    np.testing.assert_allclose(features[0], expected, rtol=1e-6, atol=1e-6)


def test_machine_labels_train_only_when_the_site_accepts_them(tmp_path: Path) -> None:
    pkg = _package_with(tmp_path, (0.1, 0.1, 0.2, 0.2), method="machine")
    assert len(load_camtrap_dp(pkg, SPECIES)) == 0  # verified only, by default
    assert len(load_camtrap_dp(pkg, SPECIES, train_on="machine", machine_threshold=0.99)) == 1
    assert len(load_camtrap_dp(pkg, SPECIES, train_on="machine", machine_threshold=0.995)) == 0
    shutil.rmtree(pkg)
