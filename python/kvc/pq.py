"""PQCache-style token selection: train a codebook on a head's keys, code them in 12 bits,
and pick the tokens a query should attend to from the codes alone.

    cb = kvc.pq.Codebook.train(keys)            # keys [T, D] float32 of one (layer, KV head)
    codes = cb.encode(keys)                     # uint16 [T, m]
    idx = kvc.pq.select(cb, codes, query, k=T // 5)
"""

import numpy as np

from . import _native
from ._arrays import as_array, uint
from ._errors import ArgumentError

__all__ = ["Codebook", "select"]


def _keys(keys):
    a = np.require(as_array(keys), dtype=np.float32, requirements="CA")
    if a.ndim != 2:
        raise ArgumentError(f"keys must be [tokens, dim], got shape {a.shape}")
    return a


def _codes(a):
    """``a`` if its values are codes (integers in 0..=65535), which numpy's cast to uint16
    would otherwise wrap; :class:`ArgumentError` if not."""
    if a.dtype == np.uint16:
        return a
    if a.dtype.kind not in "iu" or (a.size and (a.min() < 0 or a.max() > 0xFFFF)):
        raise ArgumentError(f"codes must be integers in 0..=65535 (uint16), got {a.dtype}")
    return a


class Codebook:
    """A trained codebook: residual quantization ("rq", kvc's default: 2 stages of 6 bits) or
    PQCache's product quantization ("pq")."""

    def __init__(self, native):
        self._c = native

    @classmethod
    def train(cls, keys, *, method="rq", m=2, bits=6, max_iters=None, seed=0):
        """Train on keys ``[tokens, dim]`` (converted to float32)."""
        a = _keys(keys)
        m, bits, seed = uint("m", m, 32), uint("bits", bits, 8), uint("seed", seed, 64)
        max_iters = None if max_iters is None else uint("max_iters", max_iters, 32)
        return cls(_native.Codebook.train(a, a.shape[1], str(method), m, bits, max_iters, seed))

    @property
    def dim(self):
        return self._c.dim

    @property
    def m(self):
        return self._c.m

    @property
    def bits(self):
        return self._c.bits

    def encode(self, keys):
        """Codes of keys ``[tokens, dim]``: uint16 ``[tokens, m]``."""
        a = _keys(keys)
        if a.shape[1] != self.dim:
            raise ArgumentError(f"keys must be [tokens, {self.dim}], got shape {a.shape}")
        return np.frombuffer(self._c.encode(a), dtype="<u2").reshape(a.shape[0], self.m)

    def __repr__(self):
        return f"kvc.pq.Codebook(dim={self.dim}, m={self.m}, bits={self.bits})"


def select(codebook, codes, query, k, *, n_init=4, n_local=64):
    """Indices (ascending, uint32) of the tokens ``query`` should attend to: the first
    ``n_init``, the last ``n_local``, and the ``k`` others whose codes score highest."""
    c = np.require(_codes(as_array(codes)), dtype=np.uint16, requirements="CA")
    q = np.require(as_array(query), dtype=np.float32, requirements="CA").reshape(-1)
    k, n_init, n_local = uint("k", k, 32), uint("n_init", n_init, 32), uint("n_local", n_local, 32)
    return np.asarray(codebook._c.select(c, q, k, n_init, n_local), dtype=np.uint32)
