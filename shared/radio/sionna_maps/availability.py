"""Whether Sionna RT can run here, checked without importing anything that could crash: its Python packages, and a
libLLVM that Dr.Jit's CPU backend can use (Debian's libllvm19); the install steps when not."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
from pathlib import Path

from shared.errors import ConfigError

_REQUIRED_MODULES = ("drjit", "mitsuba", "sionna", "importlib_resources", "ipywidgets", "pythreejs", "IPython",
                     "scipy", "matplotlib")
_LLVM_CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libLLVM-19.so", "/usr/lib/aarch64-linux-gnu/libLLVM-19.so",
                    "/usr/lib/*-linux-gnu/libLLVM.so.19*", "/usr/lib/llvm-19/lib/libLLVM*.so*")
INSTALL_STEPS = ("apt-get install -y libllvm19; export DRJIT_LIBLLVM_PATH=/usr/lib/x86_64-linux-gnu/libLLVM-19.so; "
                 "pip install mitsuba==3.9.1 drjit==1.5.0 'importlib_resources>=6.4.5' 'ipywidgets>=8.1.5' "
                 "'pythreejs>=2.4.2'; pip install --no-deps sionna-rt==2.2.0 (docs/radiomap-data.md)")


class SionnaUnavailable(ConfigError):
    """Sionna RT cannot run here: a Python package or Debian's libllvm19 is missing, or ``DRJIT_LIBLLVM_PATH`` points
    at a library that is missing or known to crash Dr.Jit. The message names what is missing; ``fix`` gives
    :data:`INSTALL_STEPS`."""


def _llvm_major(path: Path) -> int | None:
    match = re.search(r"LLVM(?:-|\.so\.)(\d+)", path.name)
    return int(match.group(1)) if match else None


def llvm_library(*, environ: dict[str, str] | None = None) -> Path:
    """The libLLVM that Dr.Jit's CPU backend will load: ``DRJIT_LIBLLVM_PATH`` if set, else Debian's libllvm19.

    Without ``DRJIT_LIBLLVM_PATH`` Dr.Jit searches the default names and finds Debian 12's LLVM 14 or 15, which crash
    it; so the variable must name LLVM 19 (the version this module was checked with). When it is unset and a
    libLLVM-19 is found at a standard place (``/usr/lib/x86_64-linux-gnu/libLLVM-19.so`` and the like), the
    variable is set to it in ``environ`` (default ``os.environ``), before Dr.Jit is imported.

    Returns:
        the library's path.

    Raises:
        SionnaUnavailable (field ``DRJIT_LIBLLVM_PATH``): the variable names a missing file or an LLVM 14/15
            library, or it is unset and no libLLVM-19 is installed.
    """
    env = os.environ if environ is None else environ
    given = env.get("DRJIT_LIBLLVM_PATH")
    if given:
        path = Path(given)
        if not path.is_file():
            raise SionnaUnavailable(f"{given} does not exist", field="DRJIT_LIBLLVM_PATH", fix=INSTALL_STEPS)
        major = _llvm_major(path)
        if major is not None and major <= 15:
            raise SionnaUnavailable(f"{given} is LLVM {major}, which crashes Dr.Jit 1.5's CPU backend",
                                    field="DRJIT_LIBLLVM_PATH", fix=INSTALL_STEPS)
        return path
    for pattern in _LLVM_CANDIDATES:
        for found in sorted(glob.glob(pattern)):
            if Path(found).is_file():
                env["DRJIT_LIBLLVM_PATH"] = found
                return Path(found)
    raise SionnaUnavailable("DRJIT_LIBLLVM_PATH is unset and no libLLVM-19 is installed (Debian's LLVM 14 and 15 "
                            "crash Dr.Jit)", field="DRJIT_LIBLLVM_PATH", fix=INSTALL_STEPS)


def check_sionna(*, environ: dict[str, str] | None = None) -> None:
    """Fail early, with the install steps, if Sionna RT cannot run; never imports a module that could crash.

    Checks that every module ``import sionna.rt`` needs is installed (drjit, mitsuba, sionna, importlib_resources,
    ipywidgets, pythreejs, IPython, scipy, matplotlib) and resolves :func:`llvm_library` (in ``environ``, default
    ``os.environ``).

    Raises:
        SionnaUnavailable (a ConfigError): what is missing (field ``sionna`` for packages,
            ``DRJIT_LIBLLVM_PATH`` for LLVM), ``fix`` = :data:`INSTALL_STEPS`.
    """
    missing = [m for m in _REQUIRED_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise SionnaUnavailable(f"Sionna RT needs the Python packages {', '.join(missing)}, which are not installed",
                                field="sionna", fix=INSTALL_STEPS)
    llvm_library(environ=environ)
