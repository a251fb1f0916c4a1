//! Multi-level stores: any mix of levels assembles into the stream a direct encode gives, and a
//! store whose files disagree is refused with the file named.

use std::fs;
use std::path::Path;

use codec_core::{EncodeParams, Limits, ProfileMode};
use kvc_io::store::Store;
use kvc_io::{load_dump, Dump, Error};

fn setup(dir: &Path) -> (Dump, codec_core::Profile, EncodeParams) {
    let mut dump = load_dump(&kvc_io::fixtures::sample()).unwrap();
    dump.tokens = Some((0..512).map(|i| 1000 + i).collect());
    let profile = kvc_io::policy::learn(&[&dump], &mut kvc_io::Silent).unwrap();
    let params = EncodeParams {
        chunk_tokens: 200,
        ..EncodeParams::default()
    };
    Store::write(dir, &dump, &profile, &params, &[9, 1, 4], false, 0).unwrap();
    (dump, profile, params)
}

#[test]
fn any_mix_of_levels_is_the_stream_encode_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ctx");
    let (dump, profile, params) = setup(&dir);
    let s = Store::open(&dir).unwrap();
    assert_eq!((s.levels(), s.chunks()), (&[1, 4, 9][..], 3));
    assert_eq!(s.chunk_range(2), Some(400..512));
    assert_eq!(
        s.chunk_token_ids(1).map(|t| (t[0], t.len())),
        Some((1200, 200))
    );
    for mix in [[1u8, 4, 9], [9, 9, 1], [4, 1, 4]] {
        let direct = codec_core::encode(
            &dump.kv.view(),
            ProfileMode::Referenced(&profile),
            &EncodeParams {
                levels: mix.to_vec(),
                ..params.clone()
            },
        )
        .unwrap();
        assert_eq!(s.assemble(&mix).unwrap(), direct, "{mix:?}");
    }
    // Coarser levels are smaller, chunk by chunk.
    for i in 0..3 {
        let b: Vec<usize> = [1, 4, 9]
            .iter()
            .map(|&l| s.chunk_bytes(i, l).unwrap())
            .collect();
        assert!(b[0] > b[1] && b[1] > b[2], "chunk {i}: {b:?}");
    }
    let bad = |r: Result<Vec<u8>, Error>| r.unwrap_err().to_string();
    assert!(bad(s.assemble(&[1, 4])).contains("2 levels for 3 chunks"));
    assert!(bad(s.assemble(&[1, 7, 9])).contains("no level 7"));
    // The streams decode alone too, with the store's profile.
    let l9 = fs::read(dir.join("level-09.kvc")).unwrap();
    assert!(codec_core::decode(&l9, Some(s.profile()), &Limits::DEFAULT).is_ok());
}

#[test]
fn an_existing_store_is_kept_unless_replacing_and_stale_levels_go() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ctx");
    let (dump, profile, params) = setup(&dir);
    let e = Store::write(&dir, &dump, &profile, &params, &[7], false, 0).unwrap_err();
    assert!(e.to_string().contains("already exists"), "{e}");
    Store::write(&dir, &dump, &profile, &params, &[7], true, 0).unwrap();
    assert!(
        !dir.join("level-09.kvc").exists(),
        "levels no longer kept are removed"
    );
    assert_eq!(Store::open(&dir).unwrap().levels(), &[7]);
    let e = Store::write(&dir, &dump, &profile, &params, &[200], true, 0).unwrap_err();
    assert!(e.to_string().contains("level 200"), "{e}");
}

#[test]
fn a_store_that_cannot_be_written_is_refused_before_any_file() {
    let tmp = tempfile::tempdir().unwrap();
    let mut dump = load_dump(&kvc_io::fixtures::sample()).unwrap();
    let profile = kvc_io::policy::learn(&[&dump], &mut kvc_io::Silent).unwrap();
    let params = EncodeParams::default();
    let top = profile.levels() - 1;
    let write = |dump: &Dump, levels: &[u8], name: &str| {
        let dir = tmp.path().join(name);
        let e = Store::write(&dir, dump, &profile, &params, levels, false, 0).unwrap_err();
        assert!(!dir.exists(), "{name}: nothing written");
        e.to_string()
    };
    assert!(write(&dump, &[], "none").contains("no level to keep"));
    let e = write(&dump, &[1, top + 1], "past");
    let expected = format!("level {}: the profile has levels 0..={top}", top + 1);
    assert!(e.contains(&expected), "{e}");
    dump.tokens = Some(vec![7; 511]);
    let e = write(&dump, &[1], "ids");
    assert!(e.contains("511 token ids for 512 tokens"), "{e}");
}

