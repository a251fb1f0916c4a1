#!/usr/bin/env python3
"""The reference decoder against today's encoder, on a real cache.

The golden vectors pin streams written once; this checks the streams the `kvc` command writes
now. It encodes a safetensors dump several ways (embedded and referenced profiles, one level
and a level per chunk, remainder chunks and groups, sinks, uniform steps; the dump widened to
F32, narrowed to BF16, and moved to position 1000 by `kvc shift`), decodes each stream
with `kvc decode` and with `kvc_ref.decode`, and requires the same output bytes (K then V per
layer, as `kvc_ref.output_bytes` lays them out). One line per case, exit status 1 on any
difference or error.

    python3 spec/reference/against_encoder.py target/release/kvc testdata/smollm2-gpl3-512.safetensors
"""

import hashlib
import json
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import kvc_ref

# (name, `kvc encode` options[, the dump's variant]); "{profile}" is a profile learned from the
# dump by `kvc profile`.
CASES = [
    ("default: embedded profile, level 7, one chunk", []),
    ("referenced profile, 128-token chunks at levels 0, 3, 7, 11",
     ["--profile", "{profile}", "--chunk-tokens", "128", "--levels", "0,3,7,11"]),
    ("embedded, level 11, 100-token chunks, groups of 1, no sink, uniform steps",
     ["--level", "11", "--chunk-tokens", "100", "--group", "1", "--sink", "0", "--uniform-steps"]),
    ("referenced, level 0, groups of 24 (a remainder group), 4 sinks",
     ["--profile", "{profile}", "--level", "0", "--group", "24", "--sink", "4"]),
    ("the dump widened to F32, referenced, 200-token chunks at levels 2, 9, 5",
     ["--profile", "{profile}", "--chunk-tokens", "200", "--levels", "2,9,5"], "F32"),
    ("the dump narrowed to BF16, embedded, level 4, groups of 7, 3 sinks",
     ["--level", "4", "--group", "7", "--sink", "3"], "BF16"),
    ("the dump moved to position 1000 (kvc shift, no queries), embedded, level 9",
     ["--level", "9"], "shifted"),
]


def variant(kvc, dump, kind, tmp):
    """The dump as the case wants it: itself, its K/V in another float dtype, or moved to
    position 1000 by `kvc shift`."""
    if kind is None:
        return dump
    out = tmp / ("%s.safetensors" % kind)
    if kind == "shifted":
        run(kvc, "shift", dump, out, "--from", "0", "--to", "1000")
        return out
    import numpy as np

    raw, header, base = read_safetensors(dump)
    metadata = header.pop("__metadata__", {})
    data, offset = [], 0
    for name, entry in sorted(header.items(), key=lambda e: e[1]["data_offsets"][0]):
        a, b = entry["data_offsets"]
        part = raw[base + a:base + b]
        if entry["dtype"] == "F16" and name.split(".")[0] in ("k", "v"):
            wide = np.frombuffer(part, dtype="<f2").astype("<f4")
            if kind == "F32":
                part = wide.tobytes()
            else:  # BF16, rounded to nearest even (no NaN in a real cache)
                u = wide.view("<u4").astype(np.uint64)
                part = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()
            entry["dtype"] = kind
        entry["data_offsets"] = [offset, offset + len(part)]
        offset += len(part)
        data.append(part)
    metadata.pop("dtype", None)
    text = json.dumps(dict(header, __metadata__=metadata)).encode()
    text += b" " * (-len(text) % 8)
    out.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(data))
    return out


def run(*args):
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(map(str, args)), r.returncode, r.stderr.strip()))


def read_safetensors(path):
    """A safetensors file's bytes, its header (a dict) and where its data begins."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw, json.loads(raw[8:8 + n]), 8 + n


def safetensors_kv_bytes(path):
    """K then V of every layer of a `kvc decode` dump, little-endian, as output_bytes lays
    them out; and the dtype's name."""
    raw, header, base = read_safetensors(path)
    header.pop("__metadata__", None)
    layers = sum(1 for k in header if k.startswith("k."))
    parts, dtypes = [], set()
    for i in range(layers):
        for name in ("k.%d" % i, "v.%d" % i):
            a, b = header[name]["data_offsets"]
            dtypes.add(header[name]["dtype"])
            parts.append(raw[base + a:base + b])
    return b"".join(parts), dtypes


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    kvc, dump = Path(argv[1]).resolve(), Path(argv[2]).resolve()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        profile = tmp / "profile.kvcp"
        run(kvc, "profile", "-o", profile, dump)
        for i, (name, options, *kind) in enumerate(CASES):
            stream, out = tmp / ("%d.kvc" % i), tmp / ("%d.safetensors" % i)
            options = [o.replace("{profile}", str(profile)) for o in options]
            try:
                source = variant(kvc, dump, kind[0] if kind else None, tmp)
                run(kvc, "encode", *options, source, stream)
                run(kvc, "decode", *(["--profile", profile] if "--profile" in options else []), stream, out)
                want, dtypes = safetensors_kv_bytes(out)
                pb = profile.read_bytes() if "--profile" in options else None
                got = kvc_ref.output_bytes(kvc_ref.decode(stream.read_bytes(), pb))
            except (RuntimeError, kvc_ref.KvcError) as e:
                print("FAIL %s: %s" % (name, e))
                failed += 1
                continue
            same = got == want
            failed += not same
            print("%s %s: %d bytes, %s, %d stream bytes, sha256 %s%s" % (
                "ok  " if same else "FAIL", name, len(want), "/".join(sorted(dtypes)),
                stream.stat().st_size, hashlib.sha256(got).hexdigest()[:16],
                "" if same else " (kvc decode: %s)" % hashlib.sha256(want).hexdigest()[:16]))
    print("%d of %d cases: the reference decoder gives kvc decode's bytes" % (len(CASES) - failed, len(CASES)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
