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
