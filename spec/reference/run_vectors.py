#!/usr/bin/env python3
"""Run the kvc test vectors with the independent reference decoder (kvc_ref.py).

Usage: python3 spec/reference/run_vectors.py [VECTORS_DIR] [--impl numpy|python|both] [-v]

Reads VECTORS_DIR/manifest.json (default: spec/vectors next to this folder). For every valid
vector it decodes the stream (with the named profile and limits) and checks dtype, shape, and that
output_bytes() equals the output file byte for byte and has the stated SHA-256. For every invalid
vector it checks that decoding raises KvcError of the expected kind. Prints one line per vector
and a summary; exits 1 on any mismatch.
"""

import argparse
import hashlib
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvc_ref  # noqa: E402


def _read(folder, name):
    if name is None:
        return None
    with open(os.path.join(folder, name), "rb") as f:
        return f.read()


def _kind_matches(expected, err):
    # The manifest names the error kind ("Table"); also accept the spec's full form
    # ("Table(BadSum)", "InvalidField(flags)").
    exp = expected.replace('"', "")
    return exp in (err.kind, err.full)


def run_valid(folder, v, impl):
    sb = _read(folder, v["stream"])
    pb = _read(folder, v.get("profile"))
    t0 = time.time()
    try:
        d = kvc_ref.decode(sb, pb, limits=v.get("limits"), impl=impl)
    except kvc_ref.KvcError as err:
        return False, "rejected: %s" % err, time.time() - t0
    dt = time.time() - t0
    problems = []
    for key, got in (("dtype", d.dtype), ("layers", d.layers), ("kv_heads", d.kv_heads),
                     ("head_dim", d.head_dim), ("tokens", d.tokens)):
        if key in v and v[key] != got:
            problems.append("%s %r != %r" % (key, got, v[key]))
    ob = kvc_ref.output_bytes(d)
    sha = hashlib.sha256(ob).hexdigest()
    expected = _read(folder, v["output"])
    if "output_sha256" in v and sha != v["output_sha256"].lower():
        problems.append("output sha256 %s != %s" % (sha[:16], v["output_sha256"][:16]))
    if ob != expected:
        if len(ob) != len(expected):
            problems.append("output length %d != %d" % (len(ob), len(expected)))
        else:
            diff = next(i for i in range(len(ob)) if ob[i] != expected[i])
            problems.append("output differs from byte %d" % diff)
    if problems:
        return False, "; ".join(problems), dt
    return True, "ok (%d bytes, sha256 %s)" % (len(ob), sha[:16]), dt


def run_invalid(folder, v, impl):
    sb = _read(folder, v["stream"])
    pb = _read(folder, v.get("profile"))
    t0 = time.time()
    try:
        kvc_ref.decode(sb, pb, limits=v.get("limits"), impl=impl)
    except kvc_ref.KvcError as err:
        dt = time.time() - t0
        if _kind_matches(v["error"], err):
            return True, "rejected: %s" % err, dt
        return False, "wrong error: %s (expected %s)" % (err, v["error"]), dt
    return False, "accepted (expected %s)" % v["error"], time.time() - t0


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", nargs="?", default=os.path.join(os.path.dirname(here), "vectors"))
    ap.add_argument("--impl", default="numpy", choices=("numpy", "python", "both"))
    a = ap.parse_args(argv)
    with open(os.path.join(a.folder, "manifest.json")) as f:
        manifest = json.load(f)
    impls = ["numpy", "python"] if a.impl == "both" else [a.impl]
    counts = {"valid": [0, 0], "invalid": [0, 0]}
    failed = []
    for impl in impls:
        for section, fn in (("valid", run_valid), ("invalid", run_invalid)):
            for v in manifest.get(section, []):
                try:
                    ok, msg, dt = fn(a.folder, v, impl)
                except Exception:  # a crash in the decoder is a failure, not an abort
                    ok, msg, dt = False, "CRASH: " + traceback.format_exc().strip().splitlines()[-1], 0.0
                counts[section][1] += 1
                counts[section][0] += ok
                tag = "PASS" if ok else "FAIL"
                label = "%s %s" % (section, v["name"])
                if len(impls) > 1:
                    label = "[%s] %s" % (impl, label)
                print("%s  %-48s %6.2fs  %s" % (tag, label, dt, msg))
                if not ok:
                    failed.append(label)
    print()
    print("valid:   %d / %d decoded to the expected bytes" % tuple(counts["valid"]))
    print("invalid: %d / %d rejected with the expected error kind" % tuple(counts["invalid"]))
    if failed:
        print("FAILED: %s" % ", ".join(failed))
        return 1
    print("all vectors pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
