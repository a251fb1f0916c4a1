"""The serde adapter in a stand-in for a serving engine's KV store loop: the engine hands the
serializer one KV tensor per request in its layout, stores the bytes, later fetches and
deserializes them into the shape it gave."""

import numpy as np
import pytest

import kvc
from kvc.serde import KvcDeserializer, KvcSerializer


class StandInEngine:
    """What an LMCache-style engine does with a serde pair: put(key, kv) / get(key)."""

    def __init__(self, serializer, deserializer):
        self.serializer, self.deserializer = serializer, deserializer
        self.store = {}

    def put(self, key, kv):
        self.store[key] = self.serializer.to_bytes(kv)

    def get(self, key):
        blob = self.store.get(key)
        return None if blob is None else self.deserializer.from_bytes(blob)


def to_layout(k, v, layout):
    """[L, T, H, D] K and V as one KV tensor of `layout`."""
    kv = np.stack([k, v], axis=1)  # [L, 2, T, H, D]
    return kv if layout == "vllm" else np.ascontiguousarray(kv.transpose(0, 1, 3, 2, 4))


@pytest.mark.parametrize("layout", ["vllm", "huggingface"])
@pytest.mark.parametrize("with_profile", [False, True])
def test_engine_loop(dump, layout, with_profile):
    k = np.stack(dump.keys[:6])[:, :300]
    v = np.stack(dump.values[:6])[:, :300]
    profile = kvc.Profile.learn([(k, v)]) if with_profile else None
    engine = StandInEngine(
        KvcSerializer(layout=layout, level=5, profile=profile, chunk_tokens=128),
        KvcDeserializer(layout=layout, profile=profile, as_torch=False),
    )
    requests = {f"req{i}": to_layout(k[:, i * 100 : (i + 1) * 100], v[:, i * 100 : (i + 1) * 100], layout) for i in range(3)}
    for key, kv in requests.items():
        engine.put(key, kv)
    assert engine.get("missing") is None
    for key, kv in requests.items():
        back = engine.get(key)
        assert back.shape == kv.shape and back.dtype == kv.dtype
        err = np.linalg.norm((back - kv).astype(np.float32)) / np.linalg.norm(kv.astype(np.float32))
        assert err < 0.05
        blob = engine.store[key]
        assert len(blob) < kv.nbytes / 2  # under half of f16, profile and headers included
        # Both layouts hold the same cache: the stream decodes to the same [L, T, H, D].
        s = kvc.Stream(blob, profile)
        assert (s.layers, s.tokens, s.kv_heads, s.head_dim) == (6, 100, 3, 64)


def test_decode_into_the_engines_buffer(dump):
    k = np.stack(dump.keys[:2])[:, :64]
    v = np.stack(dump.values[:2])[:, :64]
    kv = to_layout(k, v, "vllm")
    blob = KvcSerializer(level=3).to_bytes(kv)
    page = np.zeros_like(kv)
    out = KvcDeserializer(as_torch=False).from_bytes(blob, out=page)
    assert out is page and np.array_equal(page, KvcDeserializer(as_torch=False).from_bytes(blob))


def test_wrong_layouts_are_refused(dump):
    with pytest.raises(kvc.ArgumentError):
        KvcSerializer(layout="sglang")
    with pytest.raises(kvc.ArgumentError):
        KvcSerializer().to_bytes(np.zeros((2, 3, 4, 5, 6), np.float16))
