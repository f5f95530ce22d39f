"""Secure Gaussian noise: normals per second of the cipher-stream source against the previous one, from one run.

Run by hand (not part of the tests)::

    .venv/bin/python benchmarks/secure_noise.py [--sizes 12810,330506,1000000] [--repeats 50]

For each size d (12,810: the demo's head; 330,506: the head with the 256-wide adapter) it times, interleaved:

- ``previous (AES-256-CTR, polar)``: the source used before (``benchmarks/_polar_noise.py``: ``cryptography``'s
  AES-256-CTR keystream, the polar method in numpy passes), the baseline of every ratio;
- ``SecureRandom aes128-ctr`` and ``SecureRandom chacha20``: ``shared.privacy.randomness.SecureRandom`` on each
  cipher (numpy's ziggurat on randomgen's AES-128-CTR or ChaCha20 keystream), the first the default on AES-NI;
- ``PCG64 (not secure)``: numpy's ``default_rng().standard_normal``, the same ziggurat on a fast non-cryptographic
  generator: the floor the transform sets;
- the raw keystreams alone (64-bit words, no transform), in GB/s: ``cryptography`` AES-256-CTR, randomgen
  AES-128-CTR and ChaCha20.

Medians of ``--repeats`` interleaved repeats (``_timing.interleaved``); normals per second and the ratio to the
previous source. Every draw is single-threaded, so ``--clock cpu`` (this process's CPU time) gives the same
figures as wall time on an idle machine and leaves out other processes' load on a busy one.

Each row also prints the minor page faults per draw. The previous source's temporaries (about 130 kB each at the
head's d) sit at glibc's default 128 kB mmap and trim thresholds, so in a fresh process they are mapped and
faulted in at every draw (about 120 faults, 2-3x its time); in a gateway process, where torch has raised glibc's
dynamic thresholds, they are not. ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=67108864`` before the
command gives the fault-free comparison; ``dp_step.py --previous-noise`` measures both sources in the training
process itself.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable

import numpy as np
from _polar_noise import PolarAes256
from _timing import interleaved, load_average


def _faults_per_call(step: Callable[[], object], calls: int = 20) -> float:
    """Minor page faults of this process per call of ``step`` (``getrusage``), over ``calls`` calls."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="12810,330506,1000000", help="comma-separated numbers of normals")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time by wall clock (time.perf_counter) or by this process's CPU time (time.process_time)")
    args = parser.parse_args()

    from shared.privacy.randomness import SecureRandom, default_cipher, secure_generator

    sizes = [int(s) for s in args.sizes.split(",")]
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"default cipher here: {default_cipher()}; clock: {args.clock}; {load_average()}")
    previous, aes, chacha = PolarAes256(), SecureRandom(cipher="aes128-ctr"), SecureRandom(cipher="chacha20")
    pcg = np.random.default_rng()
    aes_bits = secure_generator(cipher="aes128-ctr").bit_generator
    chacha_bits = secure_generator(cipher="chacha20").bit_generator
    base = "previous (AES-256-CTR, polar)"
    for d in sizes:
        normals: dict[str, Callable[[], object]] = {
            base: lambda d=d: previous.standard_normal(d),
            "SecureRandom aes128-ctr": lambda d=d: aes.standard_normal(d),
            "SecureRandom chacha20": lambda d=d: chacha.standard_normal(d),
            "PCG64 (not secure)": lambda d=d: pcg.standard_normal(d),
        }
        raw: dict[str, Callable[[], object]] = {
            "keystream cryptography AES-256-CTR": lambda d=d: previous.words(d),
            "keystream randomgen AES-128-CTR": lambda d=d: aes_bits.random_raw(d),
            "keystream randomgen ChaCha20": lambda d=d: chacha_bits.random_raw(d),
        }
        times = interleaved({**normals, **raw}, args.repeats, clock=clock)
        med = {name: float(np.median(t)) for name, t in times.items()}
        faults = {name: _faults_per_call(step) for name, step in {**normals, **raw}.items()}
        print(f"\nd = {d:,} normals per draw; {args.repeats} interleaved repeats")
        for name in normals:
            print(f"  {name:34s}: median {med[name] * 1e3:8.3f} ms  {d / med[name] / 1e6:7.1f} M normals/s  "
                  f"speed-up over previous {med[base] / med[name]:5.2f}x  page faults {faults[name]:.0f}")
        for name in raw:
            print(f"  {name:34s}: median {med[name] * 1e3:8.3f} ms  {8 * d / med[name] / 1e9:7.2f} GB/s of keystream  "
                  f"page faults {faults[name]:.0f}")
    print(f"\n{load_average()}")


if __name__ == "__main__":
    main()
