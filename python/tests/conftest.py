import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "testdata" / "smollm2-gpl3-512.safetensors"
_DT = {"F16": np.float16, "BF16": np.uint16, "F32": np.float32, "U32": np.uint32}


def read_safetensors(path):
    """(tensors, metadata) of a safetensors file (numpy; BF16 as uint16 bits)."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, t in header.items():
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(raw[base + a : base + b], dtype=_DT[t["dtype"]]).reshape(t["shape"])
    return out, meta


class Dump:
    def __init__(self, path):
        self.tensors, self.meta = read_safetensors(path)
        self.layers = int(self.meta.get("layers", sum(1 for k in self.tensors if k.startswith("k."))))
        self.keys = [self.tensors[f"k.{i}"] for i in range(self.layers)]
        self.values = [self.tensors[f"v.{i}"] for i in range(self.layers)]
        q = [self.tensors.get(f"q.{i}") for i in range(self.layers)]
        self.queries = None if q[0] is None else [x.astype(np.float32) for x in q]
        tokens = self.keys[0].shape[0]
        n_q = 0 if self.queries is None else self.queries[0].shape[0]
        self.q_start = int(self.meta.get("q_start", tokens - n_q))

    def encode_kwargs(self):
        """kvc.encode's header arguments as `kvc encode` derives them from the metadata."""
        style = self.meta.get("rope_style", "").strip().lower()
        if style.startswith("rotate_half") or "neox" in style:
            rope = "neox"
        elif "interleave" in style or "gptj" in style or "gpt-j" in style:
            rope = "gptj"
        else:
            rope = "none"
        return dict(
            model_id=self.meta.get("model", ""),
            rope_style=rope,
            rope_theta=float(self.meta.get("rope_theta", 10000.0)),
            rope_scaling=float(self.meta.get("rope_scaling", 1.0)),
            k_pre_rope=self.meta.get("pre_rope", "").strip() == "1",
            first_position=int(self.meta.get("first_position", 0)),
        )


@pytest.fixture(scope="session")
def dump():
    return Dump(FIXTURE)


@pytest.fixture(scope="session")
def kvc_cli():
    """The `kvc` command: $KVC_CLI, else target/release/kvc (tools/test-bindings builds it)."""
    path = Path(os.environ.get("KVC_CLI", ROOT / "target" / "release" / "kvc"))
    if not path.exists():
        pytest.fail(f"{path} is missing: build it with `cargo build --release -p kvc-cli` or set KVC_CLI")
    return path


@pytest.fixture
def small():
    """A small f16 cache: 3 layers, 100 tokens, 2 heads of 16 dims, stacked [L, T, H, D]."""
    rng = np.random.default_rng(7)
    t = np.arange(100)[None, :, None, None]
    base = np.sin(0.05 * t + np.arange(16)[None, None, None, :] * 0.3)
    k = (base + 0.3 * rng.standard_normal((3, 100, 2, 16))).astype(np.float16)
    v = (0.5 * rng.standard_normal((3, 100, 2, 16))).astype(np.float16)
    return k, v


def write_safetensors(path, tensors, metadata):
    """Writes numpy arrays (uint16 as BF16) and string metadata as a safetensors file."""
    names = {np.dtype(np.float16): "F16", np.dtype(np.uint16): "BF16", np.dtype(np.float32): "F32"}
    header, offset, blobs = {"__metadata__": metadata}, 0, []
    for name, a in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
