"""Coverage-guided fuzzing of the coordinator's upload path with atheris (libFuzzer for Python), by hand.

Not part of the tests and not a project dependency (the hypothesis fuzzer in
``tests/coordinator/test_fuzz_transport.py`` is what CI runs)::

    .venv/bin/pip install atheris          # a wheel exists for CPython 3.11 (atheris 3.0.0)
    .venv/bin/python benchmarks/fuzz_atheris.py -runs=20000            # or -max_total_time=600
    .venv/bin/python benchmarks/fuzz_atheris.py corpus_dir/ -max_len=20000   # keep a corpus between runs

Each input drives one message through the real :class:`coordinator.inbound.transfers.TransferReceiver` of the fuzz
test's world (``Harness``: SQLite store in a temporary folder, enrolled sites, open round 2 with ``s1``'s update stored
and aggregated). The first byte picks how the rest becomes a message:

0. raw bytes on ``s2``'s update topic (the parser's view);
1. a genuine ``s2`` update with the input XOR-ed over it (bit flips anywhere after signing; at least one);
2. a genuine ``s2``-signed update whose payload is the input (every check behind the signature: safetensors,
   tensors, report);
3. a genuine ``s2``-signed MANIFEST whose payload is the input;
4. a chunk: ``b"WFC2"`` (``shared.transfer.CHUNK_MAGIC``) + the input;
5. a genuine ``s2``-signed update whose ``wildfed`` report JSON is the input (UTF-8, errors replaced).

A crash is any exception out of ``handle`` or a broken invariant: a result other than None or a ``Rejected`` with a
reason and a detail, an accepted update, or a changed aggregate / ``updates`` / ``ledger`` table.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

try:
    import atheris
except ImportError:  # not a project dependency
    raise SystemExit("fuzz_atheris.py needs atheris, which is not a project dependency: "
                     "`.venv/bin/pip install atheris` (a wheel exists for CPython 3.11), then run it again") from None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/ is not installed

with atheris.instrument_imports():
    import numpy as np

    from shared.codec import encode_tensors
    from shared.envelope import MessageKind
    from shared.transfer import CHUNK_MAGIC

    from coordinator.inbound.context import Accepted
    from coordinator.inbound.reject import Rejected, RejectReason
    from tests.coordinator.test_fuzz_transport import Harness, full_delta, good_payload

logging.getLogger("coordinator").setLevel(logging.ERROR)
HARNESS = Harness(Path(tempfile.mkdtemp(prefix="wildfed-atheris-")))
TOPIC = Harness.topic("s2")
GENUINE = HARNESS.seal("s2", payload=good_payload(0.5, 10))
DELTA = full_delta(0.5)


def message(data: bytes) -> tuple[int, bytes]:
    """``(mode, message)`` that input ``data`` stands for (see the module docstring)."""
    mode, rest = (data[0] % 6, data[1:]) if data else (0, b"")
    if mode == 0:
        return mode, rest
    if mode == 1:
        out = bytearray(GENUINE)
        for i, b in enumerate(rest[:len(out)]):
            out[i] ^= b
        if out == GENUINE:
            out[-1] ^= 1  # at least one bit flipped: the untouched genuine update would (rightly) be accepted
        return mode, bytes(out)
    if mode == 2:
        return mode, HARNESS.seal("s2", payload=rest)
    if mode == 3:
        return mode, HARNESS.seal("s2", payload=rest, kind=MessageKind.MANIFEST)
    if mode == 4:
        return mode, CHUNK_MAGIC + rest
    report = rest.decode("utf-8", errors="replace")
    return mode, HARNESS.seal("s2", payload=encode_tensors(DELTA, {"wildfed": report}))


def test_one_input(data: bytes) -> None:
    mode, raw = message(data)
    result = HARNESS.receiver.handle(TOPIC, raw)
    if isinstance(result, Accepted):
        # only a genuinely signed, valid update may get here: the fuzzer wrote a valid payload or report
        assert mode in (2, 5), (mode, result)
        print(f"fuzz_atheris: input built a valid update ({result.num_examples} examples); s2 is now stored")
        HARNESS.snapshot()
        return
    if result is not None:
        assert isinstance(result, Rejected), result
        assert isinstance(result.reason, RejectReason) and result.detail, result
    HARNESS.assert_unchanged("atheris input")


def main() -> None:
    np.seterr(all="ignore")
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
