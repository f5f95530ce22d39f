"""Re-export of :mod:`shared.privacy.randomness` (the secure noise source moved to ``shared`` so that the
coordinator, which adds the noise once in Global DP mode, uses the same generator as the gateways)."""

from shared.privacy.randomness import (CIPHERS, InsecureRandomnessWarning, RandomSource, SecureRandom, SeededRandom,
                                       default_cipher, make_random_source, secure_generator)

__all__ = ["RandomSource", "SecureRandom", "SeededRandom", "InsecureRandomnessWarning", "make_random_source",
           "secure_generator", "default_cipher", "CIPHERS"]
