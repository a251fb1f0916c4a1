//! Output files: refusals (an existing file without permission, an input by path, hard link or
//! symbolic link), replacement when allowed, and no temporary file left behind.

use std::fs;
use std::path::Path;

use kvc_io::{Output, OutputError};

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn existing_output_is_kept_unless_replacing() {
    let dir = tempfile::tempdir().unwrap();
    let (input, out) = (dir.path().join("in"), dir.path().join("out"));
    fs::write(&input, b"input").unwrap();
    fs::write(&out, b"old").unwrap();
    let e = Output::checked(&out, &[&input], false).unwrap_err();
    assert!(
        matches!(&e, OutputError::Exists { path } if path == &out),
        "{e}"
    );
    assert!(e.to_string().contains("--force"), "{e}");
    assert_eq!(fs::read(&out).unwrap(), b"old");

    Output::checked(&out, &[&input], true)
        .unwrap()
        .write(b"new")
        .unwrap();
    assert_eq!(fs::read(&out).unwrap(), b"new");
    assert_eq!(names(dir.path()), ["in", "out"]);
}

#[test]
fn output_appearing_after_the_check_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = Output::checked(&out, &[], false).unwrap();
    fs::write(&out, b"someone else's").unwrap();
    assert!(matches!(o.write(b"mine"), Err(OutputError::Exists { .. })));
    assert_eq!(fs::read(&out).unwrap(), b"someone else's");
    assert_eq!(names(dir.path()), ["out"]);
}

#[test]
fn input_is_refused_by_path_and_links_even_when_replacing() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in");
    fs::write(&input, b"input").unwrap();
    let mut same = vec![input.clone(), dir.path().join(".").join("in")];
    let hard = dir.path().join("hard");
    fs::hard_link(&input, &hard).unwrap();
    same.push(hard);
    #[cfg(unix)]
    {
        let sym = dir.path().join("sym");
        std::os::unix::fs::symlink(&input, &sym).unwrap();
        same.push(sym);
    }
    for out in &same {
        for replace in [false, true] {
            let e = Output::checked(out, &[&input], replace).unwrap_err();
            assert!(matches!(e, OutputError::SameAsInput { .. }), "{out:?}: {e}");
            assert!(e.to_string().contains("another output"), "{e}");
        }
    }
    // The other way round: the input named through a link, the output by its path.
    let e = Output::checked(&input, &[&same[2]], true).unwrap_err();
    assert!(matches!(e, OutputError::SameAsInput { .. }), "{e}");
    assert_eq!(fs::read(&input).unwrap(), b"input");
}

#[test]
fn failed_writes_leave_no_temporary() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("d");
    fs::create_dir(&sub).unwrap();
    let e = Output::checked(&sub, &[], true).unwrap_err();
    assert!(matches!(e, OutputError::IsDirectory { .. }), "{e}");
    let missing = dir.path().join("no/such/out");
    let e = Output::replacing(&missing).write(b"x").unwrap_err();
    assert!(matches!(e, OutputError::Io { .. }), "{e}");
    assert_eq!(names(dir.path()), ["d"]);
}
