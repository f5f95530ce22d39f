"""A persistent cache of noise calibrations, as JSON files keyed by every public input of the calibration.

Calibrating a DP-SGD plan (``edge_sdk.privacy.ccdp.plan_ccdp``) is a root search through dp-accounting's accountant:
seconds per process on a gateway, for values that are public and the same every time a federation restarts. The
in-process memo (``functools.lru_cache``) forgets them at every process start; this cache keeps them on disk.

What a cached result is trusted for, and what it is not:

- **Key.** SHA-256 of the canonical JSON (sorted keys, no spaces, floats as ``repr``, which round-trips exactly) of
  ``{format, kind, inputs, environment}``: ``inputs`` are every public value the calibration reads, as the caller
  normalised them; ``environment`` is :func:`environment`: the versions of dp-accounting, numpy, scipy and Python,
  and a SHA-256 of the source files of the modules that compute the calibration (so an edit of the calibration code
  misses the cache instead of reusing what the old code found).
- **Entry.** ``<root>/<kind>-<key>.json`` holds the key's record, the result and a SHA-256 of both. It is written to a
  temporary file in the same folder and renamed over the target (``os.replace``, atomic on POSIX): readers see the
  old entry or the new one, never a torn one; concurrent writers of one key write the same bytes. No fsync: an
  entry lost or torn by a power cut is detected (below) and recomputed, so durability buys nothing here.
- **Read.** An entry is used only if it parses, its checksum matches, its record equals the one asked for (inputs
  and environment, compared as canonical JSON, not only through the file name), the caller's ``decode`` accepts the
  result (types, ranges, categories) and the caller's ``verify`` passes: a cheap re-check with the accountant that
  the cached values stay within the budget (one accountant evaluation per guarantee, instead of the search's tens).
  Anything else is logged, ignored and recomputed; the fresh result overwrites the entry.
- Results are JSON numbers, never pickles (the cache folder is only as trusted as the disk it is on, and a pickle
  executes code when read). A float read back is bit-identical to the float written.

A write that fails (read-only or full disk) is logged and otherwise ignored: the cache only saves time.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

__all__ = ["FORMAT", "CalibrationCache", "environment", "canonical_json"]

log = logging.getLogger(__name__)

#: Version of the entry layout (bumped when it changes; an entry of another format is a miss).
FORMAT = 1
_LIBRARIES = ("dp-accounting", "numpy", "scipy")

T = TypeVar("T")


def canonical_json(value: Any) -> str:
    """``value`` as canonical JSON: sorted keys, no spaces, floats as their shortest round-tripping ``repr``.

    Raises:
        ValueError: a NaN or infinity (not JSON), TypeError: a value JSON cannot hold.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("ascii")).hexdigest()


