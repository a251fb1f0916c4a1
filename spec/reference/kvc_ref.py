"""Independent reference decoder for the kvc stream format (stream version 2, profile versions 2 and 3).

Written from spec/FORMAT.md alone (no access to the Rust implementation). Section numbers in the
comments (e.g. "§6.3", "H12", "B7") refer to that document.

Dependencies: Python 3.9+ standard library and numpy.

Public API:

    decode(stream_bytes, profile_bytes=None, limits=None, impl="numpy") -> Decoded
    output_bytes(decoded) -> bytes
    parse_header(stream_bytes, limits=None) -> Header
    parse_profile(profile_bytes, limits=None) -> Profile
    crc32c(data) -> int
    KvcError (attributes .kind, .detail)

`impl` selects the rANS lane decoder: "numpy" (all lanes of a batch of blocks in lock step) or
"python" (a plain per-symbol loop that mirrors §6.3 line by line). Both must give the same result;
the test runner can cross-check them.
"""

import hashlib
import math
import struct

import numpy as np

__all__ = [
    "KvcError", "Limits", "DEFAULT_LIMITS", "Header", "ChunkEntry", "Profile", "Decoded",
    "decode", "output_bytes", "parse_header", "parse_profile", "crc32c",
    "f32_to_f16_bits", "f32_to_bf16_bits", "f16_bits_to_f32", "bf16_bits_to_f32", "EXP_MULT",
    "LaneDecoder",
]


# ---------------------------------------------------------------------------------------------
# Errors


class KvcError(Exception):
    """A decoding error. `.kind` is the spec's error name (e.g. "InvalidField", "Table", "Rans"),
    `.detail` the parenthesised part the spec gives (e.g. "flags", "ZeroFrequency"), or None."""

    def __init__(self, kind, detail=None, message=None):
        self.kind = kind
        self.detail = detail
        text = kind if detail is None else "%s(%s)" % (kind, detail)
        if message:
            text = "%s: %s" % (text, message)
        super().__init__(text)

    @property
    def full(self):
        """The error as the spec writes it, e.g. 'InvalidField(flags)', 'Table(BadSum)'."""
        return self.kind if self.detail is None else "%s(%s)" % (self.kind, self.detail)


def _err(kind, detail=None, message=None):
    return KvcError(kind, detail, message)


# ---------------------------------------------------------------------------------------------
# Limits (§8.1)


class Limits:
    FIELDS = ("max_layers", "max_channels", "max_tokens", "max_chunks", "max_elements",
              "max_profile_bytes")

    def __init__(self, max_layers=1024, max_channels=65536, max_tokens=1 << 24,
                 max_chunks=1 << 20, max_elements=1 << 32, max_profile_bytes=1 << 28):
        self.max_layers = max_layers
        self.max_channels = max_channels
        self.max_tokens = max_tokens
        self.max_chunks = max_chunks
        self.max_elements = max_elements
        self.max_profile_bytes = max_profile_bytes

    @classmethod
    def make(cls, limits):
        """None -> defaults; a Limits -> itself; a dict -> defaults overridden by the dict."""
        if limits is None:
            return cls()
        if isinstance(limits, Limits):
            return limits
        unknown = set(limits) - set(cls.FIELDS)
        if unknown:
            raise ValueError("unknown limit(s): %s" % ", ".join(sorted(unknown)))
        return cls(**{k: int(v) for k, v in limits.items()})

    def __repr__(self):
        return "Limits(%s)" % ", ".join("%s=%d" % (k, getattr(self, k)) for k in self.FIELDS)


DEFAULT_LIMITS = Limits()


# ---------------------------------------------------------------------------------------------
# CRC-32C (§3.4), table driven


def _make_crc_table():
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return table


_CRC_TABLE = _make_crc_table()


def _make_crc_tables8():
    # slicing-by-8 tables: _T8[k][b] = CRC state after byte b followed by k zero bytes.
    t = [list(_CRC_TABLE)]
    for k in range(1, 8):
        prev = t[k - 1]
        t.append([(prev[b] >> 8) ^ _CRC_TABLE[prev[b] & 0xFF] for b in range(256)])
    return t


_T8 = _make_crc_tables8()


