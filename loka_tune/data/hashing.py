"""Stable hashing for data sources: categorical values to ids, seeds, train/eval splits.

Everything here is a pure function of its arguments, identical across processes, machines
and Python versions (Python's own ``hash()`` is salted per process and is never used).

Formulas (tests pin them, so changing one is a breaking change of every hashed dataset):

- ``stable_id(feature, value, hash_size)``:
  ``1 + u64le(blake2b(f"{feature}={value}".encode("utf-8"), digest_size=8)) % (hash_size - 1)``;
  id 0 is reserved for a missing (empty) value.
- ``mix_seed(*parts)``: ``u64le(blake2b("\\x1f".join(map(str, parts)), digest_size=8)) >> 1``,
  a 63-bit seed for ``torch.Generator.manual_seed``.
- ``split_uniform(keys)``: splitmix64 of each integer key, top 53 bits as a float in [0, 1).
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["stable_id", "IdCache", "mix_seed", "split_uniform", "MISSING_ID"]

MISSING_ID = 0  # reserved id of an empty categorical field in every hashed source


def stable_id(feature: str, value: str, hash_size: int) -> int:
    """The id of categorical ``value`` of ``feature`` in ``[1, hash_size)``; 0 means missing.

    ``feature`` is the column name (``"C1"`` .. ``"C26"`` for Criteo, the header name for Avazu),
    so equal strings in different columns get independent ids.
    """
    if hash_size < 2:
        raise ValueError(f"hash_size must be >= 2 (id 0 is reserved for missing), got {hash_size=}")
    if value == "":
        return MISSING_ID
    digest = hashlib.blake2b(f"{feature}={value}".encode("utf-8"), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % (hash_size - 1)


class IdCache(dict):
    """``cache[value]`` is ``stable_id(feature, value, hash_size)``, computed once per value.

    Holds at most ``limit`` values (then starts over), so memory stays bounded on huge files.
    """

    def __init__(self, feature: str, hash_size: int, limit: int = 1 << 20) -> None:
        super().__init__()
        stable_id(feature, "x", hash_size)  # validates hash_size
        self.feature, self.hash_size, self.limit = feature, hash_size, limit

    def __missing__(self, value: str) -> int:
        if len(self) >= self.limit:
            self.clear()
        i = self[value] = stable_id(self.feature, value, self.hash_size)
        return i


def mix_seed(*parts: object) -> int:
    """A 63-bit seed derived stably from ``parts`` (ints, strings), e.g. ``(seed, "train", epoch)``."""
    text = "\x1f".join(str(p) for p in parts)
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64 constants (Steele et al. 2014)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def split_uniform(keys: np.ndarray, salt: int = 0) -> np.ndarray:
    """A uniform float64 in [0, 1) per integer key (splitmix64), stable everywhere.

    File sources put row ``r`` (its 1-based line number) in the eval split when
    ``split_uniform([r])[0] < eval_fraction``.
    """
    x = np.asarray(keys, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = x + np.uint64(salt & 0xFFFFFFFFFFFFFFFF) * _M1 + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
