#!/usr/bin/env python3
"""The reference decoder against codec-core on fuzz inputs.

The golden vectors pin a few dozen streams, valid and invalid; the fuzzers' inputs are
thousands of damaged ones. For every input of the given directories this asks codec-core (its
example `decode_outcomes`) and `kvc_ref` the same two questions, and requires the same answers:
does the profile parse (the spec's error class if not), and does the stream decode with it
(given when it parsed, as the fuzz targets give it), to which bytes (K then V of each layer,
compared by SHA-256) or with which error class. Limits are the spec's defaults on both sides.
A directory named `decode_stream` holds streams, one named `decode_profile` profiles; any
other (`decode_stream_profile`, `decode_chain`) holds a profile and a stream as those targets
read them. With `--flips N`, each input also gives N damaged copies (a bit of the stream, or
of a profile alone, flipped and its CRCs recomputed: `decode_outcomes` writes them). One line per difference, a summary, exit status 1 on any
difference.

    python3 spec/reference/against_rust.py [--flips N] target/release/examples/decode_outcomes \\
        fuzz/seeds/decode_stream fuzz/seeds/decode_stream_profile ...
"""

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

import kvc_ref

# What the files of a directory hold, by its name (the fuzz target's); any other name holds a
# profile and a stream.
MODES = {"decode_stream": "--stream", "decode_profile": "--profile"}


def reference(stream, profile):
    """The reference's answers, in the form `decode_outcomes` prints them."""
    profile_outcome, given = "-", None
    if profile is not None:
        try:
            kvc_ref.parse_profile(profile)
            profile_outcome, given = "ok", profile
        except kvc_ref.KvcError as e:
            profile_outcome = e.kind
    if stream is None:
        return profile_outcome, "-"
    try:
        out = kvc_ref.output_bytes(kvc_ref.decode(stream, given))
        return profile_outcome, "ok:" + hashlib.sha256(out).hexdigest()
    except kvc_ref.KvcError as e:
        return profile_outcome, e.kind


def compare(tool, directory, flips, tmp):
    """(inputs compared, differences) for one directory."""
    mode = MODES.get(directory.name, "--case")
    out = tmp / directory.parent.name / directory.name
    lines = subprocess.run([str(tool), mode, str(directory), str(out), str(flips)], check=True,
                           capture_output=True, text=True).stdout.splitlines()
    differences = []
    for line in lines:
        name, profile_outcome, stream_outcome = line.split("\t")
        stream, profile = out / (name + ".kvc"), out / (name + ".kvcp")
        ref = reference(stream.read_bytes() if stream.exists() else None,
                        profile.read_bytes() if profile.exists() else None)
        if ref != (profile_outcome, stream_outcome):
            differences.append("%s/%s: codec-core %s %s, reference %s %s"
                               % (directory, name, profile_outcome, stream_outcome, *ref))
    return len(lines), differences


def main(argv):
    flips = 0
    if argv[1:2] == ["--flips"] and len(argv) > 2 and argv[2].isdigit():
        flips, argv = int(argv[2]), argv[:1] + argv[3:]
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[-2].strip(), file=sys.stderr)
        return 2
    tool, dirs = Path(argv[1]).resolve(), [Path(d) for d in argv[2:]]
    total, differences = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for d in dirs:
            n, diff = compare(tool, d, flips, Path(tmp))
            print("%s: %d inputs, %d differences" % (d, n, len(diff)))
            total += n
            differences += diff
    for line in differences:
        print("DIFF", line)
    print("%d inputs, %d differences" % (total, len(differences)))
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
