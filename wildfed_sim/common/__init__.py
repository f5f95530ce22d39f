"""The laboratory's ground floor: what more than one experiment of wildfed_sim needs, in one place.

Modules:
    runs: the run folder (:func:`~wildfed_sim.common.runs.new_run_dir`), SIGTERM as Ctrl-C while processes run, the
        resumable run log.
    stats: mean and sample standard deviation, the paired Student-t interval.
    options: the ``typer`` options and comma-separated lists of the experiments' own command lines.
    federation: the per-process cache of a simulated federation (embedding a seed's images takes a while).
    demo_data: the demo's data split, site design and public split for a seed.

An experiment (demo, radiomap, fedsofim, privacy_utility, nira, nira_sim, tune_demo, real_photos_run, audit, ...)
imports this package, the laboratory's building blocks (animal_mnist, ecology, camtrap_writer, embeddings,
evaluation, embedded_broker, gateway_processes, fleet_check, demo_sim, detections), ``shared``, ``edge_sdk`` and
``coordinator``, and never another experiment; ``wildfed_sim.cli`` is the one module that imports them all
(tests/sim/test_experiment_imports.py).
"""
