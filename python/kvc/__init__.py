"""kvc: a compact, checksummed, documented codec for LLM KV caches.

Encode a cache (per layer K and V ``[tokens, kv_heads, head_dim]``, float16, float32 or
bfloat16 as uint16 bits) into a stream, and decode it back, into new arrays or into the
caller's own (a server's KV pages)::

    import kvc
    data = kvc.encode(keys, values, level=7)            # profile learned and embedded
    k, v = kvc.decode(data)                              # [L, T, H, D] arrays
    kvc.decode(data, out=(k_pages, v_pages))             # into preallocated arrays

The stream is the one ``kvc encode`` writes from the same cache and parameters, byte for byte.
Encoding and decoding release the GIL. Every error is a :class:`KvcError` subclass.
"""

from collections import namedtuple

import numpy as np

from . import _arrays, pq
from ._errors import (
    ArgumentError,
    ChunkError,
    EncodeError,
    HeaderError,
    InternalError,
    KvcError,
    OutOfRangeError,
    OutputError,
    ProfileError,
    ProfileMismatchError,
)
from ._native import Profile
from ._native import _Stream
from ._native import encode as _encode

__all__ = [
    "encode",
    "decode",
    "Stream",
    "Profile",
    "Sample",
    "KvcError",
    "ArgumentError",
    "HeaderError",
    "ProfileError",
    "ProfileMismatchError",
    "ChunkError",
    "OutputError",
    "OutOfRangeError",
    "EncodeError",
    "InternalError",
    "pq",
]

__version__ = "0.1.0"

#: One profile-learning sample: keys and values (per-layer ``[T, H, D]`` or stacked), and
#: optionally float32 queries ``[n_q, q_heads, D]`` per layer recorded at tokens ``q_start..``.
Sample = namedtuple("Sample", ["keys", "values", "queries", "q_start"], defaults=[None, 0])

_ROPE_STYLES = {"none": 0, "neox": 1, "gptj": 2}

DEFAULT_LEVEL = 7
DEFAULT_CHUNK_TOKENS = 1536


def encode(
    keys,
    values,
    *,
    level=DEFAULT_LEVEL,
    levels=None,
    profile=None,
    embed_profile=False,
    chunk_tokens=DEFAULT_CHUNK_TOKENS,
    group=10,
    sink=1,
    uniform_steps=False,
    queries=None,
    q_start=0,
    model_id="",
    rope_style="none",
    rope_theta=10000.0,
    rope_scaling=1.0,
    k_pre_rope=False,
    first_position=0,
):
    """Encode a KV cache into a kvc stream (``bytes``).

    ``keys`` and ``values``: per-layer lists of ``[tokens, kv_heads, head_dim]`` arrays or one
    stacked ``[layers, tokens, kv_heads, head_dim]`` array each; numpy float16, float32, or
    uint16 holding bfloat16 bits; torch CPU tensors and other ``__dlpack__`` objects are taken
    without a copy where their layout is contiguous.

    ``level`` (0 finest .. 11 coarsest; 7 by default) applies to every chunk, or ``levels``
    gives one per chunk of ``chunk_tokens`` tokens. Without ``profile`` a profile is learned
    from the cache itself (with ``queries``/``q_start`` if given, as ``kvc encode`` does from a
    dump with queries) and embedded, keeping only the levels used; with a :class:`Profile`,
    the stream references it by hash (the reader needs it too) unless ``embed_profile``.
    ``group``, ``sink``, ``uniform_steps`` are ``kvc encode``'s ``--group``, ``--sink``,
    ``--uniform-steps``; ``model_id``, ``rope_*``, ``k_pre_rope``, ``first_position`` travel in
    the header.

    The arrays are read while the GIL is released: no thread may write them until the call
    returns (as with numpy's own functions).

    Raises :class:`ArgumentError` for unusable arrays and :class:`EncodeError` for values or
    parameters the codec refuses (NaN, a level the profile lacks, ...).
    """
    k, v, shape = _arrays.cache_args(keys, values)
    q, q_heads, q_start = _arrays.query_args(queries, shape, q_start)
    if rope_style not in _ROPE_STYLES:
        raise ArgumentError(f"rope_style must be one of {sorted(_ROPE_STYLES)}, got {rope_style!r}")
    if levels is None:
        levels = [level]
    try:
        levels = [_arrays.uint("a level", x, 8) for x in levels]
    except TypeError:
        raise ArgumentError(f"levels must be a list of integers, got {levels!r}") from None
    if not isinstance(model_id, str):
        raise ArgumentError(f"model_id must be a str, got {type(model_id).__name__}")
    if profile is not None and not isinstance(profile, Profile):
        raise ArgumentError(f"profile must be a kvc.Profile, got {type(profile).__name__}")
    return _encode(
        k,
        v,
        shape,
        profile=profile,
        embed=bool(embed_profile),
        queries=q,
        q_heads=q_heads,
        q_start=q_start,
        levels=levels,
        chunk_tokens=_arrays.uint("chunk_tokens", chunk_tokens, 32),
        group=_arrays.uint("group", group, 32),
        sink=_arrays.uint("sink", sink, 16),
        uniform_steps=bool(uniform_steps),
        model_id=model_id,
        rope_style=_ROPE_STYLES[rope_style],
        rope_theta=_arrays.real("rope_theta", rope_theta),
        rope_scaling=_arrays.real("rope_scaling", rope_scaling),
        k_pre_rope=bool(k_pre_rope),
        first_position=_arrays.uint("first_position", first_position, 64),
    )


