"""The site structures of the NIRA head experiment (:mod:`wildfed_sim.nira_sim`): the demo's design, or a real
one from Wildlife Insights deployments or Snapshot Serengeti camera locations with Animal-MNIST images standing in
for the photos (:func:`real_structure_federation`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import ConfigError

STRUCTURES = ("demo", "wildlife-insights", "serengeti")
SERENGETI_SITES = 40  # locations drawn per seed (of 223): the replay trains every site in one process


def real_structure_federation(seed: int, structure: str, *, data_root: str | Path | None = None) -> Any:
    """A federation with a real site structure from ``../shared/data``: one site per Wildlife Insights deployment
    (``"wildlife-insights"``, all 38) or per Snapshot Serengeti camera location (``"serengeti"``,
    :data:`SERENGETI_SITES` locations drawn uniformly by ``seed``), each holding its own species in its own
    proportions, with Animal-MNIST images standing in for the photos (which are not in the data).

    Classes: Wildlife Insights, its 10 most recorded species; Serengeti, its 9 most annotated species and the black
    rhinoceros (CR; 45 annotations at 17 of the 223 locations), so that the CR metric has a species. Class k takes
    the images of Animal-MNIST class k. Site d gets ``round(n_ds * s_c)`` images of class c (at least one where
    ``n_ds > 0``), ``n_ds`` its real count and ``s_c = min(1, available_c / sum_d n_ds)`` one scale per class so
    that the class fits the training images (:func:`wildfed_sim.animal_mnist.split_holdout` of ``seed``); images
    are drawn without replacement, each site's byte-identical repeats dropped as the demo drops them; sites left
    without records are dropped. Each class's IUCN category is its species' in the Mammal Diversity Database 2020
    (``iucn/mdd_2020-09.csv``); a taxon it does not list (birds, the feral pig) is ``NE`` (not evaluated by that
    source).

    Returns:
        A :class:`wildfed_sim.demo_sim.SimFederation` whose ``class_names`` are the real scientific names (the
        sites' public species lists name them).

    Raises:
        DatasetError: the data files are missing. ConfigError: an unknown ``structure``.
    """
    from shared.iucn import IUCNCategory
    from wildfed_sim.animal_mnist import fetch_animal_mnist, split_holdout
    from wildfed_sim.camtrap_writer import distinct_images
    from wildfed_sim.demo_sim import SimFederation, SimSite
    from wildfed_sim.embeddings import embed_grayscale
    from wildfed_sim import nira_metadata as meta

    root = Path(data_root) if data_root is not None else Path(meta.DEFAULT_DATA_ROOT)
    rng = np.random.default_rng(seed)
    if structure == "wildlife-insights":
        counts, forced, prefix = meta.wildlife_insights_counts(root), (), "wi"
        scientific = {t: t for per in counts.values() for t in per}
    elif structure == "serengeti":
        raw = meta.serengeti_counts(root)
        scientific = {label: meta.SERENGETI_SCIENTIFIC_NAMES[label] for per in raw.values() for label in per
                      if label in meta.SERENGETI_SCIENTIFIC_NAMES}  # animals with a binomial (not birds, humans)
        keep = sorted(rng.choice(sorted(raw), size=min(SERENGETI_SITES, len(raw)), replace=False))
        counts, forced, prefix = {loc: {lbl: n for lbl, n in raw[loc].items() if lbl in scientific}
                                  for loc in keep}, ("rhinoceros",), "se"
    else:
        raise ConfigError(f"unknown site structure {structure!r}", field="structure",
                          fix=f"use one of {STRUCTURES[1:]}")
    totals: dict[str, int] = {}
    for per in counts.values():
        for taxon, n in per.items():
            totals[taxon] = totals.get(taxon, 0) + n
    ranked = [t for t, _ in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])) if t not in forced]
    names = ranked[:10 - len([f for f in forced if f in totals])] + [f for f in forced if f in totals]
    mdd = meta.load_mdd_categories(root / "iucn" / "mdd_2020-09.csv")
    categories = tuple(mdd.get(scientific[t]) or IUCNCategory.NE for t in names)
    train, test = split_holdout(fetch_animal_mnist(), 0.2, seed=seed)
    pools = {c: list(rng.permutation(np.flatnonzero(train.labels == c))) for c in range(len(names))}
    scale = {c: min(1.0, len(pools[c]) / totals[t]) for c, t in enumerate(names)}
    ranks = np.asarray([c.rank for c in categories], dtype=np.int8)
    sites, held = [], set()
    for k, (_, per) in enumerate(sorted(counts.items())):
        idx: list[int] = []
        for c, t in enumerate(names):
            n = per.get(t, 0)
            take = min(len(pools[c]), max(1, round(n * scale[c]))) if n else 0
            idx += [int(i) for i in pools[c][:take]]
            del pools[c][:take]
        if not idx:
            continue
        idx_arr = np.sort(np.asarray(idx, dtype=np.int64))
        idx_arr = idx_arr[distinct_images(train.images[idx_arr])]
        held.update(int(i) for i in idx_arr)
        labels = train.labels[idx_arr].astype(np.int64)
        species = tuple(sorted({int(c) for c in labels}))
        sites.append(SimSite(f"{prefix}-{k:02d}", embed_grayscale(train.images[idx_arr],
                                                                   train.source_indices[idx_arr]),
                             labels, ranks[labels], tuple(sorted({categories[c] for c in species},
                                                                 key=lambda c: c.rank)), species))
    public = np.asarray(sorted(set(range(len(train.labels))) - held), dtype=np.int64)
    public_features = embed_grayscale(train.images[public], train.source_indices[public])
    return SimFederation(tuple(sites), embed_grayscale(test.images, test.source_indices),
                         test.labels.astype(np.int64), public_features, categories,
                         tuple(scientific[t] for t in names))

