"""The coordinator's post-hoc logit adjustment (config ``posthoc_logit_adjustment``): tasks carry the offsets computed
from the enrolled sites' public metadata (worked by hand here), the inference model is the stored model with
``psi.bias`` less those offsets, and configurations it cannot serve are refused with the field named."""

from __future__ import annotations

import numpy as np
import pytest

from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key
from shared.privacy.events import DPSGDEvent

from coordinator.service import Coordinator
from coordinator.transport import InMemoryTransport
from tests.coordinator.helpers import FakeSite, make_config

SPECIES = [{"scientific_name": "Panthera leo", "class_index": 0, "iucn_category": "VU"},
           {"scientific_name": "Bos taurus", "class_index": 1, "iucn_category": "NE"},
           {"scientific_name": "Diceros bicornis", "class_index": 2, "iucn_category": "CR"}]


EVENT = DPSGDEvent(noise_multiplier=5.0, sampling_rate=0.01, steps=1)  # far inside VU's budget


def head(num_classes: int = 3) -> dict[str, np.ndarray]:
    return {"psi.weight": np.zeros((num_classes, 1280), np.float32),
            "psi.bias": np.array([0.3, -0.1, 0.2], np.float32)}


def test_tasks_carry_offsets_from_public_metadata_and_the_inference_model_subtracts_them(tmp_path):
    transport, key = InMemoryTransport(), generate_signing_key()
    config = make_config(tmp_path, rounds=1, num_classes=3, species=SPECIES, posthoc_logit_adjustment=0.5,
                         ship_ort_artifacts=False)
    with Coordinator(config, transport=transport, signing_key=key, initial_weights=head()) as coord:
        sites = []
        # s1: 90 records over lion and cattle; s2: 30 records, cattle only; the rhino (CR) is on no public list
        for sid, n, species in (("s1", 90, ["Panthera leo", "Bos taurus"]), ("s2", 30, ["Bos taurus"])):
            site = FakeSite(sid, transport, key.public_key(), value=0.0, num_examples=n,
                            events={IUCNCategory.VU: EVENT}).attach()
            coord.enrol(sid, site.public_pem, {"capacity": n, "species": species})
            sites.append(site)
        results = coord.run()
        assert [r.status for r in results] == ["closed"]
        n = np.array([45.0, 45.0 + 30.0, 45.0])  # the rhino: the smallest listed estimate
        log_pi = np.log(n / n.sum())
        offsets = 0.5 * (log_pi - log_pi.mean())
        for site in sites:
            np.testing.assert_allclose(site.tasks[0].prediction_offsets, offsets, rtol=0, atol=1e-12)
        h, stored = coord.rounds.current_model()
        h2, served = coord.rounds.inference_model()
        assert h2 == h
        np.testing.assert_allclose(served["psi.bias"], stored["psi.bias"] - offsets, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(served["psi.weight"], stored["psi.weight"])


def test_off_by_default_tasks_carry_no_offsets_and_the_inference_model_is_the_stored_one(tmp_path):
    transport, key = InMemoryTransport(), generate_signing_key()
    config = make_config(tmp_path, rounds=1, num_classes=3, species=SPECIES, ship_ort_artifacts=False)
    with Coordinator(config, transport=transport, signing_key=key, initial_weights=head()) as coord:
        site = FakeSite("s1", transport, key.public_key(), value=0.0, num_examples=10,
                        events={IUCNCategory.VU: EVENT}).attach()
        coord.enrol("s1", site.public_pem, {"capacity": 10, "species": ["Panthera leo"]})
        coord.run()
        assert site.tasks[0].prediction_offsets is None
        np.testing.assert_array_equal(coord.rounds.inference_model()[1]["psi.bias"],
                                      coord.rounds.current_model()[1]["psi.bias"])


@pytest.mark.parametrize("overrides, message", [
    ({"strategy": {"kind": "nira"}}, "strategy \\{kind: fedavg\\}"),
    ({}, "needs the species table"),
    ({"species": SPECIES, "posthoc_logit_adjustment": -1.0}, "posthoc_logit_adjustment"),
])
def test_configurations_it_cannot_serve_are_refused(tmp_path, overrides, message):
    data = {"posthoc_logit_adjustment": 1.0, "num_classes": 3, **overrides}
    if "strategy" in overrides:
        data["species"] = SPECIES
    with pytest.raises(ConfigError, match=message):
        make_config(tmp_path, **data)