def _as_bytes(data):
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    raise ArgumentError(f"a stream is bytes, bytearray or memoryview, got {type(data).__name__}")


def _token_bounds(tokens):
    """``(start, end)`` of ``tokens``, a pair of integers or a range of step 1."""
    if isinstance(tokens, range):
        if tokens.step != 1:
            raise ArgumentError(f"tokens: a range of step 1, got step {tokens.step}")
        start, end = tokens.start, tokens.stop
    else:
        try:
            start, end = tokens
        except (TypeError, ValueError):
            raise ArgumentError(f"tokens: give (start, end) or a range, got {tokens!r}") from None
    return _arrays.integer("start", start), _arrays.integer("end", end)


class Stream:
    """A kvc stream, opened: its header checked and its profile resolved (the embedded one, or
    ``profile`` for a stream that references one). Chunks are checked as they are decoded.

    Header fields are attributes (``layers``, ``tokens``, ``kv_heads``, ``head_dim``,
    ``dtype``, ``chunk_tokens``, ``chunks`` as ``(token_start, tokens, level, len_bytes)``
    tuples, ``levels``, ``model_id``, ``rope``, ``profile_hash``, ...). A Stream may be decoded
    from several threads at once.
    """

    def __init__(self, data, profile=None):
        if profile is not None and not isinstance(profile, Profile):
            raise ArgumentError(f"profile must be a kvc.Profile, got {type(profile).__name__}")
        self._s = _Stream(_as_bytes(data), profile)
        # Read once: the native getter builds the list anew (O(chunks)) at every access.
        self._chunks = self._s.chunks

    def __getattr__(self, name):
        return getattr(self._s, name)

    def __repr__(self):
        s = self._s
        return (
            f"kvc.Stream({s.layers} layers x {s.kv_heads} KV heads x {s.head_dim} dims, "
            f"{s.tokens} tokens, {s.dtype}, {len(self._chunks)} chunks, {s.nbytes} bytes)"
        )

    def token_range(self, chunk):
        """The tokens ``(start, end)`` of chunk ``chunk``."""
        chunks = self._chunks
        chunk = _arrays.integer("chunk", chunk)
        if not 0 <= chunk < len(chunks):
            raise OutOfRangeError(f"chunk {chunk} is outside the stream ({len(chunks)} chunks)")
        start, n, _, _ = chunks[chunk]
        return start, start + n

    def decode(self, *, tokens=None, chunk=None, out=None, dtype=None):
        """Decode the whole stream, the tokens ``tokens = (start, end)``, or chunk ``chunk``.

        Returns ``(keys, values)``: new stacked ``[layers, tokens, kv_heads, head_dim]`` arrays
        of ``dtype`` (the stream's by default: float16, float32, or uint16 for bfloat16), or
        the arrays of ``out = (keys_out, values_out)``, written in place: each a stacked array
        or a per-layer list, writable and C-contiguous, of any KV dtype (values are rounded
        into it). The GIL is released while decoding: several threads may decode one Stream at
        once, each into its own arrays (no other thread may use the ``out`` arrays meanwhile,
        as with numpy's own functions).
        """
        s = self._s
        if chunk is not None:
            if tokens is not None:
                raise ArgumentError("give tokens or chunk, not both")
            start, end = self.token_range(chunk)
        elif tokens is None:
            start, end = 0, s.tokens
        else:
            start, end = _token_bounds(tokens)
            if not 0 <= start <= end <= s.tokens:
                raise OutOfRangeError(f"tokens {start}..{end} are outside the stream's 0..{s.tokens}")
        shape = (end - start, s.kv_heads, s.head_dim)
        if out is None:
            d = _arrays.numpy_dtype(dtype if dtype is not None else s.dtype)
            keys = np.empty((s.layers,) + shape, dtype=d)
            values = np.empty((s.layers,) + shape, dtype=d)
            k, v = keys, values
        else:
            try:
                keys, values = out
            except (TypeError, ValueError):
                raise ArgumentError("out must be a pair (keys_out, values_out)") from None
            d = None if dtype is None else _arrays.numpy_dtype(dtype)
            k = _arrays.out_layers(keys, "out keys", s.layers, shape, d)
            v = _arrays.out_layers(values, "out values", s.layers, shape, d)
        s.decode_into(start, end, k, v)
        return keys, values


def decode(data, *, profile=None, out=None, dtype=None, tokens=None):
    """Decode a stream: ``Stream(data, profile).decode(out=out, dtype=dtype, tokens=tokens)``.

    Returns ``(keys, values)``, new stacked ``[L, T, H, D]`` arrays or the ``out`` arrays.
    """
    return Stream(data, profile).decode(out=out, dtype=dtype, tokens=tokens)
