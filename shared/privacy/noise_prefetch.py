"""The DP-SGD noise of a training round drawn ahead, on a second thread, while the steps compute their gradients.

DP-SGD's Gaussian noise does not depend on the data (Abadi et al. 2016, Alg. 1: the draw N(0, sigma^2 I) is
independent of the batch), so a round of ``steps`` steps of ``d`` parameters needs exactly ``steps`` vectors of
``d`` standard normals that can be drawn before the gradients they are added to exist. :class:`PrefetchedNormals`
draws them one step ahead on a worker thread, from a :class:`~shared.privacy.randomness.SecureRandom` of its own
(a fresh ``os.urandom`` key, so the noise stream is never the stream that samples the batches), while the training
thread runs the forward and backward passes: numpy's ziggurat and torch's kernels both release the GIL, so on a
gateway with a free core the draw leaves the step's critical path. It moves the draw's cost, it does not remove
it, and the handoff between the threads costs CPU of its own, so it pays only for large models
(:func:`worth_prefetching`). Measured on a 2-core x86 machine at batch 64, two runs, wall / CPU time per step
against the draw in line (``benchmarks/dp_step.py --round-steps 10``; docs/results/benchmarks.md): d = 12,810 (the
head) 1.01x / 1.15-1.31x, 41,322 0.84-0.87x / 0.86-1.12x, 82,634 0.62-0.63x / 1.02-1.08x, 330,506 0.57-0.58x /
1.05-1.08x.

Guarantees:
- each vector is handed out once, and vectors left when the round ends are discarded, never reused;
- at most two vectors are held ahead (one queued, one being drawn): memory ``2 * 8 d`` bytes;
- a process forked while a prefetcher is open never reads the parent's vectors: it draws synchronously from a
  fresh :class:`SecureRandom` (which rekeys after a fork);
- a seeded source (:class:`~shared.privacy.randomness.SeededRandom`, tests and demos) is never prefetched, so a
  seeded run draws its noise in the same order as without the prefetcher and stays reproducible.
"""

from __future__ import annotations

import os
import queue
import threading
from types import TracebackType

import numpy as np

from shared.privacy.randomness import RandomSource, SecureRandom

__all__ = ["PrefetchedNormals", "PREFETCH_MIN_SIZE", "worth_prefetching"]

#: The fewest parameters whose noise is drawn ahead: at about 10 ns a normal the draw of d = 65,536 takes about
#: 0.7 ms, well above the 0.1-0.25 ms of CPU the handoff between the threads costs per step (module docstring).
PREFETCH_MIN_SIZE = 65_536


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform
        return os.cpu_count() or 1


def worth_prefetching(size: int) -> bool:
    """Whether a round's noise of ``size`` parameters should be drawn ahead: at least :data:`PREFETCH_MIN_SIZE`
    parameters, and more than one CPU this process may run on (with one, the worker only takes turns with the
    steps)."""
    return int(size) >= PREFETCH_MIN_SIZE and _usable_cpus() > 1


class PrefetchedNormals:
    """A :class:`~shared.privacy.randomness.RandomSource` whose ``standard_normal(d)`` returns vectors drawn ahead
    on a worker thread (module docstring); use it as a context manager around the round's steps.

    Args:
        source: the round's random source. A :class:`SecureRandom` is replaced by a fresh one of the same cipher
            for the prefetched noise; any other source (seeded) is used directly and synchronously.
        size: d, the length of every vector the steps ask for (the model's trainable parameters).
        count: how many vectors the round needs (its local steps); no more are drawn.

    Raises:
        ValueError: ``size`` or ``count`` negative.
    """

    def __init__(self, source: RandomSource, *, size: int, count: int) -> None:
        if int(size) < 0 or int(count) < 0:
            raise ValueError(f"size and count must be >= 0, got size={size}, count={count}")
        self._source = source
        self._size = int(size)
        self._left = int(count)  # vectors the worker may still draw
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._ready: queue.Queue[np.ndarray | BaseException] = queue.Queue(maxsize=1)
        self._worker: threading.Thread | None = None
        if isinstance(source, SecureRandom) and self._left > 0 and self._size > 0:
            self._noise = SecureRandom(cipher=source.cipher)
            self._worker = threading.Thread(target=self._draw_ahead, name="dp-noise-prefetch", daemon=True)
            self._worker.start()

    @property
    def prefetching(self) -> bool:
        """True while a worker thread draws ahead (a secure source, vectors still to come)."""
        return self._worker is not None

    def _draw_ahead(self) -> None:
        for _ in range(self._left):
            try:
                item: np.ndarray | BaseException = self._noise.standard_normal(self._size)
            except BaseException as exc:  # handed to the training thread, raised there
                item = exc
            while not self._stop.is_set():
                try:
                    self._ready.put(item, timeout=0.5)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or isinstance(item, BaseException):
                return

    def random(self, size: int) -> np.ndarray:
        """float64 (size,) uniforms from the round's own source (not prefetched)."""
        return self._source.random(size)

    def standard_normal(self, size: int | tuple[int, ...]) -> np.ndarray:
        """float64 i.i.d. N(0, 1): the next prefetched vector when ``size`` is the prefetched ``d`` and one is
        left; otherwise (another size, the vectors used up, a forked process, a seeded source) a synchronous draw.

        Raises:
            whatever the worker's draw raised.
        """
        if self._worker is None or size != self._size or self._left <= 0:
            return self._source.standard_normal(size)
        if os.getpid() != self._pid:  # a forked child: never the parent's vectors
            self.close()
            return SecureRandom(cipher=self._noise.cipher).standard_normal(size)
        item = self._ready.get()
        self._left -= 1
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        """Stop the worker and discard every vector not handed out. Idempotent."""
        worker, self._worker = self._worker, None
        self._left = 0
        if worker is None or os.getpid() != self._pid:
            # a forked child has no worker thread, and its copy of the queue (whose lock the parent's worker may
            # have held at the fork) is never touched: the child just stops reading it
            return
        self._stop.set()
        self._discard()  # unblocks a worker waiting to queue its vector
        worker.join()
        self._discard()

    def _discard(self) -> None:
        while True:
            try:
                self._ready.get_nowait()
            except queue.Empty:
                return

    def __enter__(self) -> PrefetchedNormals:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
