"""WildFed's laboratory: a whole federation on one machine (both sides, the broker, the data), and the experiments.

It stands above both sides: it imports ``edge_sdk``, ``coordinator`` and ``shared``; none of them imports it (the
import-linter contracts in pyproject.toml, tests/test_layering.py). Its command line is ``wildfed`` (:mod:`.cli`);
the operator's ``wildfed-coordinator`` holds only what runs against a real federation.

Modules:
    cli: ``wildfed demo | experiment ... | audit | clusters check-metadata``.
    demo: the camera-trap demo federation (embedded broker, coordinator, one gateway process per site).
    radio_demo: the same for radio base stations learning a radio map (``wildfed demo --task radiomap``).
    embedded_broker: the zero-setup amqtt broker of the demo.
    animal_mnist: fetch, verify and safely read the Animal-MNIST wheel; the class -> species -> IUCN table;
        a stratified held-out split.
    ecology: partition training images into camera-trap sites by biome species pools (non-IID by design).
    camtrap_writer: write one site's images as a Camtrap DP 1.0 package.
    evaluation: accuracy of a model on the held-out split (per IUCN category, per site); centralised reference.
    privacy_utility, nira, fedsofim, radiomap: the seed's experiments, their tables and plots.
    audit: the empirical privacy audit (one-run canaries, Steinke et al. 2023).
    nira_metadata: NIRA's clustering on the real Wildlife Insights / Snapshot Serengeti metadata (../shared/data).
    common: what more than one experiment needs (run folder, statistics, options, federation cache, the demo's data
        design); experiments import it and never each other (tests/sim/test_experiment_imports.py).
"""
