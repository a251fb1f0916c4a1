"""Turning what callers pass (numpy arrays, per-layer lists, stacked arrays, DLPack tensors)
into the contiguous per-layer numpy arrays the native module reads without copying."""

import operator
import sys

import numpy as np

from ._errors import ArgumentError, OutputError

#: numpy dtypes a KV tensor may have; uint16 holds bfloat16 bits.
KV_DTYPES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32", np.dtype(np.uint16): "bfloat16"}
_NUMPY_DTYPE = {"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16}


def integer(name, value):
    """``value`` as an int (an int or anything with ``__index__``, numpy integers included),
    or :class:`ArgumentError` naming ``name``."""
    try:
        return operator.index(value)
    except TypeError:
        raise ArgumentError(f"{name} must be an integer, got {type(value).__name__}") from None


def real(name, value):
    """``value`` as a float, or :class:`ArgumentError` naming ``name``."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ArgumentError(f"{name} must be a number, got {value!r}") from None


def uint(name, value, bits):
    """``value`` as an int in ``0 .. 2**bits - 1``, or :class:`ArgumentError` naming ``name``."""
    n = integer(name, value)
    if not 0 <= n < 1 << bits:
        raise ArgumentError(f"{name} must be in 0..={(1 << bits) - 1}, got {n}")
    return n


def numpy_dtype(name):
    """The numpy dtype a decoded tensor of ``name`` ("float16", "bfloat16", "float32") has."""
    if isinstance(name, str) and name in _NUMPY_DTYPE:
        return np.dtype(_NUMPY_DTYPE[name])
    try:
        d = np.dtype(name)
    except TypeError:
        raise ArgumentError(f"dtype {name!r} is not a numpy dtype") from None
    if d not in KV_DTYPES:
        raise ArgumentError(f"dtype {d} is not float16, float32 or uint16 (bfloat16 bits)")
    return d


def as_array(obj):
    """A ``numpy.ndarray`` (the type itself, which the native module requires) sharing ``obj``'s
    memory where possible: numpy arrays as they are (a subclass viewed as an ndarray), torch
    CPU tensors through ``.numpy()`` (bfloat16 as its uint16 bits), other objects with
    ``__dlpack__`` through ``numpy.from_dlpack``, anything else through ``numpy.asarray``."""
    if isinstance(obj, np.ndarray):
        a = obj
    elif type(obj).__module__.startswith("torch") and hasattr(obj, "numpy"):
        torch = sys.modules["torch"]
        if obj.dtype == torch.bfloat16:
            a = obj.detach().view(torch.int16).numpy().view(np.uint16)
        else:
            a = obj.detach().numpy()
    elif hasattr(obj, "__dlpack__"):
        a = np.from_dlpack(obj)
    else:
        a = np.asarray(obj)
    # ml_dtypes.bfloat16 (the name is asked only of other dtypes: numpy builds it anew each time).
    if a.dtype not in KV_DTYPES and a.dtype.name == "bfloat16":
        a = a.view(np.uint16)
    return np.asarray(a)


def kv_layers(x, what):
    """Per-layer ``[T, H, D]`` arrays from a list of them or one stacked ``[L, T, H, D]``
    array, contiguous (copied only if they are not)."""
    if isinstance(x, (list, tuple)):
        layers = [as_array(t) for t in x]
    else:
        a = as_array(x)
        if a.ndim != 4:
            raise ArgumentError(f"{what}: a stacked array must be [layers, tokens, heads, dim], got shape {a.shape}")
        layers = [a[i] for i in range(a.shape[0])]
    if not layers:
        raise ArgumentError(f"{what}: no layers")
    first = layers[0]
    for i, t in enumerate(layers):
        if t.ndim != 3:
            raise ArgumentError(f"{what}[{i}]: must be [tokens, heads, dim], got shape {t.shape}")
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ArgumentError(f"{what}[{i}]: {t.dtype}{list(t.shape)} differs from layer 0's {first.dtype}{list(first.shape)}")
        if t.dtype not in KV_DTYPES:
            raise ArgumentError(f"{what}[{i}]: dtype {t.dtype} is not float16, float32 or uint16 (bfloat16 bits)")
    return [np.require(t, requirements="CA") for t in layers]


def cache_args(keys, values):
    """``(k, v, (L, T, H, D))`` for the native module."""
    k = kv_layers(keys, "keys")
    v = kv_layers(values, "values")
    if len(k) != len(v) or k[0].shape != v[0].shape or k[0].dtype != v[0].dtype:
        raise ArgumentError(
            f"keys ({len(k)} x {k[0].dtype}{list(k[0].shape)}) and values "
            f"({len(v)} x {v[0].dtype}{list(v[0].shape)}) differ"
        )
    shape = (len(k),) + k[0].shape
    if max(shape) >= 1 << 32:
        # The codec counts each dimension in 32 bits (an empty array can claim any size).
        raise ArgumentError(f"keys: each dimension must be below 2**32, got {list(shape)}")
    return k, v, shape


def query_args(queries, shape, q_start):
    """``(q, q_heads, q_start)``: per-layer float32 ``[n_q, q_heads, D]`` queries for a cache
    of ``shape`` ``(L, T, H, D)``."""
    if queries is None:
        return None, 0, 0
    q = kv_layers(queries, "queries") if not isinstance(queries, (list, tuple)) else [as_array(x) for x in queries]
    q = [np.require(x, dtype=np.float32, requirements="CA") for x in q]
    layers, _, _, head_dim = shape
    if len(q) != layers or any(x.ndim != 3 or x.shape != q[0].shape for x in q) or q[0].shape[2] != head_dim:
        raise ArgumentError(f"queries: need {layers} layers of [n_q, q_heads, {head_dim}]")
    return q, q[0].shape[1], uint("q_start", q_start, 64)


def sample_args(samples):
    """Native arguments for ``Profile.learn``: each sample is ``(keys, values)`` or
    ``(keys, values, queries, q_start)``, or a :class:`kvc.Sample`."""
    out = []
    for s in samples:
        if not isinstance(s, (list, tuple)) or not 2 <= len(s) <= 4:
            raise ArgumentError("a sample is (keys, values) or (keys, values, queries, q_start)")
        keys, values, *rest = s
        queries = rest[0] if rest else None
        q_start = rest[1] if len(rest) > 1 else 0
        k, v, shape = cache_args(keys, values)
        q, q_heads, q_start = query_args(queries, shape, q_start)
        out.append((k, v, shape, q, q_heads, q_start))
    return out


def out_layers(out, what, layers, shape, dtype):
    """The caller's output arrays, written in place (never copied): a list of per-layer ``[T,
    H, D]`` arrays, or one stacked ``[L, T, H, D]`` array, returned whole (the native module
    splits it by layer, reading one array instead of one per layer); writable, aligned and
    C-contiguous."""
    if isinstance(out, (list, tuple)):
        arrays = [as_array(t) for t in out]
        if len(arrays) != layers:
            raise OutputError(f"{what}: {len(arrays)} layers given, the stream has {layers}")
        for i, a in enumerate(arrays):
            _check_out(a, f"{what}[{i}]", tuple(shape), dtype)
        return arrays
    a = as_array(out)
    if a.ndim != 4:
        raise OutputError(f"{what}: a stacked output must be [layers, tokens, heads, dim], got shape {a.shape}")
    if a.shape[0] != layers:
        raise OutputError(f"{what}: {a.shape[0]} layers given, the stream has {layers}")
    _check_out(a, what, (layers,) + tuple(shape), dtype)
    return a


def _check_out(a, what, shape, dtype):
    """One output array: a KV dtype (``dtype`` if given), ``shape``, writable, aligned and
    C-contiguous."""
    if a.dtype not in KV_DTYPES:
        raise ArgumentError(f"{what}: dtype {a.dtype} is not float16, float32 or uint16 (bfloat16 bits)")
    if dtype is not None and a.dtype != dtype:
        raise ArgumentError(f"{what}: dtype {a.dtype}, expected {dtype}")
    if tuple(a.shape) != shape:
        raise OutputError(f"{what}: shape {list(a.shape)}, the tokens need {list(shape)}")
    if not a.flags.c_contiguous or not a.flags.writeable or not a.flags.aligned:
        raise ArgumentError(f"{what}: must be writable, aligned and C-contiguous")
