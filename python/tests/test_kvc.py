import gc
import os
import pickle
import subprocess
import sys
import threading

import numpy as np
import pytest

import kvc
from kvc import _errors, _native


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, "bf16"])
def test_round_trip_keeps_dtype_and_shape(small, dtype):
    k, v = small
    if dtype == "bf16":  # bf16 bits: the top half of the f32 bits
        k = (k.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        v = (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        k, v = k.astype(dtype), v.astype(dtype)
    data = kvc.encode(k, v, level=3, chunk_tokens=32)
    assert data[:4] == b"KVCS"
    k2, v2 = kvc.decode(data)
    assert k2.shape == k.shape and k2.dtype == k.dtype and v2.dtype == v.dtype
    if dtype == "bf16":
        widen = lambda x: (x.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
        assert rel_err(widen(k), widen(k2)) < 0.05
    else:
        assert rel_err(k, k2) < 0.05 and rel_err(v, v2) < 0.1


def test_per_layer_lists_and_stacked_arrays_give_the_same_stream(small):
    k, v = small
    a = kvc.encode(k, v, chunk_tokens=40)
    b = kvc.encode(list(k), [x.copy() for x in v], chunk_tokens=40)
    assert a == b
    # A non-contiguous input is copied, not refused.
    kt = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert not kt.flags.c_contiguous
    assert kvc.encode(kt, v, chunk_tokens=40) == a


def test_dlpack_objects_are_accepted(small):
    k, v = small

    class OnlyDlpack:  # a stand-in for a framework tensor
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, *args, **kwargs):
            return self.a.__dlpack__(*args, **kwargs)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    assert kvc.encode([OnlyDlpack(x) for x in k], [OnlyDlpack(x) for x in v]) == kvc.encode(k, v)


def test_referenced_profile_and_levels_per_chunk(small):
    k, v = small
    p = kvc.Profile.learn([(k, v)])
    data = kvc.encode(k, v, profile=p, levels=[0, 5, 11, 7], chunk_tokens=25)
    s = kvc.Stream(data, p)
    assert [c[2] for c in s.chunks] == [0, 5, 11, 7]
    assert not s.profile_embedded and s.profile_hash == p.hash()
    embedded = kvc.Stream(kvc.encode(k, v, profile=p, levels=[0, 5, 11, 7], chunk_tokens=25, embed_profile=True))
    assert embedded.profile_embedded and embedded.levels == 4
    # Chunks decode the same whether the profile is referenced or embedded.
    assert np.array_equal(s.decode()[0], embedded.decode()[0])


def test_profiles_save_load_hash_pickle(small):
    k, v = small
    p = kvc.Profile.learn([kvc.Sample(k, v)])
    q = kvc.Profile.load(p.save())
    assert q == p and q.hash() == p.hash() and len(p.hash()) == 32
    assert p.hash_hex().startswith(p.hash()[:4].hex())
    assert pickle.loads(pickle.dumps(p)) == p
    assert (p.layers, p.kv_heads, p.head_dim, p.levels) == (3, 2, 16, 12)


# -- Stream, ranges and caller arrays ------------------------------------------------------


def test_stream_header_chunks_and_ranges(small):
    k, v = small
    data = kvc.encode(k, v, chunk_tokens=32, model_id="m", rope_style="neox", rope_theta=5e5, first_position=10)
    s = kvc.Stream(bytearray(data))
    assert (s.layers, s.tokens, s.kv_heads, s.head_dim, s.dtype) == (3, 100, 2, 16, "float16")
    assert [c[:2] for c in s.chunks] == [(0, 32), (32, 32), (64, 32), (96, 4)]
    assert s.model_id == "m" and s.rope[:2] == ("neox", 5e5) and s.first_position == 10
    full_k, full_v = s.decode()
    ck, cv = s.decode(chunk=2)
    assert np.array_equal(ck, full_k[:, 64:96]) and np.array_equal(cv, full_v[:, 64:96])
    rk, _ = s.decode(tokens=(20, 70))
    assert np.array_equal(rk, full_k[:, 20:70])
    assert np.array_equal(s.decode(tokens=range(5, 6))[0], full_k[:, 5:6])
    assert "100 tokens" in repr(s)


def test_decode_into_caller_arrays(small):
    k, v = small
    data = kvc.encode(k, v, chunk_tokens=32)
    ref_k, ref_v = kvc.decode(data)
    # Stacked arrays, written in place and returned.
    ok, ov = np.full_like(ref_k, 7), np.full_like(ref_v, 7)
    rk, rv = kvc.decode(data, out=(ok, ov))
    assert rk is ok and rv is ov
    assert np.array_equal(ok, ref_k) and np.array_equal(ov, ref_v)
    # Per-layer pages of a bigger pool (a server's KV pages), and another dtype.
    pool = np.zeros((2, 3, 100, 2, 16), np.float32)
    kvc.decode(data, out=(list(pool[0]), list(pool[1])))
    assert np.array_equal(pool[0].astype(np.float16), ref_k)  # f32 out: the values before rounding
    # A token range into a slice of a preallocated buffer.
    buf = np.zeros((3, 128, 2, 16), np.float16)
    vbuf = np.zeros_like(buf)
    kvc.Stream(data).decode(tokens=(32, 64), out=(list(buf[:, :32]), list(vbuf[:, :32])))
    assert np.array_equal(buf[:, :32], ref_k[:, 32:64]) and not buf[:, 32:].any()


def test_outputs_are_checked_not_copied(small):
    k, v = small
    data = kvc.encode(k, v)
    ok, ov = np.empty_like(k), np.empty_like(v)
    with pytest.raises(kvc.OutputError):  # wrong token count
        kvc.decode(data, out=(ok[:, :50], ov[:, :50]))
    with pytest.raises(kvc.OutputError):
        kvc.decode(data, out=(ok[:2], ov[:2]))
    with pytest.raises(kvc.ArgumentError, match="C-contiguous"):
        kvc.decode(data, out=(np.empty((3, 2, 100, 16), np.float16).transpose(0, 2, 1, 3), ov))
    ro = np.empty_like(k)
    ro.flags.writeable = False
    with pytest.raises(kvc.ArgumentError):
        kvc.decode(data, out=(ro, ov))
    with pytest.raises(kvc.ArgumentError, match="overlap"):
        kvc.decode(data, out=(ok, ok))
    with pytest.raises(kvc.ArgumentError):
        kvc.decode(data, out=(ok.astype(np.float64), ov))


def test_the_native_decode_takes_stacked_outputs_or_lists(small):
    # Stream.decode passes a stacked output whole; the native module splits it by layer.
    k, v = small
    s = kvc.Stream(kvc.encode(k, v))
    want_k, want_v = s.decode()
    for n in (100, 7):
        sk, sv = np.zeros_like(k[:, :n]), np.zeros_like(v[:, :n])
        lk, lv = np.zeros_like(sk), np.zeros_like(sv)
        s._s.decode_into(0, n, sk, sv)
        s._s.decode_into(0, n, list(lk), tuple(lv))
        assert np.array_equal(sk, want_k[:, :n]) and np.array_equal(sv, want_v[:, :n])
        assert np.array_equal(lk, sk) and np.array_equal(lv, sv)
    odd = np.empty(k[:, :7].size - 1, np.float16)  # not a whole number of layers
    with pytest.raises(kvc.OutputError, match="do not split into the stream's 3 layers"):
        s._s.decode_into(0, 7, odd, np.empty_like(v[:, :7]))
    with pytest.raises(kvc.ArgumentError, match="overlap"):  # sk is the last n = 7's
        s._s.decode_into(0, 7, sk, list(sk))


# -- every error kind ----------------------------------------------------------------------


def test_error_classes_match_the_library():
    kinds = _native.error_kinds()
    assert [(c.code, c.__name__) for c in _errors.ALL] == [(code, name + "Error") for code, name in kinds]
    for code, name in kinds:
        with pytest.raises(getattr(kvc, name + "Error")) as e:
            _native._raise(code, "message")
        assert isinstance(e.value, kvc.KvcError) and str(e.value) == "message"


def test_every_error_kind_from_real_input(small):
    k, v = small
    p = kvc.Profile.learn([(k, v)])
    data = kvc.encode(k, v, profile=p, chunk_tokens=32)
    with pytest.raises(kvc.ArgumentError):
        kvc.encode(k.astype(np.float64), v)
    with pytest.raises(kvc.ArgumentError):
        kvc.decode("not bytes")
    with pytest.raises(kvc.HeaderError) as e:
        kvc.decode(b"KVCS" + bytes(200))
    assert e.value.check is not None
    with pytest.raises(kvc.HeaderError) as e:
        kvc.decode(data[:50], profile=p)
    assert e.value.spec_class == "Truncated"
    with pytest.raises(kvc.ProfileError):
        kvc.Profile.load(b"nonsense")
    with pytest.raises(kvc.ProfileMismatchError) as e:
        kvc.decode(data)
    assert e.value.check == "O1′"
    other = kvc.Profile.learn([(v, k)])
    with pytest.raises(kvc.ProfileMismatchError):
        kvc.decode(data, profile=other)
    bad = bytearray(data)
    bad[-1] ^= 1
    with pytest.raises(kvc.ChunkError) as e:
        kvc.decode(bytes(bad), profile=p)
    assert (e.value.check, e.value.spec_class) == ("C1", "ChunkCrc")
    s = kvc.Stream(bytes(bad), p)
    s.decode(chunk=0)  # the damaged chunk is the last one; the others still decode
    with pytest.raises(kvc.OutputError):
        kvc.decode(data, profile=p, out=(k[:1].copy(), v[:1].copy()))
    with pytest.raises(kvc.OutOfRangeError):
        s.decode(chunk=9)
    with pytest.raises(kvc.OutOfRangeError):
        s.decode(tokens=(90, 101))
    with pytest.raises(kvc.EncodeError):
        kvc.encode(k, v, profile=p, level=12)
    nan = k.copy()
    nan[1, 3, 0, 0] = np.nan
    with pytest.raises(kvc.EncodeError, match="NaN"):
        kvc.encode(nan, v)
    with pytest.raises(kvc.EncodeError):
        kvc.encode(k, v, levels=[1, 2], chunk_tokens=32)


def test_hostile_arguments_raise_kvc_errors(small):
    """Arguments no caller should pass: each is a KvcError naming the problem, never another
    exception, an abort or a crash."""
    k, v = small
    # model_id=None was stored as "None"; rope_theta="x" raised ValueError.
    for kwargs in [dict(chunk_tokens=-1), dict(chunk_tokens=2**32), dict(sink=2**16), dict(group=1.5),
                   dict(first_position=-1), dict(levels=[256]), dict(levels=["a"]), dict(levels=3),
                   dict(model_id=None), dict(rope_theta="x"), dict(rope_scaling=[1])]:
        with pytest.raises(kvc.ArgumentError):
            kvc.encode(k, v, **kwargs)
    with pytest.raises(kvc.EncodeError, match="0 chunk levels"):
        kvc.encode(k, v, levels=[])
    q = np.zeros((k.shape[0], 2, 4, k.shape[3] // 2), np.float32)  # head_dim halved
    with pytest.raises(kvc.ArgumentError, match="queries"):
        kvc.encode(k, v, queries=q)
    with pytest.raises(kvc.ArgumentError, match="q_start"):
        kvc.encode(k, v, queries=np.zeros(q.shape[:3] + (k.shape[3],), np.float32), q_start=-1)
    # No tokens, 2^40 channels: nothing of that size is allocated.
    empty = np.zeros((1, 0, 1 << 20, 1 << 20), np.float32)
    with pytest.raises(kvc.EncodeError, match="1099511627776 channels"):
        kvc.encode(empty, empty)
    with pytest.raises(kvc.EncodeError, match="no sample tokens"):
        kvc.Profile.learn([(empty, empty)])
    # A profile decoders would refuse (1025 layers) was learned, then panicked (InternalError).
    deep = np.zeros((1025, 2, 1, 2), np.float32)
    with pytest.raises(kvc.EncodeError, match="1025 layers would be refused by decoders"):
        kvc.Profile.learn([(deep, deep)])
    with pytest.raises(kvc.EncodeError, match="1025 layers: decoders accept at most 1024"):
        kvc.encode(deep, deep)
    with pytest.raises(kvc.ArgumentError):
        kvc.Profile.learn([(k,)])
    with pytest.raises(kvc.ArgumentError):
        kvc.decode(kvc.encode(k, v), dtype=object())
    stream = kvc.Stream(kvc.encode(k, v))
    with pytest.raises(kvc.ArgumentError):
        stream.decode(tokens=(0.5, 3))
    # Before: a step was ignored (tokens 0..10 decoded), the others raised TypeError/ValueError.
    for tokens in [range(0, 10, 2), 5, (1, 2, 3)]:
        with pytest.raises(kvc.ArgumentError, match="tokens"):
            stream.decode(tokens=tokens)
    for chunk in [1.5, "a"]:
        with pytest.raises(kvc.ArgumentError, match="chunk"):
            stream.decode(chunk=chunk)
    assert [a.shape[1] for a in stream.decode(tokens=range(2, 7))] == [5, 5]
    keys = k[0, :, 0, :].astype(np.float32)
    for kwargs in [dict(bits=300), dict(m=-1), dict(seed=-1), dict(max_iters=-2)]:
        with pytest.raises(kvc.ArgumentError):
            kvc.pq.Codebook.train(keys, **kwargs)
    # 64 books of 4096 codewords of 2^20 values (1 TiB) for one key: refused, not an abort.
    with pytest.raises(kvc.ArgumentError, match="centroid values"):
        kvc.pq.Codebook.train(np.ones((1, 1 << 20), np.float32), m=64, bits=12)
    cb = kvc.pq.Codebook.train(keys)
    codes = cb.encode(keys)
    # Keys two dims wide were coded as two keys each, then numpy's reshape raised ValueError.
    with pytest.raises(kvc.ArgumentError, match="keys must be"):
        cb.encode(np.concatenate([keys, keys], axis=1))
    # An empty array of a dimension >= 2^32 raised OverflowError in the native call.
    wide = np.zeros((1, 0, 1, 1 << 32), np.float32)
    with pytest.raises(kvc.ArgumentError, match=r"below 2\*\*32"):
        kvc.encode(wide, wide)
    with pytest.raises(kvc.ArgumentError):
        kvc.pq.select(cb, codes, keys[0], k=-1)
    # Before: two queries were summed as one, codes of 65 536 wrapped to 0 and -1 to 65 535.
    with pytest.raises(kvc.ArgumentError, match="values, expected"):
        kvc.pq.select(cb, codes, keys[:2], k=4)
    for bad in [codes.astype(np.int64) + 65536, codes.astype(np.int64) - 1, codes + 0.5]:
        with pytest.raises(kvc.ArgumentError, match="codes"):
            kvc.pq.select(cb, bad, keys[0], k=4)
    assert np.array_equal(kvc.pq.select(cb, codes.astype(np.int64), keys[0], k=4),
                          kvc.pq.select(cb, codes, keys[0], k=4))


def test_only_numpy_arrays_reach_native_memory(small):
    """The native module reads memory only through a numpy.ndarray's own interface: an object
    that merely claims one (an address it does not own) is refused, and ndarray subclasses are
    viewed as ndarrays, the same bytes encoded."""

    class Claims:
        __array_interface__ = {"data": (8, False), "typestr": "<f4", "shape": (4,), "version": 3}

    class Lies(np.ndarray):
        @property
        def __array_interface__(self):
            return {"data": (8, False), "typestr": "<f4", "shape": (4,), "version": 3}

    lies = np.zeros(4, np.float32).view(Lies)
    for fake in [Claims(), lies]:
        with pytest.raises(kvc.ArgumentError, match="not a numpy.ndarray"):
            _native.encode([fake], [fake], (1, 1, 1, 4), profile=None, embed=False, queries=None,
                           q_heads=0, q_start=0, levels=[7], chunk_tokens=16, group=10, sink=1,
                           uniform_steps=False, model_id="", rope_style=0, rope_theta=1e4,
                           rope_scaling=1.0, k_pre_rope=False, first_position=0)

    class Sub(np.ndarray):
        pass

    k, v = small
    assert kvc.encode(k.view(Sub), v.view(Sub)) == kvc.encode(k, v)


def _damaged(data, rng):
    """`data` with one seeded kind of damage: bits flipped, cut short, or bytes inserted."""
    bad = bytearray(data)
    kind = rng.integers(3)
    if kind == 0:
        for _ in range(rng.integers(1, 4)):
            bad[rng.integers(len(bad))] ^= 1 << int(rng.integers(8))
    elif kind == 1:
        del bad[rng.integers(len(bad)) :]
    else:
        at = int(rng.integers(len(bad)))
        bad[at:at] = rng.integers(256, size=int(rng.integers(1, 9)), dtype=np.uint8).tobytes()
    return bytes(bad)


def test_damaged_streams_and_profiles_raise_library_errors(small):
    # Every byte of a stream is under a CRC (header, embedded profile, chunks) and every
    # length is checked, so each damaged copy must raise a KvcError: never another exception,
    # never a decode that returns.
    k, v = small
    p = kvc.Profile.learn([(k, v)])
    rng = np.random.default_rng(2026)
    streams = [(kvc.encode(k, v, chunk_tokens=32), None), (kvc.encode(k, v, profile=p, chunk_tokens=32), p)]
    kinds = set()
    for data, profile in streams:
        for _ in range(150):
            with pytest.raises(kvc.KvcError) as e:
                kvc.Stream(_damaged(data, rng), profile).decode()
            kinds.add(type(e.value).__name__)
    blob = p.save()
    for _ in range(150):
        with pytest.raises(kvc.KvcError) as e:
            kvc.Profile.load(_damaged(blob, rng))
        kinds.add(type(e.value).__name__)
    assert {"HeaderError", "ProfileError", "ChunkError"} <= kinds, kinds


def test_a_panic_does_not_take_the_interpreter_down():
    with pytest.raises(kvc.InternalError, match="deliberate panic"):
        _native._panic()
    assert kvc.decode(kvc.encode(np.ones((1, 4, 1, 2), np.float32), np.ones((1, 4, 1, 2), np.float32)))


# -- threads and memory --------------------------------------------------------------------


def test_decode_from_several_threads(small):
    k, v = small
    s = kvc.Stream(kvc.encode(k, v, chunk_tokens=16))
    want = s.decode()
    results, errors = [], []

    def work():
        try:
            for _ in range(20):
                results.append(s.decode())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 80
    assert all(np.array_equal(r[0], want[0]) and np.array_equal(r[1], want[1]) for r in results)


def _rss_bytes():
    """Resident bytes now (Linux), else the peak so far (macOS, BSDs): growth shows in both."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def test_repeated_decodes_do_not_grow_memory(dump):
    data = kvc.encode(dump.keys[:8], dump.values[:8])
    out = kvc.decode(data)
    s = kvc.Stream(data)
    for _ in range(20):
        s.decode(out=out)
        kvc.decode(data)
    gc.collect()
    before = _rss_bytes()
    for _ in range(300):
        s.decode(out=out)
        kvc.decode(data)
    gc.collect()
    grown = _rss_bytes() - before
    assert grown < 4 << 20, f"RSS grew by {grown} bytes over 300 decodes"
    # Encodes likewise (referenced profile, the server's steady state).
    p = kvc.Profile.learn([(dump.keys[:8], dump.values[:8])])
    for _ in range(5):
        kvc.encode(dump.keys[:8], dump.values[:8], profile=p)
    gc.collect()
    before = _rss_bytes()
    for _ in range(60):
        kvc.encode(dump.keys[:8], dump.values[:8], profile=p)
    gc.collect()
    grown = _rss_bytes() - before
    assert grown < 4 << 20, f"RSS grew by {grown} bytes over 60 encodes"


# -- the same bytes as the command ---------------------------------------------------------


def test_self_contained_stream_is_the_cli_stream(dump, kvc_cli, tmp_path):
    out = tmp_path / "a.kvc"
    subprocess.run([str(kvc_cli), "encode", str(dump_path()), str(out), "--level", "9", "--chunk-tokens", "200"], check=True, capture_output=True)
    ours = kvc.encode(dump.keys, dump.values, level=9, chunk_tokens=200, queries=dump.queries, q_start=dump.q_start, **dump.encode_kwargs())
    assert ours == out.read_bytes()
    # `kvc decode` of it gives the bits we decode (its embedded profile, none given).
    dec = tmp_path / "a.safetensors"
    subprocess.run([str(kvc_cli), "decode", str(out), str(dec)], check=True, capture_output=True)
    from conftest import read_safetensors

    tensors, _ = read_safetensors(dec)
    k, v = kvc.decode(ours)
    for i in range(dump.layers):
        assert np.array_equal(tensors[f"k.{i}"], k[i]) and np.array_equal(tensors[f"v.{i}"], v[i])


def test_referenced_stream_and_profile_are_the_cli_ones(dump, kvc_cli, tmp_path):
    prof, out = tmp_path / "p.kvcp", tmp_path / "b.kvc"
    run = lambda *a: subprocess.run([str(kvc_cli), *map(str, a)], check=True, capture_output=True)  # noqa: E731
    run("profile", "-o", prof, dump_path())
    run("encode", dump_path(), out, "--profile", prof, "--levels", "2,7", "--chunk-tokens", "300", "--sink", "4", "--uniform-steps")
    rope = {k: v for k, v in dump.encode_kwargs().items() if k.startswith(("rope", "k_pre", "first"))}
    p = kvc.Profile.learn([kvc.Sample(dump.keys, dump.values, dump.queries, dump.q_start)], **rope)
    assert p.save() == prof.read_bytes()
    ours = kvc.encode(dump.keys, dump.values, profile=p, levels=[2, 7], chunk_tokens=300, sink=4, uniform_steps=True, **dump.encode_kwargs())
    assert ours == out.read_bytes()
    # Embedding the profile learned from this cache is what a self-contained stream does.
    args = dict(levels=[2, 7], chunk_tokens=300, sink=4, uniform_steps=True, **dump.encode_kwargs())
    embedded = kvc.encode(dump.keys, dump.values, profile=p, embed_profile=True, **args)
    assert embedded == kvc.encode(dump.keys, dump.values, queries=dump.queries, q_start=dump.q_start, **args)
    # And `kvc decode` gives the bits we decode.
    dec = tmp_path / "d.safetensors"
    run("decode", out, dec, "--profile", prof)
    from conftest import read_safetensors

    tensors, _ = read_safetensors(dec)
    k, v = kvc.decode(ours, profile=p)
    for i in range(dump.layers):
        assert np.array_equal(tensors[f"k.{i}"], k[i]) and np.array_equal(tensors[f"v.{i}"], v[i])


def test_bf16_and_f32_streams_are_the_cli_streams(dump, kvc_cli, tmp_path):
    from conftest import write_safetensors

    f32 = [k.astype(np.float32) for k in dump.keys[:4]], [v.astype(np.float32) for v in dump.values[:4]]
    bf16 = [[(x.view(np.uint32) >> 16).astype(np.uint16) for x in t] for t in f32]  # truncated
    for name, (keys, values) in {"f32": f32, "bf16": bf16}.items():
        src, out = tmp_path / f"{name}.safetensors", tmp_path / f"{name}.kvc"
        tensors = {f"{t}.{i}": a for t, arrays in (("k", keys), ("v", values)) for i, a in enumerate(arrays)}
        write_safetensors(src, tensors, {"model": "m", "rope_style": "gptj", "rope_theta": "5000.0"})
        subprocess.run([str(kvc_cli), "encode", str(src), str(out), "--chunk-tokens", "128"], check=True, capture_output=True)
        ours = kvc.encode(keys, values, chunk_tokens=128, model_id="m", rope_style="gptj", rope_theta=5000.0)
        assert ours == out.read_bytes(), name
        assert kvc.Stream(ours).dtype == {"f32": "float32", "bf16": "bfloat16"}[name]


def dump_path():
    from conftest import FIXTURE

    return FIXTURE


# -- kvc.pq --------------------------------------------------------------------------------


def test_pq_codes_and_selection(dump):
    keys = dump.keys[3][:, 1, :].astype(np.float32)  # one (layer, KV head): [T, D]
    cb = kvc.pq.Codebook.train(keys)
    codes = cb.encode(keys)
    assert codes.shape == (keys.shape[0], 2) and codes.dtype == np.uint16 and codes.max() < 64
    q = dump.queries[3][0, 3]
    idx = kvc.pq.select(cb, codes, q, k=50)
    t = keys.shape[0]
    assert len(idx) == 4 + 64 + 50
    assert set(range(4)) <= set(idx) and set(range(t - 64, t)) <= set(idx)
    assert np.all(np.diff(idx.astype(np.int64)) > 0) or len(set(idx)) == len(idx)
    with pytest.raises(kvc.ArgumentError):
        kvc.pq.Codebook.train(keys, method="zz")


def test_the_gil_is_released_while_decoding(dump):
    import sys
    import time

    p = kvc.Profile.learn([(dump.keys, dump.values)])
    keys = [np.concatenate([k] * 4) for k in dump.keys]  # 2048 tokens
    values = [np.concatenate([v] * 4) for v in dump.values]
    s = kvc.Stream(kvc.encode(keys, values, profile=p), p)
    out = s.decode()
    one = min(_timed(lambda: s.decode(out=out)) for _ in range(3))
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        worker = threading.Thread(target=lambda: [s.decode(out=out) for _ in range(8)])
        gaps, last = [], time.perf_counter()
        worker.start()
        while worker.is_alive():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        worker.join()
    finally:
        sys.setswitchinterval(old)
    # Holding the GIL through a decode would stall this loop for a whole decode.
    assert max(gaps) < one / 2, f"longest stall {max(gaps) * 1e3:.1f} ms, one decode {one * 1e3:.1f} ms"


def _timed(f):
    import time

    t = time.perf_counter()
    f()
    return time.perf_counter() - t