#[test]
fn inconsistent_stores_are_refused_by_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ctx");
    let (dump, profile, params) = setup(&dir);
    let fails = |says: &str| {
        let e = Store::open(&dir).unwrap_err().to_string();
        assert!(e.contains(says), "{e} (expected {says:?})");
    };
    let keep = |name: &str| fs::read(dir.join(name)).unwrap();
    let put = |name: &str, b: &[u8]| fs::write(dir.join(name), b).unwrap();
    // A level file holding another level's stream.
    let (l1, l4) = (keep("level-01.kvc"), keep("level-04.kvc"));
    put("level-04.kvc", &l1);
    fails("level-04.kvc: the chunk at token 0 is at level 1");
    put("level-04.kvc", &l4);
    // A stream of another chunking.
    let other = codec_core::encode(
        &dump.kv.view(),
        ProfileMode::Referenced(&profile),
        &EncodeParams {
            chunk_tokens: 256,
            levels: vec![4],
            ..params.clone()
        },
    )
    .unwrap();
    put("level-04.kvc", &other);
    fails("level-04.kvc");
    put("level-04.kvc", &l4);
    // A corrupted stream header.
    let mut c = l4.clone();
    c[20] ^= 1;
    put("level-04.kvc", &c);
    fails("level-04.kvc");
    put("level-04.kvc", &l4);
    // Token ids of the wrong length; a missing profile; a garbled manifest.
    let t = keep("tokens.bin");
    put("tokens.bin", &t[..100]);
    fails("tokens.bin holds 100 bytes");
    put("tokens.bin", &t);
    let p = keep("profile.kvcp");
    fs::remove_file(dir.join("profile.kvcp")).unwrap();
    fails("cannot read profile.kvcp");
    put("profile.kvcp", &p);
    let m = keep("store.json");
    put("store.json", b"{\"format\": \"kvc-store/9\"}");
    fails("format \"kvc-store/9\"");
    put(
        "store.json",
        &String::from_utf8(m.clone())
            .unwrap()
            .replace("\"4\"", "\"5\"")
            .into_bytes(),
    );
    fails("no size at level 4");
    put("store.json", &m);
    assert!(Store::open(&dir).is_ok());
}

/// A store's files are read only if they are regular files within their limits: a level
/// stream far over its limit (sparse, never read), a manifest that is a device or a FIFO, token
/// ids longer than the tokens, a manifest level out of range; each refused by name.
#[test]
fn store_files_are_read_within_their_limits() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ctx");
    setup(&dir);
    let fails = |says: &str| {
        let e = Store::open(&dir).unwrap_err().to_string();
        assert!(e.contains(says), "{e} (expected {says:?})");
    };
    let keep = |name: &str| fs::read(dir.join(name)).unwrap();
    let l4 = keep("level-04.kvc");
    let huge = fs::File::create(dir.join("level-04.kvc")).unwrap();
    huge.set_len(kvc_io::store::MAX_LEVEL_BYTES + 1).unwrap();
    drop(huge);
    fails(&format!(
        "cannot read level-04.kvc: over {} bytes",
        kvc_io::store::MAX_LEVEL_BYTES
    ));
    fs::write(dir.join("level-04.kvc"), &l4).unwrap();
    let t = keep("tokens.bin");
    fs::write(dir.join("tokens.bin"), [&t[..], &[0; 4]].concat()).unwrap();
    fails(&format!("cannot read tokens.bin: over {} bytes", t.len()));
    fs::write(dir.join("tokens.bin"), &t).unwrap();
    let m = keep("store.json");
    let text = String::from_utf8(m.clone()).unwrap();
    let levels = text.find("\"levels\"").unwrap();
    let list_end = levels + text[levels..].find(']').unwrap();
    let mut bad = text.clone();
    bad.insert_str(list_end, ", 300");
    fs::write(dir.join("store.json"), &bad).unwrap();
    fails("\"levels\" is not an ascending list of levels 0..=255");
    #[cfg(unix)]
    {
        fs::remove_file(dir.join("store.json")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.join("store.json")).unwrap();
        fails("cannot read store.json: not a regular file");
        fs::remove_file(dir.join("store.json")).unwrap();
        let fifo = std::process::Command::new("mkfifo")
            .arg(dir.join("store.json"))
            .status()
            .unwrap();
        assert!(fifo.success());
        fails("cannot read store.json: not a regular file");
        fs::remove_file(dir.join("store.json")).unwrap();
    }
    fs::write(dir.join("store.json"), &m).unwrap();
    assert!(Store::open(&dir).is_ok());
}

/// A profile file over the decoder's profile limit is refused before it is read.
#[test]
fn a_profile_file_over_the_limit_is_not_read() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("huge.kvcp");
    let f = fs::File::create(&path).unwrap();
    f.set_len(Limits::DEFAULT.max_profile_bytes + 1).unwrap();
    drop(f);
    let e = kvc_io::policy::load_profile(&path).unwrap_err();
    assert!(matches!(e, Error::Read { .. }), "{e}");
    assert!(e.to_string().contains("over 268435456 bytes"), "{e}");
}
