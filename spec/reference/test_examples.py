#!/usr/bin/env python3
"""Checks the worked examples of spec/FORMAT.md with the reference decoder (plain asserts).

Usage: python3 spec/reference/test_examples.py

- §3.4: the CRC-32C check value.
- §1.2: f16/bf16 narrowing against an exhaustive-ish bit-pattern sweep; EXP_MULT (§7.1).
- §6.6: the one-lane rANS example, decoded (and encoded with the §6.5 encoder, step by step).
- §7.5: the rounding example, every intermediate f32 bit pattern and the narrowed values.
- Appendix B: the profile and stream bytes are parsed out of the hex tables in FORMAT.md itself
  (offsets checked against the byte counts), then hashed, CRC-checked and decoded; the block
  walk-throughs (exponents, symbols, f32 bits) and the decoded output table are compared.
"""

import hashlib
import os
import re
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kvc_ref as K  # noqa: E402

FORMAT_MD = os.path.join(os.path.dirname(HERE), "FORMAT.md")


def f32(bits):
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def bits(v):
    v = np.float32(v)
    assert isinstance(v, np.float32)
    return int(np.array([v], dtype=np.float32).view(np.uint32)[0])


# ---------------------------------------------------------------------------------------------

def test_crc():
    assert K.crc32c(b"123456789") == 0xE3069283
    assert K.crc32c_bitwise(b"123456789") == 0xE3069283
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 8, 9, 15, 16, 17, 100, 1000):
        d = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert K.crc32c(d) == K.crc32c_bitwise(d), n


