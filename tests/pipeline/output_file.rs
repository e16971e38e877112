//! `io::OutputFile` and `fdo::write_atomic`: an output appears whole or not at all, a failed
//! write leaves no temporary, a symlink keeps pointing at the new file, a pipe is written in
//! place (never replaced by a regular file), and a directory is refused before anything is
//! written.

use std::io::Write;

use sparsecore_prep::fdo::write_atomic;
use sparsecore_prep::io::{tmp_path, OutputFile};
use sparsecore_prep::Error;
use sparsecore_testkit::TempDir;

fn names(dir: &TempDir) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn commit_renames_and_drop_removes_the_temporary() {
    let dir = TempDir::new("outfile-commit");
    let path = dir.join("out.bin");
    std::fs::write(&path, b"old").unwrap();
    let out = OutputFile::new(&path).unwrap();
    assert_eq!(out.path(), tmp_path(&path));
    out.create().unwrap().write_all(b"new").unwrap();
    // Until the commit, the old file is untouched.
    assert_eq!(std::fs::read(&path).unwrap(), b"old");
    out.commit().unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"new");
    assert_eq!(names(&dir), ["out.bin"]);

    // A write abandoned halfway (an error, a panic unwinding) leaves the old file and no
    // temporary.
    let out = OutputFile::new(&path).unwrap();
    out.create().unwrap().write_all(b"half").unwrap();
    assert!(out.path().exists());
    drop(out);
    assert_eq!(std::fs::read(&path).unwrap(), b"new");
    assert_eq!(names(&dir), ["out.bin"]);
}

#[test]
fn a_symlink_keeps_pointing_at_the_new_file() {
    let dir = TempDir::new("outfile-link");
    let (target, link) = (dir.join("target.json"), dir.join("link.json"));
    std::fs::write(&target, b"old").unwrap();
    std::os::unix::fs::symlink("target.json", &link).unwrap();
    write_atomic(&link, b"new").unwrap();
    assert!(
        std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink(),
        "the link was replaced by a file"
    );
    assert_eq!(std::fs::read(&target).unwrap(), b"new");
    assert_eq!(names(&dir), ["link.json", "target.json"]);
}

#[test]
fn a_directory_is_refused_before_anything_is_written() {
    let dir = TempDir::new("outfile-dir");
    let sub = dir.join("sub");
    std::fs::create_dir(&sub).unwrap();
    let err = OutputFile::new(&sub).unwrap_err();
    assert!(
        matches!(&err, Error::Io { context, source } if context.contains("sub") && source.kind() == std::io::ErrorKind::IsADirectory),
        "{err:?}"
    );
    assert!(write_atomic(&sub, b"x").is_err());
    assert_eq!(names(&dir), ["sub"]);
}

#[test]
fn a_pipe_is_written_in_place() {
    let dir = TempDir::new("outfile-fifo");
    let fifo = dir.join("fifo");
    let status = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo");
    assert!(status.success());
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read(fifo).unwrap())
    };
    write_atomic(&fifo, b"through the pipe").unwrap();
    assert_eq!(reader.join().unwrap(), b"through the pipe");
    // Still a pipe, and no temporary beside it.
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    assert_eq!(names(&dir), ["fifo"]);
}

#[test]
fn a_failed_write_leaves_no_temporary() {
    // /dev/full takes no bytes: writing in place fails, with a typed error, and nothing is
    // created (it is a device, written in place, never renamed over).
    let err = write_atomic(std::path::Path::new("/dev/full"), b"x").unwrap_err();
    assert!(
        matches!(&err, Error::Io { context, .. } if context.contains("/dev/full")),
        "{err:?}"
    );
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata("/dev/full")
        .unwrap()
        .file_type()
        .is_char_device());
    assert!(!tmp_path(std::path::Path::new("/dev/full")).exists());
}
