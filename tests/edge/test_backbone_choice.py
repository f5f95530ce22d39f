"""Choosing the backbone on a gateway: the site config's ``backbone`` and ``embedding_input_size``, ``detect``'s
options, cache keys and engine slots per backbone, the backbone recorded with the kept global model, and the refusal
of a head trained on another backbone. No network: no weights are loaded here."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import yaml

from shared.codec import decode_tensors, encode_tensors, model_hash
from shared.errors import ConfigError
from shared.models.backbone import BACKBONE_METADATA_KEY, BACKBONE_NAMES, backbone_id

from edge_sdk.config import load_site_config
from edge_sdk.data.embedding_cache import EmbeddingCache
from edge_sdk.inference.classifier import SpeciesClassifier, check_head_backbone, load_classifier_weights
from edge_sdk.inference.embedder import engine_slot

LITE0, LITE1, LITE2 = BACKBONE_NAMES
HEAD = {"psi.weight": np.zeros((3, 1280), np.float32), "psi.bias": np.array([0.0, 0.0, 1.0], np.float32)}


def _site(tmp_path: Path, **fields) -> Path:
    config = {"federation_id": "fed", "site_id": "site-1", "dataset": "pkg", "private_key": "k",
              "coordinator_public_key": "c", "outbox": "state/outbox.sqlite",
              "species": [{"scientific_name": "Ursus americanus", "class_index": 2, "iucn_category": "LC"}],
              **fields}
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# ---- the site config ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "expected"), [
    ({}, (LITE0, 128)),
    ({"backbone": LITE1}, (LITE1, 240)),                             # its native size
    ({"backbone": LITE2}, (LITE2, 260)),
    ({"backbone": LITE0, "embedding_input_size": 224}, (LITE0, 224)),
    ({"backbone": LITE2, "embedding_input_size": None}, (LITE2, 260)),
])
def test_site_config_backbone_and_its_default_size(tmp_path, fields, expected):
    site = load_site_config(_site(tmp_path, **fields))
    assert (site.backbone, site.embedding_input_size) == expected
    assert site.backbone_id == backbone_id(*expected)


def test_an_unknown_backbone_in_the_site_config_names_the_field_and_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="backbone") as info:
        load_site_config(_site(tmp_path, backbone="efficientnet-b0"))
    assert info.value.field == "backbone"
    assert "efficientnet-lite1" in str(info.value)


@pytest.mark.parametrize(("options", "fields", "expected"), [
    ((None, None), None, (LITE0, 128)),                 # no config: the defaults
    ((LITE2, None), None, (LITE2, 260)),
    ((None, None), {"backbone": LITE1}, (LITE1, 240)),  # the site's
    ((None, 192), {"backbone": LITE1}, (LITE1, 192)),
    ((LITE2, None), {"backbone": LITE1, "embedding_input_size": 200}, (LITE2, 260)),  # the site's size is Lite1's
    ((LITE1, None), {"backbone": LITE1, "embedding_input_size": 200}, (LITE1, 200)),
])
def test_detect_takes_the_options_then_the_site_config(tmp_path, options, fields, expected):
    from edge_sdk.cli_detect import _detect_backbone

    site = load_site_config(_site(tmp_path, **fields)) if fields is not None else None
    assert _detect_backbone(*options, site) == {"backbone": expected[0], "input_size": expected[1]}


def test_detect_refuses_an_unknown_backbone_before_opening_anything(tmp_path):
    from typer.testing import CliRunner

    from edge_sdk.cli import app

    result = CliRunner().invoke(app, ["detect", str(tmp_path), "--backbone", "resnet50", "--out",
                                      str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "unknown backbone 'resnet50'" in " ".join(result.output.split())


# ---- keys: caches, engine slots ---------------------------------------------------------------------------------

def test_cache_keys_and_engine_slots_differ_per_backbone_and_size(tmp_path):
    combos = list(itertools.product(BACKBONE_NAMES, (128, 224, 240, 260)))
    caches = [EmbeddingCache(tmp_path, backbone_id=backbone_id(n, s), input_size=s) for n, s in combos]
    assert len({c.directory for c in caches}) == len(combos)
    assert len({engine_slot(s, n) for n, s in combos}) == len(combos)
    assert engine_slot(128, LITE0) == "efficientnet_lite0_128px"  # the slot Lite0 gateways already have
    # an entry stored for one backbone is a miss for another at the same size
    lite0 = EmbeddingCache(tmp_path, backbone_id=backbone_id(LITE0, 240), input_size=240)
    lite1 = EmbeddingCache(tmp_path, backbone_id=backbone_id(LITE1, 240), input_size=240)
    lite0.put(["m1"], np.ones((1, 1280), np.float32), [None])
    assert lite1.get("m1") is None
    assert lite0.get("m1").sum() == 1280


# ---- the kept model and the refusal ------------------------------------------------------------------------------

def test_the_kept_global_model_records_the_sites_backbone(tmp_path):
    from edge_sdk.global_model import save_global_model

    path = tmp_path / "global-model.safetensors"
    save_global_model(path, HEAD, round_=3, model_hash_hex=model_hash(HEAD), backbone_id=backbone_id(LITE1, 240))
    _, metadata = decode_tensors(path.read_bytes())
    assert metadata[BACKBONE_METADATA_KEY] == "efficientnet-lite1@77cc7160d37bebc1/p1/240px"
    assert metadata["round"] == "3"


def test_a_head_of_another_backbone_is_refused_naming_the_fix(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(encode_tensors(HEAD, metadata={BACKBONE_METADATA_KEY: backbone_id(LITE1, 240)}))
    with pytest.raises(ConfigError) as info:
        load_classifier_weights(path, backbone_id=backbone_id(LITE0, 128))
    assert info.value.field == "backbone"
    assert "--backbone efficientnet-lite1 --input-size 240" in info.value.fix
    # the same backbone at another input size is another embedding function, refused too
    with pytest.raises(ConfigError, match="--input-size 240"):
        load_classifier_weights(path, backbone_id=backbone_id(LITE1, 128))
    loaded = load_classifier_weights(path, backbone_id=backbone_id(LITE1, 240))
    np.testing.assert_array_equal(loaded["psi.bias"], HEAD["psi.bias"])


def test_a_model_that_records_no_backbone_is_accepted(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(encode_tensors(HEAD))  # as the coordinator stores a global model
    assert set(load_classifier_weights(path, backbone_id=backbone_id(LITE2, 260))) == set(HEAD)
    check_head_backbone({}, backbone_id(LITE0, 128))
    with pytest.raises(ConfigError, match="retrain"):
        check_head_backbone({BACKBONE_METADATA_KEY: "some-other-net"}, backbone_id(LITE0, 128))


def test_the_classifier_refuses_an_embedder_of_another_backbone():
    class Lite1Embedder:
        name, backbone, input_size = "fake", LITE1, 128
        backbone_id = backbone_id(LITE1, 128)

    with pytest.raises(ConfigError, match="embedder computes efficientnet-lite1@"):
        SpeciesClassifier.from_weights(HEAD, input_size=128, backbone=LITE0, embedder=Lite1Embedder())
    clf = SpeciesClassifier.from_weights(HEAD, input_size=128, backbone=LITE1, embedder=Lite1Embedder())
    assert clf.embedder.backbone == LITE1