def test_float_conversions():
    # EXP_MULT (§7.1): even e exact powers of two, odd e = r2 * 2^((e-1)/2), r2 = 0x3FB504F3
    r2 = f32(0x3FB504F3)
    for e in range(16):
        if e % 2 == 0:
            assert K.EXP_MULT[e] == np.float32(2.0 ** (e // 2))
        else:
            assert bits(r2 * np.float32(2.0 ** ((e - 1) // 2))) == bits(K.EXP_MULT[e])
    assert bits(K.EXP_MULT[15]) == 0x433504F3

    # narrowing: compare the integer implementation with numpy's IEEE conversion on a sweep of
    # f32 bit patterns (all exponents, many fractions, both signs), NaNs excluded
    rng = np.random.default_rng(7)
    u = np.concatenate([
        rng.integers(0, 1 << 32, 400000, dtype=np.uint64).astype(np.uint32),
        np.arange(0x33000000 - 4096, 0x33000000 + 4096, dtype=np.uint32),   # around 2^-25
        np.arange(0x387FF000, 0x38801000, dtype=np.uint32),                 # around 2^-14
        np.arange(0x477FE000, 0x47801000, dtype=np.uint32),                 # around 65504/65520
        (np.arange(0, 1 << 20, dtype=np.uint32) << np.uint32(12)),           # every 12-bit prefix
        np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 1, 0x80000001], dtype=np.uint32),
    ])
    u = np.concatenate([u, u ^ np.uint32(0x80000000)])
    x = u.view(np.float32)
    finite_or_inf = ~np.isnan(x)
    x = x[finite_or_inf]
    with np.errstate(over="ignore"):
        ref16 = x.astype(np.float16).view(np.uint16)
    got16 = K.f32_to_f16_bits(x)
    bad = np.flatnonzero(ref16 != got16)
    assert bad.size == 0, [(hex(int(x.view(np.uint32)[i])), hex(int(got16[i])), hex(int(ref16[i])))
                           for i in bad[:5]]
    assert int(K.f32_to_f16_bits(np.array([65520.0], np.float32))[0]) == 0x7C00
    assert int(K.f32_to_f16_bits(np.array([65519.996], np.float32))[0]) == 0x7BFF
    # bf16: round to nearest even of the upper 16 bits
    for ub, want in ((0x3F808000, 0x3F80), (0x3F818000, 0x3F82), (0x3F808001, 0x3F81),
                     (0x7F7FFFFF, 0x7F80), (0x7FC00001, 0x7FC0), (0x7F800001, 0x7FC0)):
        got = int(K.f32_to_bf16_bits(np.array([ub], np.uint32).view(np.float32))[0])
        assert got == want, (hex(ub), hex(got))
    # f16 NaN per §1.2: sign | 0x7C00 | 0x0200 | (fraction >> 13)
    assert int(K.f32_to_f16_bits(np.array([0xFF800001], np.uint32).view(np.float32))[0]) == 0xFE00
    # widening: every non-NaN f16 exactly
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    w = K.f16_bits_to_f32(h)
    notnan = ~np.isnan(h.view(np.float16))
    assert np.array_equal(w[notnan].view(np.uint32), h.view(np.float16)[notnan].astype(np.float32).view(np.uint32))
    assert int(K.f16_bits_to_f32(np.array([0xFC01], np.uint16)).view(np.uint32)[0]) == 0xFFC02000


# ---------------------------------------------------------------------------------------------
# §6.6

def encode_lane(symbols, table):
    """§6.5 lane encoder; returns (words, trace of states after each step)."""
    x = 0
    W = []
    trace = []
    for i in reversed(symbols):
        f, c = table.freqs[i], table.cum[i]
        emitted = None
        if (x >> 52) >= f:
            W.append(x & 0xFFFFFFFF)
            emitted = x & 0xFFFFFFFF
            x >>= 32
        x = ((x // f) << 12) | (c + x % f)
        trace.append((i, x, emitted))
    if x != 0:
        W.append(x & 0xFFFFFFFF)
        if x >> 32:
            W.append(x >> 32)
    return W, trace


def test_lane_example():
    t = K.Table(None, [1, 4093, 1, 1])
    assert t.cum == [0, 1, 4094, 4095]
    syms = [3, 2, 0, 1, 3, 2, 0, 3]
    words, trace = encode_lane(syms, t)
    assert words == [0x1403C000, 0x70FFEFFF, 0x00100200], [hex(w) for w in words]
    enc_states = [0xFFF, 0xFFF000, 0xFFF000FFE, 0xFFF000FFEFFF, 0x100200701403C,
                  0x100200701403C000, 0x10020070FFE, 0x10020070FFEFFF]
    assert [s for _, s, _ in trace] == enc_states, [hex(s) for _, s, _ in trace]
    assert [i for i, _, _ in trace] == [3, 0, 2, 3, 1, 0, 2, 3]
    assert trace[6][2] == 0x1403C000
    raw = b"".join(struct.pack("<I", w) for w in words)
    assert raw == bytes.fromhex("00C00314FFEFFF7000021000")

    d = K.LaneDecoder(words)
    assert d.x == 0x0010020070FFEFFF and d.unread == 1
    dec_states = [0x10020070FFE, 0x100200701403C000, 0x100200701403C, 0xFFF000FFEFFF,
                  0xFFF000FFE, 0xFFF000, 0xFFF, 0]
    dec_unread = [1, 0, 0, 0, 0, 0, 0, 0]
    out = []
    for k in range(8):
        out.append(d.decode(t))
        assert d.x == dec_states[k] and d.unread == dec_unread[k], (k, hex(d.x), d.unread)
    assert out == syms

    t2 = K.Table(None, [100, 3800, 100, 96])
    assert encode_lane([1], t2)[0] == [0x64]
    assert encode_lane([0], t2)[0] == []
    d = K.LaneDecoder([0x64])
    assert d.decode(t2) == 1 and d.x == 0 and d.unread == 0
    d = K.LaneDecoder([])
    assert d.decode(t2) == 0 and d.x == 0


# ---------------------------------------------------------------------------------------------
# §7.5

def test_rounding_example():
    mean, delta_step, anchor_step, mult = f32(0x3E800000), f32(0x3DCCCCCD), f32(0x3D4CCCCD), f32(0x3F000000)
    W = np.float32(12) * np.float32(0.0625)
    A = anchor_step * mult
    Dq = delta_step * mult
    assert (bits(A), bits(Dq), float(W)) == (0x3CCCCCCD, 0x3D4CCCCD, 0.75)

    prod = np.float32(3) * A
    assert bits(prod) == 0x3D99999A
    xa = mean + prod
    assert bits(xa) == 0x3EA66666
    d1 = xa - mean
    assert bits(d1) == 0x3D999998
    d2 = W * d1
    assert bits(d2) == 0x3D666664
    pred = mean + d2
    assert bits(pred) == 0x3E9CCCCC
    p2 = np.float32(-2) * Dq
    assert bits(p2) == 0xBDCCCCCD
    x = pred + p2
    assert bits(x) == 0x3E533332
    arr = np.array([xa, x], dtype=np.float32)
    assert [int(v) for v in K.f32_to_f16_bits(arr)] == [0x3533, 0x329A]
    assert [int(v) for v in K.f32_to_bf16_bits(arr)] == [0x3EA6, 0x3E53]

    # with step exponents: anchor e = 3, delta e = 1
    step = A * K.EXP_MULT[3]
    assert bits(step) == 0x3D90D0C3
    prod = np.float32(3) * step
    assert bits(prod) == 0x3E593924
    xa = mean + prod
    assert bits(xa) == 0x3EEC9C92
    d1 = xa - mean
    assert bits(d1) == 0x3E593924
    d2 = W * d1
    assert bits(d2) == 0x3E22EADB
    pred = mean + d2
    assert bits(pred) == 0x3ED1756E
    step = Dq * K.EXP_MULT[1]
    assert bits(step) == 0x3D90D0C3
    p2 = np.float32(-2) * step
    assert bits(p2) == 0xBE10D0C3
    x = pred + p2
    assert bits(x) == 0x3E890D0C
    arr = np.array([xa, x], dtype=np.float32)
    assert [int(v) for v in K.f32_to_f16_bits(arr)] == [0x3765, 0x3448]
    assert [int(v) for v in K.f32_to_bf16_bits(arr)] == [0x3EED, 0x3E89]

    # the same through the decoder's vectorised reconstruction (one anchor row, one delta row)
    consts = (np.array([A], np.float32), np.array([Dq], np.float32), np.array([W], np.float32),
              np.array([mean], np.float32))
    xr = K._reconstruct(np.array([3, -2]), np.array([3, 1]), np.zeros(0, np.float32), consts,
                        S=0, rows=2, C=1, H=1, D=1, G=2)
    assert [bits(v) for v in xr[:, 0]] == [0x3EEC9C92, 0x3E890D0C]
    xr = K._reconstruct(np.array([3, -2]), None, np.zeros(0, np.float32), consts,
                        S=0, rows=2, C=1, H=1, D=1, G=2)
    assert [bits(v) for v in xr[:, 0]] == [0x3EA66666, 0x3E533332]


# ---------------------------------------------------------------------------------------------
# Appendix B, parsed from FORMAT.md

def _appendix_b():
    text = open(FORMAT_MD, encoding="utf-8").read()
    start = text.index("## Appendix B")
    return text[start:]


def _table_after(text, marker):
    """Rows (list of cells) of the first markdown table after `marker`."""
    i = text.index(marker)
    lines = text[i:].splitlines()
    rows = []
    started = False
    for ln in lines[1:]:
        if ln.startswith("|"):
            started = True
            cells = [c.strip() for c in ln.strip().strip("|").split("|")]
            rows.append(cells)
        elif started:
            break
    return rows[2:]   # drop header and separator


def _bytes_cell(cell, full_hash):
    """Hex bytes of a 'Bytes' cell: backtick groups, `X` ×N repeats, '...' = the profile hash."""
    out = bytearray()
    for m in re.finditer(r"`([^`]*)`(\s*×\s*(\d+))?", cell):
        group = m.group(1)
        if "..." in group:
            head, tail = [bytes.fromhex(p) for p in group.split("...")]
            assert full_hash.startswith(head) and full_hash.endswith(tail)
            b = full_hash
        else:
            b = bytes.fromhex(group)
        out += b * (int(m.group(3)) if m.group(3) else 1)
    return bytes(out)


def _assemble(rows, full_hash, what):
    data = bytearray()
    for cells in rows:
        off = int(cells[0])
        assert off == len(data), "%s: row at offset %d, but %d bytes precede it" % (what, off, len(data))
        data += _bytes_cell(cells[1], full_hash)
    return bytes(data)


def appendix_b_bytes():
    b = _appendix_b()
    m = re.search(r"\*\*Profile\*\* \((\d+) bytes, SHA-256\s+`([0-9a-f]{64})`", b)
    prof_len, prof_sha = int(m.group(1)), bytes.fromhex(m.group(2))
    profile = _assemble(_table_after(b, "**Profile** ("), prof_sha, "profile")
    m = re.search(r"\*\*Stream\*\* \((\d+) bytes\): header \((\d+) bytes\) then one chunk \((\d+) bytes\)", b)
    stream_len, hdr_len, chunk_len = (int(g) for g in m.groups())
    header = _assemble(_table_after(b, "**Stream** ("), prof_sha, "header")
    chunk = _assemble(_table_after(b, "Chunk (offsets relative"), prof_sha, "chunk")
    assert len(profile) == prof_len == 220, len(profile)
    assert len(header) == hdr_len == 133, len(header)
    assert len(chunk) == chunk_len == 360, len(chunk)
    stream = header + chunk
    assert len(stream) == stream_len == 493
    return profile, prof_sha, stream


def _decoded_output_table():
    b = _appendix_b()
    rows = _table_after(b, "Decoded output (f16 bits")
    out = {}
    for cells in rows:
        name = cells[0]
        toks = [[int(h, 16) for h in re.match(r"`([^`]*)`", c).group(1).split()] for c in cells[1:]]
        out[name] = toks
    return out


def test_appendix_b():
    profile, prof_sha, stream = appendix_b_bytes()
    assert hashlib.sha256(profile).digest() == prof_sha
    assert K.crc32c(profile[:-4]) == 0xA0061F85 == struct.unpack("<I", profile[-4:])[0]
    assert K.crc32c(stream[:129]) == 0x792B15CC == struct.unpack("<I", stream[129:133])[0]
    assert K.crc32c(stream[133:-4]) == 0x33F7CBB9 == struct.unpack("<I", stream[-4:])[0]

    prof = K.parse_profile(profile)
    assert (prof.layers, prof.kv_heads, prof.head_dim, prof.n_levels, prof.flags) == (1, 2, 2, 1, 1)
    lv = prof.levels[0]
    assert [t.radius for t in lv.tables] == [1, 0, 2]
    assert lv.down == [1, 1, 0]
    # the down^e table of Appendix B
    assert [list(lv.down_pow[e]) for e in range(4)] == [[0, 1, 2], [1, 1, 0], [1, 1, 1], [1, 1, 1]]
    assert list(lv.map) == [2, 0, 2, 0, 0, 0, 2, 0, 1, 0, 2, 2, 1, 1, 0, 2]
    assert abs(prof.hints["quantile"] - 0.95) < 1e-7 and prof.hints["max_exp"] == 6

    hdr = K.parse_header(stream)
    assert (hdr.header_len, hdr.dtype, hdr.layers, hdr.kv_heads, hdr.head_dim, hdr.tokens) == \
        (133, "f16", 1, 2, 2, 3)
    assert (hdr.group, hdr.n_sink, hdr.model_id, hdr.rope_theta, hdr.profile_len) == (2, 1, "toy", 10000.0, 0)
    e = hdr.chunks[0]
    assert (e.offset, e.len_bytes, e.token_start, e.tokens, e.level) == (133, 360, 0, 3, 0)

    # block walk-throughs
    body = stream[133:-4]
    rd = K._Reader(body, 0, len(body), "chunk block")
    C, H, D, G, S, rows = 4, 2, 2, 2, 1, 3
    bk = K._parse_block(rd, S, C, 2, 8)
    assert rd.pos == 183
    bv = K._parse_block(rd, S, C, 2, 8)
    assert rd.pos == 356 and rd.remaining() == 0
    assert bk.n_exp == 3 and bk.exp_table.freqs == [1024, 2048, 1024] and bk.escapes == [-1, 2]
    assert bv.n_exp == 0 and bv.escapes == [1, -1, 3]

    for impl in ("python", "numpy"):
        if impl == "python":
            rk = K._decode_block_python(bk, lv, (0, 0, C, D, H, G, S, rows))
            rv = K._decode_block_python(bv, lv, (0, 1, C, D, H, G, S, rows))
        else:
            rk, rv = K._decode_blocks_numpy([bk, bv], lv, [(0, 0, C, D, H, G, S, rows),
                                                         (0, 1, C, D, H, G, S, rows)])
        exps, tids, idx, _, _ = rk
        assert list(exps) == [1, 0, 2, 1]
        assert list(tids) == [1, 1, 2, 0, 1, 1, 0, 1]
        assert list(idx) == [0, 1, 4, 0, 1, 0, 2, 0]
        q, exps, sink = K._finish_block(bk, lv, rk, 0)
        assert list(q) == [0, -1, 2, -1, 2, 0, 1, 0]
        consts = K._block_consts(prof, 0, 0, prof.level_mult[0])
        assert [float(v) for v in consts[0]] == [0.0625, 0.125, 0.1875, 0.25]
        assert [float(v) for v in consts[1]] == [0.125, 0.25, 0.375, 0.5]
        assert [float(v) for v in consts[2]] == [0.5, 1.0, 0.75, 0.0]
        assert [float(v) for v in consts[3]] == [0.0, -1.0, 0.25, 0.0]
        x = K._reconstruct(q, exps, sink, consts, S, rows, C, H, D, G)
        assert [bits(v) for v in x[1]] == [0x3E800000, 0xBFAD413D, 0x3F800000, 0xBF000000]
        assert [bits(v) for v in x[2]] == [0x3E800000, 0xBF800000, 0x3F03E1DB, 0x00000000]
        assert [int(v) for v in K.f32_to_f16_bits(x[1:]).reshape(-1)] == \
            [0x3400, 0xBD6A, 0x3C00, 0xB800, 0x3400, 0xBC00, 0x381F, 0x0000]

        exps, tids, idx, _, _ = rv
        assert exps is None
        assert list(tids) == [1, 1, 0, 2, 1, 0, 2, 2]
        q, _, sink = K._finish_block(bv, lv, rv, 0)
        assert list(q) == [0, 1, -1, -2, -1, 1, 0, 3]
        consts = K._block_consts(prof, 0, 1, prof.level_mult[0])
        x = K._reconstruct(q, None, sink, consts, S, rows, C, H, D, G)
        assert [float(v) for v in x[1]] == [0.5, 1.75, -0.75, 0.0]
        assert [float(v) for v in x[2]] == [0.46875, 1.25, 0.0, -0.3125]

    # whole decode, both lane decoders, against the "Decoded output" table of FORMAT.md
    table = _decoded_output_table()
    expect_k = table["layer 0 K"]
    expect_v = table["layer 0 V"]
    assert expect_k == [[0x3800, 0xBC00, 0x3400, 0x4000], [0x3400, 0xBD6A, 0x3C00, 0xB800],
                        [0x3400, 0xBC00, 0x381F, 0x0000]]
    assert expect_v == [[0x3400, 0x4000, 0xB800, 0x3C00], [0x3800, 0x3F00, 0xBA00, 0x0000],
                        [0x3780, 0x3D00, 0x0000, 0xB500]]
    for impl in ("numpy", "python"):
        d = K.decode(stream, profile, impl=impl)
        assert (d.dtype, d.layers, d.kv_heads, d.head_dim, d.tokens) == ("f16", 1, 2, 2, 3)
        assert d.K[0].shape == (3, 2, 2) and d.K[0].dtype == np.float16
        kb = d.K[0].view(np.uint16).reshape(3, 4).tolist()
        vb = d.V[0].view(np.uint16).reshape(3, 4).tolist()
        assert kb == expect_k, kb
        assert vb == expect_v, vb
        ob = K.output_bytes(d)
        assert ob == b"".join(struct.pack("<4H", *r) for r in expect_k + expect_v)

    # a few rejections of the example
    def rejects(kind, s, p=profile, limits=None):
        try:
            K.decode(s, p, limits=limits)
        except K.KvcError as err:
            assert err.kind == kind, (kind, str(err))
            return err
        raise AssertionError("accepted, expected %s" % kind)

    rejects("ProfileRequired", stream, None)
    rejects("ProfileCrc", stream, profile[:-1] + bytes([profile[-1] ^ 1]))
    rejects("ChunkCrc", stream[:-1] + bytes([stream[-1] ^ 1]))
    rejects("LimitExceeded", stream, limits={"max_elements": 23})
    K.decode(stream, profile, limits={"max_elements": 24})
    rejects("LimitExceeded", stream, limits={"max_profile_bytes": 219})
    rejects("Truncated", stream[:-1])
    rejects("Inconsistent", stream + b"\0")

    # §7.4: steps that overflow to infinity are accepted. Level multiplier 3e38 and K delta_step
    # 4.0 for c0 and c1 make Dq[0], Dq[1] infinite (profile CRC, hash and header CRC redone).
    p2 = bytearray(profile)
    p2[24:28] = struct.pack("<f", 3.0e38)
    p2[32:36] = struct.pack("<f", 4.0)      # K c0 delta_step
    p2[45:49] = struct.pack("<f", 4.0)      # K c1 delta_step
    p2[-4:] = struct.pack("<I", K.crc32c(p2[:-4]))
    s2 = bytearray(stream)
    s2[56:88] = hashlib.sha256(p2).digest()
    s2[129:133] = struct.pack("<I", K.crc32c(s2[:129]))
    for impl in ("numpy", "python"):
        d = K.decode(bytes(s2), bytes(p2), impl=impl)
        kf = d.K[0].astype(np.float32).reshape(3, 4)
        assert kf[0].tolist() == [0.5, -1.0, 0.25, 2.0]        # sink row unchanged
        assert np.isnan(kf[1, 0])                               # pred + (0 * inf)
        assert np.isinf(kf[1, 1]) and kf[1, 1] < 0              # -1 + (-1 * inf)
        assert kf[2, 1] == -1.0                                 # anchor: A[1] stays finite


def main():
    tests = [test_crc, test_float_conversions, test_lane_example, test_rounding_example,
             test_appendix_b]
    for t in tests:
        t()
        print("ok   %s" % t.__name__)
    print("all worked examples pass")


if __name__ == "__main__":
    main()
