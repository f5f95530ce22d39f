"""Suite-wide settings that make the tests independent of the terminal they run in.

Rich reads ``COLUMNS`` when a ``Console`` is made (the CLIs make theirs at import) and otherwise falls back to 80
columns when the output is not a terminal, so CLI output wrapped differently under CI, under a narrow terminal and
with long temporary paths. Pinning a wide, fixed width here, before any project module is
imported, gives every test the same, unwrapped text whatever the terminal is; ``LINES`` likewise.
"""

from __future__ import annotations

import os

os.environ["COLUMNS"] = "400"
os.environ["LINES"] = "100"
os.environ.pop("TERMINAL_WIDTH", None)  # typer's own override of the width


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest's Config
    """Where torch is absent, the gateway embeds with the backbone graph an interpreter with torch exported into
    ``$WILDFED_TEST_ARTIFACTS`` (tests/gateway_backend.py), given as an ONNX Runtime gateway is given it."""
    from tests.gateway_backend import prebuilt_backbone

    backbone = prebuilt_backbone()
    if backbone is not None:
        os.environ.setdefault("WILDFED_BACKBONE_ONNX", str(backbone))


def pytest_report_header(config) -> str:  # noqa: ANN001 - pytest's Config
    """Which training backend the gateway's tests run sites with (tests/gateway_backend.py), on the run's first
    lines: torch where it is installed, else ONNX Runtime on artifacts an interpreter with torch made."""
    import sys

    from tests.gateway_backend import ARTIFACTS_ENV, GATEWAY_BACKEND

    line = f"python {sys.version.split()[0]}; gateway tests train with backend {GATEWAY_BACKEND}"
    if GATEWAY_BACKEND == "ort":
        source = os.environ.get(ARTIFACTS_ENV) or ("(unset: tests that train skip, tests that embed photos fail; "
                                                   "see tests/gateway_backend.py)")
        line += f" (torch is not installed; ORT artifacts and the backbone graph from {ARTIFACTS_ENV}={source})"
    return line
