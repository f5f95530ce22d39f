"""``wildfed-edge package``: a site's Camtrap DP 1.0 package from the labelled photos the operator has.

One module per idea: a reader per input kind (:mod:`.folder` camtrapR species folders, :mod:`.labels_csv`,
:mod:`.timelapse`, :mod:`.megadetector`), all returning :class:`.photos.ReadResult`; :mod:`.labels` (labels to
observation types and scientific names), :mod:`.timestamps`, :mod:`.coordinates`; :mod:`.build` (the tables'
rows), :mod:`.writer` (atomic, validated write) and :mod:`.validate` (frictionless, offline). docs/packaging.md.
"""

from edge_sdk.packaging.build import PackageContent, PackageOptions, PackageSummary, build_content
from edge_sdk.packaging.coordinates import Coordinates, read_coordinates
from edge_sdk.packaging.folder import read_folder
from edge_sdk.packaging.labels import classify, load_species_map
from edge_sdk.packaging.labels_csv import read_labels_csv
from edge_sdk.packaging.megadetector import read_megadetector
from edge_sdk.packaging.photos import ReadResult, SourceBox, SourcePhoto
from edge_sdk.packaging.timelapse import read_timelapse
from edge_sdk.packaging.validate import Problem, validate_package
from edge_sdk.packaging.writer import PackageValidationError, check_destination, write_package

__all__ = ["PackageContent", "PackageOptions", "PackageSummary", "build_content", "Coordinates", "read_coordinates",
           "read_folder", "classify", "load_species_map", "read_labels_csv", "read_megadetector", "ReadResult",
           "SourceBox", "SourcePhoto", "read_timelapse", "Problem", "validate_package", "PackageValidationError",
           "check_destination", "write_package"]