def crc32c(data):
    """CRC-32C (Castagnoli) of `data` (bytes-like): init 0xFFFFFFFF, reflected, xorout 0xFFFFFFFF."""
    mv = memoryview(data).cast("B")
    n = len(mv)
    crc = 0xFFFFFFFF
    t0, t1, t2, t3, t4, t5, t6, t7 = _T8
    i = 0
    n8 = n - (n % 8)
    if n8:
        # slicing-by-8 over 8-byte little-endian words; identical result to the bytewise loop
        words = struct.unpack_from("<%dQ" % (n8 // 8), mv, 0)
        for w in words:
            lo = (w & 0xFFFFFFFF) ^ crc
            hi = w >> 32
            crc = (t7[lo & 0xFF] ^ t6[(lo >> 8) & 0xFF] ^ t5[(lo >> 16) & 0xFF] ^ t4[lo >> 24]
                   ^ t3[hi & 0xFF] ^ t2[(hi >> 8) & 0xFF] ^ t1[(hi >> 16) & 0xFF] ^ t0[hi >> 24])
        i = n8
    for b in mv[i:]:
        crc = t0[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def crc32c_bitwise(data):
    """The bitwise form given in §3.4 (slow; used by the tests to check crc32c)."""
    crc = 0xFFFFFFFF
    for b in bytes(data):
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# Float conversions (§1.2)

_F32 = np.float32
_U64 = np.uint64


def _f32_from_bits(u):
    return np.array([u], dtype="<u4").view("<f4")[0]


def f16_bits_to_f32(bits):
    """Widen f16 bit patterns (uint16 array) to float32 (exact for non-NaN; NaN per §1.2)."""
    bits = np.asarray(bits, dtype=np.uint16)
    out = bits.view(np.float16).astype(np.float32)
    nan = (bits & 0x7C00) == 0x7C00
    nan &= (bits & 0x03FF) != 0
    if nan.any():
        b = bits[nan].astype(np.uint32)
        ob = ((b & 0x8000) << 16) | np.uint32(0x7FC00000) | ((b & 0x03FF) << 13)
        out[nan] = ob.astype(np.uint32).view(np.float32)
    return out


def bf16_bits_to_f32(bits):
    """Widen bf16 bit patterns (uint16 array) to float32 (bits << 16; NaN gets the quiet bit)."""
    b = np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)
    nan = ((b & np.uint32(0x7F800000)) == np.uint32(0x7F800000)) & ((b & np.uint32(0x007FFFFF)) != 0)
    b = np.where(nan, b | np.uint32(0x00400000), b).astype(np.uint32)
    return b.view(np.float32)


def f32_to_bf16_bits(x):
    """Narrow float32 array to bf16 bit patterns (uint16), roundTiesToEven (§1.2)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & _U64(0x7FFFFFFF)) > _U64(0x7F800000)
    r = (u + _U64(0x7FFF) + ((u >> _U64(16)) & _U64(1))) >> _U64(16)
    r = np.where(nan, (u >> _U64(16)) | _U64(0x0040), r)
    return r.astype(np.uint16)


def f32_to_f16_bits(x):
    """Narrow float32 array to f16 bit patterns (uint16), IEEE convertFormat roundTiesToEven (§1.2),
    implemented with integer operations (independent of numpy's own float16 conversion)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    sign = (u >> _U64(16)) & _U64(0x8000)
    a = u & _U64(0x7FFFFFFF)
    out = np.zeros(u.shape, dtype=np.uint64)

    nan = a > _U64(0x7F800000)
    big = (~nan) & (a >= _U64(0x477FF000))          # |x| >= 65520 (and infinity): infinity
    normal = (a >= _U64(0x38800000)) & (a < _U64(0x477FF000))   # result is a normal f16 (or rounds up to 65504 max)
    sub = a < _U64(0x38800000)                     # result is subnormal or zero

    # NaN: sign | 0x7C00 | 0x0200 | (fraction >> 13)
    out = np.where(nan, _U64(0x7C00) | _U64(0x0200) | ((a & _U64(0x7FFFFF)) >> _U64(13)), out)
    out = np.where(big, _U64(0x7C00), out)
    # normal: rebias exponent (127 -> 15) and round the 13 dropped fraction bits to nearest even
    rn = ((a + _U64(0x0FFF) + ((a >> _U64(13)) & _U64(1))) >> _U64(13)) - _U64(112 << 10)
    out = np.where(normal, rn, out)
    # subnormal/zero: value = m * 2^(E - 150) with m the 24-bit significand; in units of 2^-24
    # that is m >> (126 - E), rounded to nearest even.
    E = a >> _U64(23)
    m = (a & _U64(0x7FFFFF)) | np.where(E > 0, _U64(0x800000), _U64(0))
    E_eff = np.where(E > 0, E, _U64(1))
    shift = np.minimum(_U64(126) - np.minimum(E_eff, _U64(112)), _U64(40))
    q = m >> shift
    rem = m & ((_U64(1) << shift) - _U64(1))
    half = _U64(1) << (shift - _U64(1))
    up = (rem > half) | ((rem == half) & ((q & _U64(1)) == _U64(1)))
    rs = q + up.astype(np.uint64)
    out = np.where(sub, rs, out)
    return (out | sign).astype(np.uint16)


# EXP_MULT[e] (§7.1), from the bit patterns the spec gives
_EXP_MULT_BITS = [
    0x3F800000, 0x3FB504F3, 0x40000000, 0x403504F3, 0x40800000, 0x40B504F3, 0x41000000, 0x413504F3,
    0x41800000, 0x41B504F3, 0x42000000, 0x423504F3, 0x42800000, 0x42B504F3, 0x43000000, 0x433504F3,
]
EXP_MULT = np.array(_EXP_MULT_BITS, dtype=np.uint32).view(np.float32)


# ---------------------------------------------------------------------------------------------
# Byte reader


class _Reader:
    def __init__(self, data, start, end, trunc_detail):
        self.data = data
        self.pos = start
        self.end = end
        self.trunc = trunc_detail

    def remaining(self):
        return self.end - self.pos

    def need(self, n, detail=None):
        if n > self.end - self.pos:
            raise _err("Truncated", detail or self.trunc)

    def take(self, n, detail=None):
        self.need(n, detail)
        p = self.pos
        self.pos = p + n
        return self.data[p:p + n]

    def u8(self):
        self.need(1)
        v = self.data[self.pos]
        self.pos += 1
        return v

    def u16(self):
        self.need(2)
        v = struct.unpack_from("<H", self.data, self.pos)[0]
        self.pos += 2
        return v

    def u32(self):
        self.need(4)
        v = struct.unpack_from("<I", self.data, self.pos)[0]
        self.pos += 4
        return v

    def f32(self):
        """Returns (python float value, f32 bits)."""
        self.need(4)
        bits = struct.unpack_from("<I", self.data, self.pos)[0]
        v = struct.unpack_from("<f", self.data, self.pos)[0]
        self.pos += 4
        return v, bits


# ---------------------------------------------------------------------------------------------
# Stream header (§3.2, §3.3, §3.7)

DTYPE_NAMES = {0: "f16", 1: "bf16", 2: "f32"}
DTYPE_SIZE = {0: 2, 1: 2, 2: 4}


class ChunkEntry:
    __slots__ = ("offset", "len_bytes", "token_start", "tokens", "level")

    def __init__(self, offset, len_bytes, token_start, tokens, level):
        self.offset = offset
        self.len_bytes = len_bytes
        self.token_start = token_start
        self.tokens = tokens
        self.level = level

    def __repr__(self):
        return "ChunkEntry(offset=%d, len_bytes=%d, token_start=%d, tokens=%d, level=%d)" % (
            self.offset, self.len_bytes, self.token_start, self.tokens, self.level)


class Header:
    pass


def _check_shape(L, H, D, limits):
    """H11-H13 (also P6)."""
    if L == 0:
        raise _err("InvalidField", "layers")
    if H == 0:
        raise _err("InvalidField", "kv_heads")
    if D == 0:
        raise _err("InvalidField", "head_dim")
    if L > limits.max_layers:
        raise _err("LimitExceeded", "layers")
    if H * D > limits.max_channels:
        raise _err("LimitExceeded", "channels (kv_heads * head_dim)")


def parse_header(stream, limits=None):
    """Parse and validate the header and chunk index (checks H1-H32). Returns a Header."""
    limits = Limits.make(limits)
    s = stream
    n = len(s)
    # H1-H3: a stream shorter than the field being read gives Truncated("stream header")
    if n < 4:
        raise _err("Truncated", "stream header")
    if bytes(s[0:4]) != b"KVCS":
        raise _err("BadMagic", None, "stream magic")
    if n < 6:
        raise _err("Truncated", "stream header")
    version = struct.unpack_from("<H", s, 4)[0]
    if version != 2:
        raise _err("UnsupportedVersion", None, "stream version %d" % version)
    if n < 12:
        raise _err("Truncated", "stream header")
    header_len = struct.unpack_from("<I", s, 8)[0]
    if header_len < 106:                                                   # H3
        raise _err("InvalidField", "header_len")
    if header_len > n:                                                     # H4
        raise _err("Truncated", "stream header")
    stored = struct.unpack_from("<I", s, header_len - 4)[0]
    if crc32c(memoryview(s)[:header_len - 4]) != stored:                   # H5
        raise _err("HeaderCrc")
    flags = struct.unpack_from("<H", s, 6)[0]
    if flags != 0:                                                         # H6
        raise _err("InvalidField", "flags")
    dtype, rope_style, k_pre_rope, reserved = s[12], s[13], s[14], s[15]
    if dtype not in (0, 1, 2):                                             # H7
        raise _err("InvalidField", "dtype")
    if rope_style not in (0, 1, 2):                                        # H8
        raise _err("InvalidField", "rope style")
    if k_pre_rope not in (0, 1):                                           # H9
        raise _err("InvalidField", "k_pre_rope")
    if reserved != 0:                                                      # H10
        raise _err("InvalidField", "reserved byte")
    L, H, D, T = struct.unpack_from("<4I", s, 16)
    _check_shape(L, H, D, limits)                                          # H11-H13
    C = H * D
    if T > limits.max_tokens:                                              # H14
        raise _err("LimitExceeded", "tokens")
    if L * 2 * T * C > limits.max_elements:                                # H15
        raise _err("LimitExceeded", "decoded elements")
    rope_theta = struct.unpack_from("<f", s, 32)[0]
    rope_scaling = struct.unpack_from("<f", s, 36)[0]
    if not (math.isfinite(rope_theta) and math.isfinite(rope_scaling)):    # H16
        raise _err("InvalidField", "rope theta/scaling")
    first_position = struct.unpack_from("<Q", s, 40)[0]
    chunk_tokens = struct.unpack_from("<I", s, 48)[0]
    group, n_sink = struct.unpack_from("<HH", s, 52)
    if chunk_tokens == 0:                                                  # H17
        raise _err("InvalidField", "chunk_tokens")
    if not (1 <= group <= 1024):                                           # H18
        raise _err("InvalidField", "group")
    profile_hash = bytes(s[56:88])
    profile_len = struct.unpack_from("<Q", s, 88)[0]
    n_chunks = struct.unpack_from("<I", s, 96)[0]
    model_id_len = struct.unpack_from("<H", s, 100)[0]
    if profile_len > limits.max_profile_bytes:                             # H19
        raise _err("LimitExceeded", "embedded profile size")
    if n_chunks > limits.max_chunks:                                       # H20
        raise _err("LimitExceeded", "chunks")
    if model_id_len > 1024:                                                # H21
        raise _err("LimitExceeded", "model id length")
    if header_len != 102 + model_id_len + 24 * n_chunks + 4:               # H22
        raise _err("Inconsistent", None, "header_len does not match model id and chunk count")
    try:                                                                   # H23
        model_id = bytes(s[102:102 + model_id_len]).decode("utf-8", errors="strict")
    except UnicodeDecodeError:
        raise _err("InvalidField", "model id (not UTF-8)")
    if header_len + profile_len > n:                                       # H24
        raise _err("Truncated", "embedded profile")

    entries = []
    running_offset = header_len + profile_len
    running_tokens = 0
    base = 102 + model_id_len
    for i in range(n_chunks):
        p = base + 24 * i
        off, len_bytes, token_start, tokens, level = struct.unpack_from("<QIIIB", s, p)
        if bytes(s[p + 21:p + 24]) != b"\x00\x00\x00":                     # H25
            raise _err("InvalidField", "chunk index reserved bytes")
        if off != running_offset:                                          # H26
            raise _err("Inconsistent", None, "chunk %d offset" % i)
        if len_bytes < 4:                                                  # H27
            raise _err("InvalidField", "chunk len_bytes")
        if token_start != running_tokens or not (1 <= tokens <= chunk_tokens):   # H28
            raise _err("Inconsistent", None, "chunk %d token range" % i)
        if running_offset + len_bytes > n:                                 # H29
            raise _err("Truncated", "chunk")
        running_tokens += tokens
        if running_tokens > 0xFFFFFFFF:                                    # H30
            raise _err("Inconsistent", None, "token count overflows u32")
        running_offset += len_bytes
        entries.append(ChunkEntry(off, len_bytes, token_start, tokens, level))
    if running_tokens != T:                                                # H31
        raise _err("Inconsistent", None, "chunk tokens do not sum to tokens")
    if running_offset != n:                                                # H32
        raise _err("Inconsistent", None, "stream does not end at the end of the last chunk")

    h = Header()
    h.version = version
    h.flags = flags
    h.header_len = header_len
    h.dtype_code = dtype
    h.dtype = DTYPE_NAMES[dtype]
    h.rope_style = rope_style
    h.k_pre_rope = k_pre_rope
    h.layers, h.kv_heads, h.head_dim, h.tokens = L, H, D, T
    h.rope_theta = rope_theta
    h.rope_scaling = rope_scaling
    h.first_position = first_position
    h.chunk_tokens = chunk_tokens
    h.group = group
    h.n_sink = n_sink
    h.profile_hash = profile_hash
    h.profile_len = profile_len
    h.n_chunks = n_chunks
    h.model_id = model_id
    h.chunks = entries
    return h


# ---------------------------------------------------------------------------------------------
# Profile (§4)


class Table:
    """A frequency table (§4.4): radius R (None for an exponent table) and frequencies."""

    def __init__(self, radius, freqs):
        self.radius = radius
        self.freqs = [int(f) for f in freqs]
        self.n = len(self.freqs)
        cum = [0]
        for f in self.freqs:
            cum.append(cum[-1] + f)
        self.cum = cum[:-1]
        lut = bytearray(4096)
        for i, (c, f) in enumerate(zip(self.cum, self.freqs)):
            lut[c:c + f] = bytes([i]) * f
        self.lut = bytes(lut)      # slot -> index


class Profile:
    pass


def _check_freqs(freqs):
    """P19/P20 and B3: no zero frequency (first reported), then sum == 4096."""
    for f in freqs:
        if f == 0:
            raise _err("Table", "ZeroFrequency")
    if sum(freqs) != 4096:
        raise _err("Table", "BadSum")


def parse_profile(data, limits=None):
    """Parse and validate a profile (checks P1-P23). Returns a Profile."""
    limits = Limits.make(limits)
    data = bytes(data)
    n = len(data)
    if n > limits.max_profile_bytes:                                       # P1
        raise _err("LimitExceeded", "profile size")
    # P2-P4 read the first 8 bytes; a profile too short for the field gives Truncated("profile")
    if n < 4:
        raise _err("Truncated", "profile")
    if data[0:4] != b"KVCP":                                               # P2
        raise _err("BadMagic", None, "profile magic")
    if n < 6:
        raise _err("Truncated", "profile")
    version = struct.unpack_from("<H", data, 4)[0]
    if version not in (2, 3):                                              # P3
        raise _err("UnsupportedVersion", None, "profile version %d" % version)
    if n < 8:
        raise _err("Truncated", "profile")
    if struct.unpack_from("<H", data, 6)[0] != 0:                          # P4
        raise _err("InvalidField", "profile reserved field")
    stored = struct.unpack_from("<I", data, n - 4)[0]                      # P5 (n >= 8 here)
    if crc32c(memoryview(data)[:n - 4]) != stored:
        raise _err("ProfileCrc")
    rd = _Reader(data, 8, n - 4, "profile")
    L, H, D = rd.u32(), rd.u32(), rd.u32()
    _check_shape(L, H, D, limits)                                          # P6
    C = H * D
    # Each field is checked once read (§4.6): a profile that ends early reports a bad field
    # before its end first.
    n_levels = rd.u8()
    if not (1 <= n_levels <= 16):                                          # P7
        raise _err("InvalidField", "profile level count")
    flags = rd.u8()
    if flags > 1:                                                          # P8
        raise _err("InvalidField", "profile flags")
    if rd.take(2) != b"\x00\x00":                                          # P9
        raise _err("InvalidField", "profile reserved field")
    mults = []
    for _ in range(n_levels):                                              # P10
        v, bits = rd.f32()
        if not (math.isfinite(v) and v > 0):
            raise _err("InvalidField", "level multiplier")
        mults.append(_f32_from_bits(bits))
    n_rec = 2 * L * C
    rec_len = 7 if version == 3 else 13                                    # §4.2
    rd.need(rec_len * n_rec, "profile channel parameters")                # P11
    if version == 3:
        # mean, delta_step, anchor_step as bf16: the high half of an f32 (§1.2).
        rec = np.frombuffer(data, dtype=np.dtype([("mean", "<u2"), ("delta", "<u2"),
                                                  ("anchor", "<u2"), ("weight", "u1")]),
                            count=n_rec, offset=rd.pos)
        widen = lambda b: (b.astype(np.uint32) << np.uint32(16)).view(np.float32)  # noqa: E731
        mean, delta, anchor = widen(rec["mean"]), widen(rec["delta"]), widen(rec["anchor"])
    else:
        rec = np.frombuffer(data, dtype=np.dtype([("mean", "<f4"), ("delta", "<f4"),
                                                  ("anchor", "<f4"), ("weight", "u1")]),
                            count=n_rec, offset=rd.pos)
        mean = rec["mean"].astype(np.float32)
        delta = rec["delta"].astype(np.float32)
        anchor = rec["anchor"].astype(np.float32)
    rd.pos += rec_len * n_rec
    weight = rec["weight"].astype(np.uint8)
    with np.errstate(invalid="ignore"):
        bad_mean = ~np.isfinite(mean)
        bad_step = ~(np.isfinite(delta) & (delta > 0) & np.isfinite(anchor) & (anchor > 0))
        bad_weight = weight > 16
    bad = bad_mean | bad_step | bad_weight                                 # P12, per record in order
    if bad.any():
        k = int(np.argmax(bad))
        if bad_mean[k]:
            raise _err("InvalidField", "channel mean", "record %d" % k)
        if bad_step[k]:
            raise _err("InvalidField", "channel step", "record %d" % k)
        raise _err("InvalidField", "anchor weight", "record %d" % k)

    hints = None
    if flags & 1:
        slope, _ = rd.f32()
        quantile, _ = rd.f32()
        max_exp = rd.u8()
        res3 = rd.take(3)
        if res3 != b"\x00\x00\x00":                                        # P13
            raise _err("InvalidField", "profile reserved field")
        ok = (math.isfinite(slope) and slope >= 0 and math.isfinite(quantile)
              and 0 <= quantile <= 1 and max_exp <= 15)
        if not ok:                                                         # P14
            raise _err("InvalidField", "importance parameters")
        nq = L * C + L * H
        rd.need(4 * nq, "profile query means")                            # P15
        vals = np.frombuffer(data, dtype="<f4", count=nq, offset=rd.pos)
        rd.pos += 4 * nq
        if not np.isfinite(vals).all():                                    # P16
            raise _err("InvalidField", "query mean or score threshold")
        hints = {"slope": slope, "quantile": quantile, "max_exp": max_exp,
                 "query_mean": vals[:L * C].astype(np.float32),
                 "tau": vals[L * C:].astype(np.float32)}

    levels = []
    for v in range(n_levels):
        n_tables = rd.u16()
        if not (1 <= n_tables <= 256):                                     # P17
            raise _err("InvalidField", "table count")
        tables = []
        for _ in range(n_tables):
            R = rd.u8()
            if R > 127:                                                    # P18
                raise _err("InvalidField", "table radius")
            cnt = 2 * R + 2
            raw = rd.take(2 * cnt)
            freqs = struct.unpack("<%dH" % cnt, raw)
            _check_freqs(freqs)                                            # P19, P20
            tables.append(Table(R, freqs))
        down = list(rd.take(n_tables))
        if any(d >= n_tables for d in down):                               # P21
            raise _err("InvalidField", "table id in down links")
        tmap = np.frombuffer(rd.take(4 * L * C), dtype=np.uint8).copy()
        if n_tables < 256 and (tmap >= n_tables).any():                    # P22
            raise _err("InvalidField", "table id in map")
        levels.append(_Level(tables, down, tmap))
    if rd.remaining() != 0:                                                # P23
        raise _err("Inconsistent", None, "bytes remain after the profile's levels")

    p = Profile()
    p.version = version
    p.layers, p.kv_heads, p.head_dim = L, H, D
    p.n_levels = n_levels
    p.flags = flags
    p.level_mult = mults                       # list of np.float32
    p.mean = mean
    p.delta_step = delta
    p.anchor_step = anchor
    p.weight = weight
    p.hints = hints
    p.levels = levels
    p.sha256 = hashlib.sha256(data).digest()
    p.size = n
    return p


class _Level:
    def __init__(self, tables, down, tmap):
        self.tables = tables
        self.down = down
        self.map = tmap
        nt = len(tables)
        # down^e(t) for e < 16 (§4.4)
        dp = np.zeros((16, nt), dtype=np.int64)
        dp[0] = np.arange(nt)
        dn = np.array(down, dtype=np.int64)
        for e in range(1, 16):
            dp[e] = dn[dp[e - 1]]
        self.down_pow = dp
        self.radius = np.array([t.radius for t in tables], dtype=np.int64)
        self._np_tables = None

    def np_tables(self):
        """Stacked lookup arrays for the vectorised lane decoder."""
        if self._np_tables is None:
            self._np_tables = _stack_tables(self.tables)
        return self._np_tables


def _stack_tables(tables):
    nt = len(tables)
    lut = np.zeros((nt, 4096), dtype=np.intp)
    freq = np.zeros((nt, 256), dtype=np.uint64)
    cum = np.zeros((nt, 256), dtype=np.uint64)
    for k, t in enumerate(tables):
        lut[k] = np.frombuffer(t.lut, dtype=np.uint8)
        freq[k, :t.n] = t.freqs
        cum[k, :t.n] = t.cum
    return lut, freq, cum


# ---------------------------------------------------------------------------------------------
# rANS lane decoder (§6.3), scalar form

_MASK32 = 0xFFFFFFFF


class LaneDecoder:
    """One lane, exactly as §6.3: `words` are the lane's u32 words as stored."""

    def __init__(self, words):
        w = [int(v) for v in words]
        n = len(w)
        self.w = w
        if n == 0:
            self.x, self.unread = 0, 0
        elif w[n - 1] == 0:
            raise _err("Rans", "ZeroFinalWord")
        elif n == 1:
            self.x, self.unread = w[0], 0
        else:
            self.x, self.unread = (w[n - 1] << 32) | w[n - 2], n - 2

    def decode(self, table):
        x = self.x
        slot = x & 4095
        i = table.lut[slot]
        x = (x >> 12) * table.freqs[i] + (slot - table.cum[i])
        if x < (1 << 32) and self.unread > 0:
            self.unread -= 1
            x = (x << 32) | self.w[self.unread]
        self.x = x
        return i


# ---------------------------------------------------------------------------------------------
# Blocks (§5)


class _Block:
    pass


def _parse_block(rd, S, C, dsize, n_sym):
    """Reads one block's fields (checks B1-B6). Returns a _Block."""
    b = _Block()
    n_esc = rd.u32()
    if n_esc > n_sym:                                                      # B1
        raise _err("LimitExceeded", "escape count")
    lane_len = list(struct.unpack("<32I", rd.take(128)))
    n_exp = rd.u8()
    if not (n_exp == 0 or 2 <= n_exp <= 16):                               # B2
        raise _err("InvalidField", "step exponent alphabet size")
    exp_freqs = list(struct.unpack("<%dH" % n_exp, rd.take(2 * n_exp))) if n_exp else []
    if n_exp:
        _check_freqs(exp_freqs)                                            # B3
    sink_bytes = S * C * dsize
    rd.need(sink_bytes + 4 * n_esc, "chunk block")                         # B4
    b.sink_raw = rd.take(sink_bytes)
    b.escapes = list(struct.unpack("<%di" % n_esc, rd.take(4 * n_esc))) if n_esc else []
    total = sum(lane_len)
    rd.need(4 * total, "lane words")                                       # B5
    b.words = np.frombuffer(rd.take(4 * total), dtype="<u4").astype(np.uint64)
    starts = [0] * 32
    acc = 0
    for k in range(32):
        starts[k] = acc
        acc += lane_len[k]
    for k in range(32):                                                    # B6
        if lane_len[k] and int(b.words[starts[k] + lane_len[k] - 1]) == 0:
            raise _err("Rans", "ZeroFinalWord", "lane %d" % k)
    b.lane_len = lane_len
    b.lane_start = starts
    b.n_exp = n_exp
    b.exp_table = Table(None, exp_freqs) if n_exp else None
    b.n_esc = n_esc
    return b


def _value_tids(level, l, kv, C, D, H, G, S, rows, exps):
    """Table id `down^e(t)` of every value symbol g (§6.1), as an int64 array of length n_sym."""
    nS = rows - S
    r = np.arange(S, rows, dtype=np.int64)
    kind = (r % G != 0).astype(np.int64)                                   # 0 anchor, 1 delta
    base = ((l * 2 + kv) * 2) * C
    m0 = level.map[base:base + C].astype(np.int64)
    m1 = level.map[base + C:base + 2 * C].astype(np.int64)
    t = np.where(kind[:, None] == 0, m0[None, :], m1[None, :])            # [nS, C]
    if exps is not None:
        e = np.repeat(exps.reshape(nS, H), D, axis=1)                       # [nS, C]
        t = level.down_pow[e, t]
    return t.reshape(-1)


def _decode_block_python(b, level, ctx):
    """Scalar lane decoding (§6.2, §6.3): all exponents, then value symbols in increasing g."""
    l, kv, C, D, H, G, S, rows = ctx
    lanes = [LaneDecoder(b.words[b.lane_start[k]:b.lane_start[k] + b.lane_len[k]]) for k in range(32)]
    n_e = (rows - S) * H if b.n_exp else 0
    exps = None
    if b.n_exp:
        exps = np.array([lanes[j % 32].decode(b.exp_table) for j in range(n_e)], dtype=np.int64)
    tids = _value_tids(level, l, kv, C, D, H, G, S, rows, exps)
    tabs = level.tables
    idx = np.empty(len(tids), dtype=np.int64)
    for g, t in enumerate(tids.tolist()):
        idx[g] = lanes[(n_e + g) % 32].decode(tabs[t])
    return exps, tids, idx, [d.x for d in lanes], [d.unread for d in lanes]


def _decode_blocks_numpy(blist, level, ctxs):
    """Vectorised lane decoding: all 32 lanes of every block in `blist` advance in lock step.
    Each lane still decodes its own symbols in increasing coded position (§6.2); exponents first
    (phase 1), then value symbols (phase 2), whose tables need the exponents."""
    nb = len(blist)
    NL = 32 * nb
    lut_v, freq_v, cum_v = level.np_tables()
    nt = len(level.tables)
    # table store: level tables, then each block's exponent table
    exp_ids = {}
    extra = []
    for bi, b in enumerate(blist):
        if b.n_exp:
            exp_ids[bi] = nt + len(extra)
            extra.append(b.exp_table)
    if extra:
        lut_e, freq_e, cum_e = _stack_tables(extra)
        LUT = np.concatenate([lut_v, lut_e])
        FREQ = np.concatenate([freq_v, freq_e])
        CUM = np.concatenate([cum_v, cum_e])
    else:
        LUT, FREQ, CUM = lut_v, freq_v, cum_v

    # global word array and per-lane initial states (§6.3)
    words = np.concatenate([b.words for b in blist] + [np.zeros(1, np.uint64)])
    wbase = np.zeros(NL, dtype=np.int64)
    x = np.zeros(NL, dtype=np.uint64)
    unread = np.zeros(NL, dtype=np.int64)
    off = 0
    for bi, b in enumerate(blist):
        for k in range(32):
            gl = bi * 32 + k
            n = b.lane_len[k]
            s0 = off + b.lane_start[k]
            wbase[gl] = s0
            if n == 1:
                x[gl] = words[s0]
            elif n >= 2:
                x[gl] = (words[s0 + n - 1] << _U64(32)) | words[s0 + n - 2]
                unread[gl] = n - 2
        off += len(b.words)

    sh12 = _U64(12)
    sh32 = _U64(32)
    m4095 = _U64(4095)
    two32 = _U64(1 << 32)

    def run(grid, out):
        # grid: [steps, NL] table ids (-1 = no symbol); out: [steps, NL] decoded indices
        nsteps = grid.shape[0]
        for s in range(nsteps):
            row = grid[s]
            act = np.flatnonzero(row >= 0)
            if act.size == 0:
                continue
            full = act.size == NL
            ti = row if full else row[act]
            xs = x if full else x[act]
            slot = xs & m4095
            i = LUT[ti, slot.astype(np.intp)]
            xn = (xs >> sh12) * FREQ[ti, i] + (slot - CUM[ti, i])
            ur = unread if full else unread[act]
            need = (xn < two32) & (ur > 0)
            if need.any():
                lanes_n = act[need]
                unread[lanes_n] -= 1
                wv = words[wbase[lanes_n] + unread[lanes_n]]
                xn[need] = (xn[need] << sh32) | wv
            if full:
                x[:] = xn
                out[s] = i
            else:
                x[act] = xn
                out[s, act] = i

    # phase 1: exponents at coded positions p < n_e
    n_es = [((c[7] - c[6]) * c[4] if b.n_exp else 0) for b, c in zip(blist, ctxs)]   # (rows - S) * H
    exps_list = [None] * nb
    s1 = max([(ne + 31) // 32 for ne in n_es] + [0])
    if s1:
        grid = np.full((s1, NL), -1, dtype=np.int64)
        for bi, ne in enumerate(n_es):
            if ne:
                band = np.full(s1 * 32, -1, dtype=np.int64)
                band[:ne] = exp_ids[bi]
                grid[:, bi * 32:(bi + 1) * 32] = band.reshape(s1, 32)
        out = np.zeros((s1, NL), dtype=np.intp)
        run(grid, out)
        for bi, ne in enumerate(n_es):
            if ne:
                exps_list[bi] = out[:, bi * 32:(bi + 1) * 32].reshape(-1)[:ne].astype(np.int64)

    # phase 2: value symbols at p = n_e + g
    tids_list = []
    for bi, (b, c) in enumerate(zip(blist, ctxs)):
        l, kv, C, D, H, G, S, rows = c
        tids_list.append(_value_tids(level, l, kv, C, D, H, G, S, rows, exps_list[bi]))
    totals = [ne + len(t) for ne, t in zip(n_es, tids_list)]
    s2 = max([(tt + 31) // 32 for tt in totals] + [0])
    idx_list = [np.zeros(0, np.int64)] * nb
    if s2:
        grid = np.full((s2, NL), -1, dtype=np.int64)
        for bi, (ne, t) in enumerate(zip(n_es, tids_list)):
            if len(t):
                band = np.full(s2 * 32, -1, dtype=np.int64)
                band[ne:ne + len(t)] = t
                grid[:, bi * 32:(bi + 1) * 32] = band.reshape(s2, 32)
        out = np.zeros((s2, NL), dtype=np.intp)
        run(grid, out)
        for bi, (ne, t) in enumerate(zip(n_es, tids_list)):
            idx_list[bi] = out[:, bi * 32:(bi + 1) * 32].reshape(-1)[ne:ne + len(t)].astype(np.int64)
    res = []
    for bi in range(nb):
        xs = [int(v) for v in x[bi * 32:(bi + 1) * 32]]
        us = [int(v) for v in unread[bi * 32:(bi + 1) * 32]]
        res.append((exps_list[bi], tids_list[bi], idx_list[bi], xs, us))
    return res


def _finish_block(b, level, decoded, dtype_code):
    """Checks B7-B10 for a decoded block; returns (q values int64 array, exps or None, sink f32)."""
    exps, tids, idx, xs, us = decoded
    R = level.radius[tids] if len(tids) else np.zeros(0, np.int64)
    is_esc = idx == 2 * R + 1
    q = idx - R
    esc_pos = np.flatnonzero(is_esc)
    n_idx = len(esc_pos)
    ev = b.escapes
    m = min(n_idx, len(ev))
    # B7, in increasing g: the k-th escape index takes the k-th escape value
    for k in range(m):
        v = ev[k]
        g = int(esc_pos[k])
        if not (int(R[g]) < abs(v) <= (1 << 24)):
            raise _err("BadEscape", None, "escape value %d at g=%d (R=%d)" % (v, g, int(R[g])))
        q[g] = v
    if n_idx > len(ev):
        raise _err("BadEscape", None, "escape index with no escape value left (g=%d)"
                   % int(esc_pos[len(ev)]))
    for k in range(32):                                                    # B8
        if us[k] != 0:
            raise _err("Rans", "TrailingData", "lane %d" % k)
        if xs[k] != 0:
            raise _err("Rans", "BadFinalState", "lane %d" % k)
    if n_idx < len(ev):                                                    # B9
        raise _err("Inconsistent", None, "unused escape values")
    sink = _widen_raw(b.sink_raw, dtype_code)
    if sink.size and not np.isfinite(sink).all():                          # B10
        raise _err("InvalidField", "sink value (not finite)")
    return q, exps, sink


def _widen_raw(raw, dtype_code):
    if dtype_code == 0:
        return f16_bits_to_f32(np.frombuffer(raw, dtype="<u2"))
    if dtype_code == 1:
        return bf16_bits_to_f32(np.frombuffer(raw, dtype="<u2"))
    return np.frombuffer(raw, dtype="<f4").astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Reconstruction (§7)


def _reconstruct(q, exps, sink, consts, S, rows, C, H, D, G):
    """§7.2. Returns x as float32 [rows, C] (sink rows = widened stored values)."""
    A, Dq, W, M = consts
    x = np.empty((rows, C), dtype=np.float32)
    if S:
        x[:S] = sink.reshape(S, C)
    nS = rows - S
    if nS == 0:
        return x
    qf = q.reshape(nS, C).astype(np.float32)          # exact: |q| <= 2^24
    if exps is not None:
        em = EXP_MULT[np.repeat(exps.reshape(nS, H), D, axis=1)]  # [nS, C] float32
    else:
        em = np.ones((nS, C), dtype=np.float32)      # EXP_MULT[0] = 1
    r = np.arange(S, rows)
    anchor = (r % G) == 0
    with np.errstate(over="ignore", invalid="ignore"):
        if anchor.any():
            step = A[None, :] * em[anchor]                                  # rounded
            x[r[anchor]] = M[None, :] + (qf[anchor] * step)                 # product, then sum
        delta = ~anchor
        if delta.any():
            rdl = r[delta]
            a = x[rdl - (rdl % G)]                    # reconstructed anchor of the group
            pred = M[None, :] + (W[None, :] * (a - M[None, :]))
            step = Dq[None, :] * em[delta]
            x[rdl] = pred + (qf[delta] * step)
    assert x.dtype == np.float32
    return x


def _block_consts(prof, l, kv, mult):
    """§7.1: A, Dq, W, M of block (l, kv) at multiplier `mult` (np.float32)."""
    C = prof.kv_heads * prof.head_dim
    base = (l * 2 + kv) * C
    sl = slice(base, base + C)
    mult = np.float32(mult)
    with np.errstate(over="ignore"):
        A = prof.anchor_step[sl] * mult
        Dq = prof.delta_step[sl] * mult
    W = prof.weight[sl].astype(np.float32) * np.float32(0.0625)
    M = prof.mean[sl]
    for arr in (A, Dq, W, M):
        assert arr.dtype == np.float32
    return A, Dq, W, M


# ---------------------------------------------------------------------------------------------
# Decoding (Appendix A)


class Decoded:
    """Decoded cache. `K[l]`, `V[l]`: numpy arrays [tokens, kv_heads, head_dim] in the stream dtype
    (np.float16, np.float32, or np.uint16 raw bits for bf16)."""

    def __repr__(self):
        return "Decoded(dtype=%s, layers=%d, kv_heads=%d, head_dim=%d, tokens=%d)" % (
            self.dtype, self.layers, self.kv_heads, self.head_dim, self.tokens)


_BATCH_SYMBOLS = 1 << 22


def decode(stream_bytes, profile_bytes=None, limits=None, impl="numpy"):
    """Decode a whole stream (§3-§7, checks H1-H32, O1-O4, P1-P23, C1-C2, B1-B10)."""
    if impl not in ("numpy", "python"):
        raise ValueError("impl must be 'numpy' or 'python'")
    limits = Limits.make(limits)
    s = bytes(stream_bytes)
    hdr = parse_header(s, limits)
    if hdr.profile_len > 0:                                                # O1
        prof_bytes = s[hdr.header_len:hdr.header_len + hdr.profile_len]
    else:
        if profile_bytes is None:                                          # O1'
            raise _err("ProfileRequired")
        prof_bytes = bytes(profile_bytes)
    prof = parse_profile(prof_bytes, limits)
    if prof.sha256 != hdr.profile_hash:                                    # O2
        raise _err("ProfileMismatch")
    if (prof.layers, prof.kv_heads, prof.head_dim) != (hdr.layers, hdr.kv_heads, hdr.head_dim):
        raise _err("ProfileShape")                                         # O3
    for e in hdr.chunks:                                                   # O4
        if e.level >= prof.n_levels:
            raise _err("UnknownLevel", None, "level %d" % e.level)

    L, H, D, T, G = hdr.layers, hdr.kv_heads, hdr.head_dim, hdr.tokens, hdr.group
    C = H * D
    dsize = DTYPE_SIZE[hdr.dtype_code]
    raw_dt = np.dtype("<u2") if dsize == 2 else np.dtype("<u4")
    out = [[np.zeros((T, C), dtype=raw_dt) for _ in range(2)] for _ in range(L)]
    consts_cache = {}

    for ci, e in enumerate(hdr.chunks):
        chunk = memoryview(s)[e.offset:e.offset + e.len_bytes]
        body_len = e.len_bytes - 4
        stored = struct.unpack_from("<I", chunk, body_len)[0]
        if crc32c(chunk[:body_len]) != stored:                             # C1
            raise _err("ChunkCrc", None, "chunk %d" % ci)
        rd = _Reader(chunk, 0, body_len, "chunk block")
        rows = e.tokens
        S = min(rows, max(0, hdr.n_sink - (hdr.first_position + e.token_start)))   # §5.3
        n_sym = (rows - S) * C
        level = prof.levels[e.level]
        mult = prof.level_mult[e.level]

        # Parse blocks in order; a parse error (B1-B6, C2) is reported only after the
        # decode-time checks (B7-B10) of the blocks before it, as a sequential decoder would.
        parsed = []
        pending = None
        try:
            for l in range(L):
                for kv in (0, 1):
                    parsed.append(((l, kv), _parse_block(rd, S, C, dsize, n_sym)))
            if rd.remaining() != 0:                                        # C2
                pending = _err("Inconsistent", "trailing bytes in chunk")
        except KvcError as err:
            pending = err

        # decode in batches
        i = 0
        per_block = max(1, n_sym + (rows - S) * H)
        batch = max(1, _BATCH_SYMBOLS // per_block)
        while i < len(parsed):
            part = parsed[i:i + batch]
            ctxs = [(l, kv, C, D, H, G, S, rows) for (l, kv), _ in part]
            if impl == "numpy":
                results = _decode_blocks_numpy([b for _, b in part], level, ctxs)
            else:
                results = [_decode_block_python(b, level, c) for (_, b), c in zip(part, ctxs)]
            for ((l, kv), b), res in zip(part, results):
                q, exps, sink = _finish_block(b, level, res, hdr.dtype_code)
                key = (e.level, l, kv)
                if key not in consts_cache:
                    consts_cache[key] = _block_consts(prof, l, kv, mult)
                x = _reconstruct(q, exps, sink, consts_cache[key], S, rows, C, H, D, G)
                dst = out[l][kv]
                t0 = e.token_start
                if S:                                                      # §7.3 sink: stored bits
                    dst[t0:t0 + S] = np.frombuffer(b.sink_raw, dtype=raw_dt).reshape(S, C)
                if rows > S:
                    xs = x[S:]
                    if hdr.dtype_code == 0:
                        dst[t0 + S:t0 + rows] = f32_to_f16_bits(xs)
                    elif hdr.dtype_code == 1:
                        dst[t0 + S:t0 + rows] = f32_to_bf16_bits(xs)
                    else:
                        dst[t0 + S:t0 + rows] = xs.view(np.uint32)
            i += batch
        if pending is not None:
            raise pending

    d = Decoded()
    d.dtype = hdr.dtype
    d.layers, d.kv_heads, d.head_dim, d.tokens = L, H, D, T
    d.header = hdr
    d.profile = prof
    d.rope_style = hdr.rope_style
    d.k_pre_rope = hdr.k_pre_rope
    d.rope_theta = hdr.rope_theta
    d.rope_scaling = hdr.rope_scaling
    d.first_position = hdr.first_position
    d.chunk_tokens = hdr.chunk_tokens
    d.group = hdr.group
    d.n_sink = hdr.n_sink
    d.model_id = hdr.model_id
    d.profile_hash = hdr.profile_hash
    d.embedded_profile = hdr.profile_len > 0
    view = {"f16": np.float16, "bf16": np.uint16, "f32": np.float32}[hdr.dtype]
    d.K = [out[l][0].view(view).reshape(T, H, D) for l in range(L)]
    d.V = [out[l][1].view(view).reshape(T, H, D) for l in range(L)]
    return d


def output_bytes(decoded):
    """Concatenation over layers of K then V, each [T, H, D] row-major little-endian in the
    stream's dtype (f16/bf16 as their 16-bit patterns, f32 as its 32-bit pattern)."""
    parts = []
    le = "<u2" if decoded.dtype in ("f16", "bf16") else "<u4"
    for l in range(decoded.layers):
        for arr in (decoded.K[l], decoded.V[l]):
            raw = np.ascontiguousarray(arr).view(np.uint16 if le == "<u2" else np.uint32)
            parts.append(raw.astype(le).tobytes())
    return b"".join(parts)


# ---------------------------------------------------------------------------------------------
# Command line: python3 kvc_ref.py STREAM [PROFILE] [-o OUT]

def _main(argv=None):
    import argparse
    import sys
    ap = argparse.ArgumentParser(description="kvc reference decoder (decode a stream)")
    ap.add_argument("stream")
    ap.add_argument("profile", nargs="?")
    ap.add_argument("-o", "--output", help="write output_bytes() here")
    ap.add_argument("--impl", default="numpy", choices=("numpy", "python"))
    a = ap.parse_args(argv)
    with open(a.stream, "rb") as f:
        sb = f.read()
    pb = None
    if a.profile:
        with open(a.profile, "rb") as f:
            pb = f.read()
    try:
        d = decode(sb, pb, impl=a.impl)
    except KvcError as err:
        print("error: %s" % err)
        return 1
    ob = output_bytes(d)
    print("%r model_id=%r sha256(output)=%s" % (d, d.model_id, hashlib.sha256(ob).hexdigest()))
    if a.output:
        with open(a.output, "wb") as f:
            f.write(ob)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
