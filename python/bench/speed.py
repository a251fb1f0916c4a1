"""Python's side of the bindings' speed comparison: best-of-N decode into preallocated numpy
arrays and encode of a KV dump, against the Rust example `capi/examples/speed.rs`, which this
script runs on the same stream.

    cargo build --profile bench -p kvc-capi --example speed   # the Rust side, run by the script
    python python/bench/speed.py [DUMP.safetensors] [N]

The dump defaults to ../shared/fixtures/smollm2-gpl3-2048.safetensors, else the 512-token
testdata sample; the profile is learned from the dump; level 7, referenced profile.
"""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import kvc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python" / "tests"))
from conftest import Dump  # noqa: E402


def best(n, f):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    candidates = [ROOT.parent / "shared" / "fixtures" / "smollm2-gpl3-2048.safetensors", ROOT / "testdata" / "smollm2-gpl3-512.safetensors"]
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else next(p for p in candidates if p.exists())
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    d = Dump(path)
    rope = {k: v for k, v in d.encode_kwargs().items() if k.startswith(("rope", "k_pre", "first"))}
    profile = kvc.Profile.learn([kvc.Sample(d.keys, d.values, d.queries, d.q_start)], **rope)
    data = kvc.encode(d.keys, d.values, profile=profile, level=7, **d.encode_kwargs())
    out_dir = ROOT / "target" / "speed"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "stream.kvc").write_bytes(data)
    (out_dir / "profile.kvcp").write_bytes(profile.save())

    s = kvc.Stream(data, profile)
    k, v = s.decode()
    mib = (k.nbytes + v.nbytes) / 2**20
    print(f"{path.name}: {s.layers} layers x {s.tokens} tokens x {s.kv_heads} x {s.head_dim} {s.dtype}, {mib:.1f} MiB, stream {len(data)} bytes")
    kp, vp = np.empty_like(k), np.empty_like(v)
    t_stream = best(n, lambda: s.decode(out=(kp, vp)))
    t_func = best(n, lambda: kvc.decode(data, profile=profile, out=(kp, vp)))
    t_new = best(n, lambda: s.decode())
    klist, vlist = list(k), list(v)
    meta = d.encode_kwargs()
    reencoded = kvc.encode(klist, vlist, profile=profile, level=7, **meta)
    (out_dir / "stream.kvc.reencoded").write_bytes(reencoded)
    t_enc = best(min(n, 7), lambda: kvc.encode(klist, vlist, profile=profile, level=7, **meta))
    print(f"python Stream.decode(out=...):    {t_stream * 1e3:7.2f} ms  {mib / t_stream:6.1f} MiB/s")
    print(f"python kvc.decode(out=...):       {t_func * 1e3:7.2f} ms  {mib / t_func:6.1f} MiB/s")
    print(f"python Stream.decode() (new):     {t_new * 1e3:7.2f} ms  {mib / t_new:6.1f} MiB/s")
    print(f"python kvc.encode (referenced):   {t_enc * 1e3:7.2f} ms  {mib / t_enc:6.1f} MiB/s")
    # Self-contained, in 8 chunks, decoded whole and chunk by chunk (the profile it embeds is
    # parsed once, when the Stream opens).
    sc = kvc.Stream(kvc.encode(d.keys, d.values, level=7, chunk_tokens=s.tokens // 8, **meta))
    outs = [tuple(np.empty((s.layers, n) + k.shape[2:], k.dtype) for _ in range(2)) for _, n, _, _ in sc.chunks]
    t_sc = best(n, lambda: sc.decode(out=(kp, vp)))
    t_chunks = best(n, lambda: [sc.decode(chunk=i, out=o) for i, o in enumerate(outs)])
    print(f"python self-contained, whole:     {t_sc * 1e3:7.2f} ms  {mib / t_sc:6.1f} MiB/s")
    print(f"python self-contained, 8 chunks:  {t_chunks * 1e3:7.2f} ms  {mib / t_chunks:6.1f} MiB/s")
    exe = ROOT / "target" / "release" / "examples" / "speed"
    if exe.exists():
        subprocess.run([str(exe), str(out_dir / "stream.kvc"), str(out_dir / "profile.kvcp"), str(n)], check=True)


if __name__ == "__main__":
    main()
