"""Pieces shared by the coordinator benchmarks (ingest.py, round_mqtt.py, load_200.py): a float32 model of a chosen
size in several tensors, signed updates of simulated sites, the load average, and a table printer.

Nothing here is timed by itself; the scripts decide what to time.
"""

from __future__ import annotations

import resource
from collections.abc import Mapping, Sequence

import numpy as np

from _timing import load_average  # the script's folder, as every benchmark imports it

__all__ = ["model_template", "head_template", "dp_event", "num_parameters", "num_bytes", "update_delta", "seal_update", "load_average",
           "peak_rss_mib", "rss_mib", "reset_peak_rss", "print_table", "MiB"]

MiB = float(1 << 20)

# Shapes of the default 1,000,000-parameter model: a small CNN trunk ("phi.") and a classifier head ("psi."), the
# phi/psi naming of shared.models.head (a synthetic size for the transport benchmarks). Sums to exactly 1,000,000.
_SHAPES_1M: dict[str, tuple[int, ...]] = {
    "phi.conv1.weight": (32, 1, 3, 3),      # 288
    "phi.conv2.weight": (64, 32, 3, 3),     # 18,432
    "phi.fc1.weight": (512, 1536),          # 786,432
    "phi.fc1.bias": (512,),                 # 512
    "psi.weight": (378, 512),               # 193,536
    "psi.bias": (800,),                     # 800
}


def model_template(parameters: int = 1_000_000, seed: int = 0) -> dict[str, np.ndarray]:
    """A float32 model with about ``parameters`` parameters in six tensors (exactly 1,000,000 by default; other
    sizes scale the large matrices' first dimension)."""
    rng = np.random.default_rng(seed)
    if parameters == 1_000_000:
        shapes = dict(_SHAPES_1M)
    else:
        scale = parameters / 1_000_000
        shapes = {k: (max(1, round(s[0] * scale)), *s[1:]) if k in ("phi.fc1.weight", "psi.weight") else s
                  for k, s in _SHAPES_1M.items()}
    return {k: (rng.standard_normal(s) * 0.05).astype(np.float32) for k, s in shapes.items()}


def head_template(num_classes: int = 10, seed: int = 0) -> dict[str, np.ndarray]:
    """The demo's camera model: the linear head on 1280-d backbone embeddings (``shared.models.head``, no adapter),
    ``psi.weight`` (num_classes, 1280) and ``psi.bias`` (num_classes,), float32 (12,810 parameters for 10
    classes, the demo's species table), initialised as the head is (uniform)."""
    from shared.models.head import HeadConfig, initial_weights

    weights = initial_weights(HeadConfig(num_classes=num_classes, adapter_width=0, embedding_dim=1280), seed,
                              head_init="uniform")
    return {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}


def num_parameters(tensors: Mapping[str, np.ndarray]) -> int:
    return int(sum(v.size for v in tensors.values()))


def num_bytes(tensors: Mapping[str, np.ndarray]) -> int:
    return int(sum(v.nbytes for v in tensors.values()))


def update_delta(template: Mapping[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """A site's model delta: small float32 values with the template's names and shapes (seeded per site)."""
    rng = np.random.default_rng(10_000 + seed)
    return {k: (rng.standard_normal(v.shape) * 1e-3).astype(np.float32) for k, v in template.items()}


def dp_event():  # noqa: ANN201 - a shared.privacy.events.DPSGDEvent (imported here, where it is needed)
    """The DP-SGD event a simulated ccdp gateway reports per category: z = 1.2, q = 0.05, 5 steps."""
    from shared.privacy.events import DPSGDEvent

    return DPSGDEvent(noise_multiplier=1.2, sampling_rate=0.05, steps=5)


def seal_update(*, key, federation_id: str, site_id: str, round: int, model_hash: str,  # noqa: ANN001 - Ed25519 key
                delta: Mapping[str, np.ndarray], num_examples: int, sequence: int = 1,
                chunk_size: int | None = None, categories: Sequence[str] = ()) -> bytes:
    """The wire bytes of a site's signed UPDATE envelope, sealed with the piece size of ``chunk_size``
    (``shared.transfer.piece_size_for``; None: the default, 256 KiB) as a gateway seals it. ``categories``: IUCN
    codes it reports :func:`dp_event` for (privacy ``ccdp``); empty: no DP events (privacy ``none``)."""
    from shared.envelope import DEFAULT_PIECE_SIZE, MessageKind, seal
    from shared.protocol import UpdateReport, encode_update
    from shared.transfer import piece_size_for

    from shared.iucn import IUCNCategory

    events = {IUCNCategory(c): dp_event() for c in categories}
    payload = encode_update(UpdateReport(num_examples=num_examples, local_steps=5, events=events), delta)
    return seal(private_key=key, federation_id=federation_id, site_id=site_id, round=round,
                base_model_hash=model_hash, kind=MessageKind.UPDATE, sequence=sequence, payload=payload,
                piece_size=DEFAULT_PIECE_SIZE if chunk_size is None else piece_size_for(chunk_size)).to_bytes()


def _proc_status_kib(field: str, pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return float(line.split()[1])
    raise KeyError(field)


def peak_rss_mib(pid: int | str = "self") -> float:
    """Peak resident set size of a process (``VmHWM`` of ``/proc/<pid>/status``), MiB. Unlike ``ru_maxrss`` it is
    not inherited across fork + exec (a child of a big parent would otherwise report the parent's peak) and it can
    be reset (:func:`reset_peak_rss`). Falls back to ``ru_maxrss`` where there is no ``/proc``."""
    try:
        return _proc_status_kib("VmHWM", pid) / 1024.0
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def rss_mib(pid: int | str = "self") -> float:
    """Current resident set size (``VmRSS``), MiB."""
    return _proc_status_kib("VmRSS", pid) / 1024.0


def reset_peak_rss() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain fixed-width table (first column left-aligned, the others right-aligned)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for r in cells[1:]:
        print(line(r))