@functools.lru_cache(maxsize=16)
def _environment(module_names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    python = f"{platform.python_implementation()} {sys.version_info[0]}.{sys.version_info[1]}"
    items: dict[str, str] = {"python": python}
    for lib in _LIBRARIES:
        try:
            items[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            items[lib] = "absent"
    digest = hashlib.sha256()
    for name in module_names:
        path = getattr(sys.modules[name], "__file__", None)
        digest.update(name.encode() + b"\0")
        try:
            digest.update(Path(path).read_bytes() if path else b"<no source>")
        except OSError:
            digest.update(b"<unreadable source>")
        digest.update(b"\0")
    items["code"] = digest.hexdigest()
    return tuple(sorted(items.items()))


def environment(*modules: ModuleType) -> dict[str, str]:
    """What else a calibration's result depends on besides its inputs: the versions of dp-accounting, numpy, scipy
    and Python, and ``code``, a SHA-256 over the source files of ``modules`` (the modules that compute it).

    Memoised per process (the versions and sources do not change under a running process)."""
    return dict(_environment(tuple(m.__name__ for m in modules)))


class CalibrationCache:
    """Calibration results on disk, one JSON file per key (module docstring).

    Args:
        root: the cache folder (created on the first write). A gateway's is ``<wildfed cache>/calibration``
            (``edge_sdk.site_paths.calibration_cache_dir``).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"CalibrationCache({str(self.root)!r})"

    @staticmethod
    def record(kind: str, inputs: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
        """The JSON record that the key hashes: ``{format, kind, inputs, environment}``."""
        return {"format": FORMAT, "kind": kind, "inputs": dict(inputs), "environment": dict(env)}

    @classmethod
    def key(cls, kind: str, inputs: Mapping[str, Any], env: Mapping[str, str]) -> str:
        """Hex SHA-256 of the canonical record: equal for equal inputs and environment, different otherwise.

        Raises:
            ValueError, TypeError: the inputs are not JSON (a NaN, an object).
        """
        return _sha256(canonical_json(cls.record(kind, inputs, env)))

    def path(self, kind: str, key: str) -> Path:
        """Where the entry of ``key`` lives."""
        return self.root / f"{kind}-{key}.json"

    def load(self, kind: str, inputs: Mapping[str, Any], env: Mapping[str, str], *,
             decode: Callable[[Any], T], verify: Callable[[T], bool]) -> T | None:
        """The cached result for ``(kind, inputs, env)``, or None when there is none or it is not trustworthy.

        Args:
            decode: JSON result -> the caller's value; raises ValueError, TypeError or KeyError on anything malformed.
            verify: a cheap re-check of the decoded value (e.g. its epsilon is within the budget); False rejects it.

        A present entry that fails any check is logged at WARNING and treated as absent.
        """
        record = self.record(kind, inputs, env)
        wanted = canonical_json(record)
        path = self.path(kind, _sha256(wanted))
        try:
            text = path.read_text(encoding="ascii")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("calibration cache: cannot read %s (%s); recalibrating", path, exc)
            return None
        try:
            entry = json.loads(text)
            if not isinstance(entry, dict) or set(entry) != {"record", "result", "sha256"}:
                raise ValueError("not a calibration cache entry")
            if entry["sha256"] != _sha256(canonical_json({"record": entry["record"], "result": entry["result"]})):
                raise ValueError("checksum mismatch (a torn or altered file)")
            if canonical_json(entry["record"]) != wanted:
                raise ValueError("its inputs or environment differ from the ones asked for")
            value = decode(entry["result"])
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("calibration cache: ignoring %s: %s; recalibrating", path, exc)
            return None
        if not verify(value):
            log.warning("calibration cache: %s does not pass the accountant's re-check; recalibrating", path)
            return None
        return value

    def store(self, kind: str, inputs: Mapping[str, Any], env: Mapping[str, str], result: Any) -> Path | None:
        """Write the entry of ``(kind, inputs, env)`` with ``result`` (JSON-ready) atomically; returns its path, or
        None when it could not be written (logged; the caller goes on without the cache)."""
        record = self.record(kind, inputs, env)
        body = {"record": record, "result": result}
        text = canonical_json({**body, "sha256": _sha256(canonical_json(body))})
        path = self.path(kind, _sha256(canonical_json(record)))
        tmp: str | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{kind}-", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="ascii") as fh:
                fh.write(text)
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            log.warning("calibration cache: cannot write %s (%s); continuing without it", path, exc)
            return None
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        return path

    def get_or_compute(self, kind: str, inputs: Mapping[str, Any], env: Mapping[str, str], *,
                       compute: Callable[[], T], encode: Callable[[T], Any], decode: Callable[[Any], T],
                       verify: Callable[[T], bool]) -> T:
        """:meth:`load`, else ``compute()`` and :meth:`store` its ``encode``-d form (errors of ``compute`` propagate;
        nothing is stored for them)."""
        value = self.load(kind, inputs, env, decode=decode, verify=verify)
        if value is not None:
            return value
        value = compute()
        self.store(kind, inputs, env, encode(value))
        return value
