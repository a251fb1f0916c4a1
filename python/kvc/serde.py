"""A serializer/deserializer pair in the shape serving engines' KV stores expect (LMCache's
``Serializer.to_bytes(tensor) -> bytes`` and ``Deserializer.from_bytes(bytes) -> tensor``), so
an engine that plugs CacheGen's pickle-based format can plug kvc instead.

One KV tensor holds every layer's K and V, in one of LMCache's layouts:

- ``"vllm"``: ``[num_layers, 2, num_tokens, num_kv_heads, head_size]`` (each layer's K and V
  are contiguous ``[T, H, D]`` blocks: encoded without a copy);
- ``"huggingface"``: ``[num_layers, 2, num_kv_heads, num_tokens, head_size]`` (transposed to
  kvc's ``[T, H, D]`` on the way in and back on the way out).

Usage, where an engine configures its serde::

    from kvc.serde import KvcSerializer, KvcDeserializer
    profile = kvc.Profile.load(open("model.kvcp", "rb").read())   # learned once per model
    ser = KvcSerializer(layout="vllm", level=7, profile=profile)
    des = KvcDeserializer(layout="vllm", profile=profile)
    blob = ser.to_bytes(kv)            # store blob
    kv2 = des.from_bytes(blob)         # same shape and dtype as kv

Without a profile every blob embeds one learned from its own tensor (self-contained, a few
percent larger and slower to encode). Serializers take numpy arrays, torch CPU tensors or any
``__dlpack__`` object; deserializers return torch tensors when torch is imported (``as_torch``
None), numpy arrays otherwise.
"""

import sys

import numpy as np

from . import Stream, encode
from ._arrays import as_array
from ._errors import ArgumentError

LAYOUTS = ("vllm", "huggingface")

__all__ = ["KvcSerializer", "KvcDeserializer", "LAYOUTS"]


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _is_torch(x):
    return type(x).__module__.startswith("torch")


class KvcSerializer:
    """KV tensor in, kvc stream (bytes) out. ``encode_kwargs`` go to :func:`kvc.encode`
    (``chunk_tokens``, ``model_id``, ``rope_style``, ...)."""

    def __init__(self, *, layout="vllm", level=7, profile=None, **encode_kwargs):
        self.layout = _check_layout(layout)
        self.level = level
        self.profile = profile
        self.encode_kwargs = encode_kwargs

    def to_bytes(self, kv):
        """Encode one KV tensor of this serializer's layout."""
        a = as_array(kv)
        if a.ndim != 5 or a.shape[1] != 2:
            raise ArgumentError(f"a {self.layout} KV tensor is [layers, 2, ...] with 5 dims, got shape {a.shape}")
        if self.layout == "vllm":
            keys = [a[i, 0] for i in range(a.shape[0])]
            values = [a[i, 1] for i in range(a.shape[0])]
        else:
            keys = [np.ascontiguousarray(a[i, 0].transpose(1, 0, 2)) for i in range(a.shape[0])]
            values = [np.ascontiguousarray(a[i, 1].transpose(1, 0, 2)) for i in range(a.shape[0])]
        return encode(keys, values, level=self.level, profile=self.profile, **self.encode_kwargs)


class KvcDeserializer:
    """kvc stream (bytes) in, KV tensor of the configured layout out (the stream's dtype, or
    ``dtype``). ``as_torch``: ``None`` returns torch tensors when torch is imported, numpy
    arrays otherwise."""

    def __init__(self, *, layout="vllm", profile=None, dtype=None, as_torch=None):
        self.layout = _check_layout(layout)
        self.profile = profile
        self.dtype = dtype
        self.as_torch = as_torch

    def from_bytes(self, data, out=None):
        """Decode a blob into a new tensor, or into ``out`` (a writable numpy array of the
        layout's shape; decoded in place for "vllm")."""
        s = Stream(data, self.profile)
        L, T, H, D = s.layers, s.tokens, s.kv_heads, s.head_dim
        shape = (L, 2, T, H, D) if self.layout == "vllm" else (L, 2, H, T, D)
        if out is None:
            from ._arrays import numpy_dtype

            out = np.empty(shape, dtype=numpy_dtype(self.dtype or s.dtype))
        elif tuple(out.shape) != shape:
            raise ArgumentError(f"out has shape {tuple(out.shape)}, the blob needs {shape}")
        if self.layout == "vllm":
            s.decode(out=([out[i, 0] for i in range(L)], [out[i, 1] for i in range(L)]))
        else:
            k, v = s.decode(dtype=out.dtype)
            out[:, 0] = k.transpose(0, 2, 1, 3)
            out[:, 1] = v.transpose(0, 2, 1, 3)
        torch = sys.modules.get("torch")
        if self.as_torch or (self.as_torch is None and torch is not None):
            if torch is None:
                raise ArgumentError("as_torch=True but torch is not imported")
            if s.dtype == "bfloat16" and out.dtype == np.uint16:
                return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
            return torch.from_numpy(out)
        return out
