//! `preprocess --out DIR`: the output directory, written all at once or not at all.
//!
//! A run writes every output into a staging directory and moves them into `DIR` only when the
//! whole run succeeded:
//!
//! - `DIR` does not exist: the staging directory is its sibling `DIR.tmp-<pid>`, renamed to
//!   `DIR` at the end.
//! - `DIR` exists and is empty: the staging directory is `DIR/.staging.tmp-<pid>`; its files are
//!   moved up one by one (nothing old can be lost, and `DIR` may be a mount point).
//! - `DIR` holds an earlier run's outputs: refused unless `--overwrite`. With it, the staging
//!   directory is the sibling `DIR.tmp-<pid>`; at the end `DIR` is renamed to `DIR.old-<pid>`,
//!   the staging directory to `DIR` (with the old directory's permissions), and the old one is
//!   removed, stale `<stack>.arrow` files with it. If the second rename fails, the first is
//!   undone. `DIR` is resolved through symlinks first, so a symlink keeps pointing at the
//!   outputs. `--overwrite` refuses a directory that holds anything a run does not write
//!   (`<stack>.arrow`, `stats.json`, temporary files of an interrupted run): that is not an
//!   earlier run's output directory, and renaming it away would take those files with it.
//!
//! On any error before the end, the staging directory is removed and `DIR` is as it was.
//!
//! A process killed outright (SIGKILL, power loss) removes nothing: its `DIR.tmp-<pid>`,
//! `DIR/.staging.tmp-<pid>`, `DIR.old-<pid>` and `<file>.tmp-<pid>` stay behind. Every later
//! run on the same `DIR` first removes those whose `<pid>` is not a running process (on Linux:
//! `/proc/<pid>` does not exist; where there is no `/proc`, nothing is removed), and leaves the
//! temporaries of live processes alone ([`clean_stale`]). One case is repaired rather than
//! removed: a run killed between its two renames leaves `DIR` missing and the earlier outputs
//! in `DIR.old-<pid>`; they are moved back to `DIR`.

use std::io;
use std::path::{Path, PathBuf};

use sparsecore_prep::io::tmp_path;
use sparsecore_prep::{Error, Result};

use super::error::{self, io_err, CliError};

/// How the staged outputs reach `--out`.
enum Mode {
    /// `--out` does not exist: rename the staging directory to it.
    Create,
    /// `--out` is an empty directory: move the staged files into it.
    Fill,
    /// `--out` holds these earlier outputs: swap the directories.
    Replace { old_files: Vec<String> },
}

/// A staging directory for `--out`, removed on drop unless committed.
pub struct Staged {
    /// `--out` as given (for messages).
    out: PathBuf,
    /// `--out` resolved (through symlinks, when it exists).
    target: PathBuf,
    /// Where the outputs are written until [`Staged::commit`].
    dir: PathBuf,
    mode: Mode,
    committed: bool,
    /// Temporaries of killed runs removed by [`Staged::prepare`].
    stale: Vec<PathBuf>,
}

/// What [`Staged::commit`] did.
pub struct Committed {
    /// Files of an earlier run that the new outputs replaced (same name).
    pub replaced: Vec<String>,
    /// Files of an earlier run that the new run did not write, removed.
    pub stale: Vec<String>,
}

/// Whether `name` in an output directory is something a `preprocess` run writes: a stack file,
/// the stats, or a temporary file of either.
fn is_output_name(name: &str) -> bool {
    let base = match name.find(".tmp-") {
        Some(i) => &name[..i],
        None => name,
    };
    base == "stats.json" || (base.ends_with(".arrow") && base.len() > ".arrow".len())
}

/// The first few names of a list, for a message: `a, b, c and 7 more`.
pub fn some_names(names: &[String], max: usize) -> String {
    let shown: Vec<&str> = names.iter().take(max).map(String::as_str).collect();
    match names.len().saturating_sub(max) {
        0 => shown.join(", "),
        more => format!("{} and {more} more", shown.join(", ")),
    }
}

/// Sorted entry names of a directory.
fn entries(dir: &Path) -> io::Result<Vec<(String, std::fs::FileType)>> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        v.push((e.file_name().to_string_lossy().into_owned(), e.file_type()?));
    }
    v.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(v)
}

/// The process id a temporary name ends with: `<base><marker><pid>` with `<pid>` all digits.
fn temp_pid(name: &str, base: &str, marker: &str) -> Option<u32> {
    let pid = name.strip_prefix(base)?.strip_prefix(marker)?;
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

/// Whether process `pid` is surely gone: on Linux, `/proc/<pid>` does not exist. Without a
/// readable `/proc` nothing is known, and every process counts as alive.
pub fn process_is_dead(pid: u32) -> bool {
    if pid == std::process::id() {
        return false;
    }
    let proc_root = Path::new("/proc");
    if !proc_root.join("self").exists() {
        return false;
    }
    matches!(std::fs::symlink_metadata(proc_root.join(pid.to_string())), Err(e) if e.kind() == io::ErrorKind::NotFound)
}

/// Removes one temporary (file or directory tree), counting what went.
fn remove_temp(path: &Path, removed: &mut Vec<PathBuf>) {
    let gone = match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) => Err(e),
    };
    match gone {
        Ok(()) => removed.push(path.to_path_buf()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => crate::stdio::warning!(
            "could not remove the stale temporary {}: {e}",
            path.display()
        ),
    }
}

/// Removes the temporaries that runs killed before they could clean up left beside `path`:
/// siblings `<name>.tmp-<pid>` (and, with `old`, `<name>.old-<pid>`) whose process is gone.
/// A dead run's `<name>.old-<pid>` while `path` itself is missing holds the earlier outputs
/// (the run died between its two renames): it is moved back to `path` instead. Returns what was
/// removed or restored; errors only warn (a stale temporary never fails a run).
pub fn clean_stale(path: &Path, old: bool) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let (Some(name), Some(parent)) = (path.file_name().and_then(|n| n.to_str()), path.parent())
    else {
        return removed;
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let Ok(entries) = std::fs::read_dir(parent) else {
        return removed;
    };
    let mut olds = Vec::new();
    for e in entries.flatten() {
        let entry = e.file_name();
        let Some(entry) = entry.to_str() else {
            continue;
        };
        if let Some(pid) = temp_pid(entry, name, ".tmp-") {
            if process_is_dead(pid) {
                remove_temp(&parent.join(entry), &mut removed);
            }
        } else if let Some(pid) = temp_pid(entry, name, ".old-").filter(|_| old) {
            if process_is_dead(pid) {
                olds.push(parent.join(entry));
            }
        }
    }
    olds.sort();
    for o in olds {
        if std::fs::symlink_metadata(path).is_err() && o.is_dir() {
            match std::fs::rename(&o, path) {
                Ok(()) => {
                    crate::stdio::warning!(
                        "{}: an earlier run was killed while replacing its outputs; moved them back from {}",
                        path.display(),
                        o.display()
                    );
                    removed.push(o);
                    continue;
                }
                Err(e) => crate::stdio::warning!(
                    "could not move {} back to {}: {e}",
                    o.display(),
                    path.display()
                ),
            }
        }
        remove_temp(&o, &mut removed);
    }
    removed
}

/// Removes dead runs' temporaries inside an output directory: `.staging.tmp-<pid>` and
/// `<output>.tmp-<pid>` files.
fn clean_stale_inside(dir: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return removed;
    };
    for e in entries.flatten() {
        let entry = e.file_name();
        let Some(entry) = entry.to_str() else {
            continue;
        };
        let Some(i) = entry.rfind(".tmp-") else {
            continue;
        };
        let base = &entry[..i];
        if base != ".staging" && !is_output_name(base) {
            continue;
        }
        if temp_pid(entry, base, ".tmp-").is_some_and(process_is_dead) {
            remove_temp(&dir.join(entry), &mut removed);
        }
    }
    removed
}

impl Staged {
    /// Checks `out` and creates the staging directory; fails before any work is done if `out`
    /// cannot take the outputs.
    pub fn prepare(out: &Path, overwrite: bool) -> error::Result<Staged> {
        let refuse = |reason: String| CliError::Argument {
            flag: "--out",
            value: out.display().to_string(),
            reason,
        };
        // Temporaries of killed runs go first: they must not make `out` look non-empty.
        let resolved = std::fs::canonicalize(out).unwrap_or_else(|_| out.to_path_buf());
        let mut stale = clean_stale(&resolved, true);
        if resolved.is_dir() {
            stale.extend(clean_stale_inside(&resolved));
        }
        let (target, mode) = match std::fs::metadata(out) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if let Some(parent) = out.parent() {
                    std::fs::create_dir_all(parent).map_err(io_err(format!(
                        "creating output directory {}",
                        out.display()
                    )))?;
                }
                (out.to_path_buf(), Mode::Create)
            }
            Err(source) => {
                return Err(Error::Io {
                    context: format!("output directory {}", out.display()),
                    source,
                }
                .into())
            }
            Ok(m) if !m.is_dir() => return Err(refuse("not a directory".into())),
            Ok(_) => {
                let target = std::fs::canonicalize(out)
                    .map_err(io_err(format!("output directory {}", out.display())))?;
                let found = entries(&target).map_err(io_err(format!(
                    "reading output directory {}",
                    out.display()
                )))?;
                let names: Vec<String> = found
                    .iter()
                    .map(|(n, t)| {
                        if t.is_dir() {
                            format!("{n}/")
                        } else {
                            n.clone()
                        }
                    })
                    .collect();
                if found.is_empty() {
                    (target, Mode::Fill)
                } else if !overwrite {
                    return Err(refuse(format!(
                        "the directory is not empty (it holds {}); pass --overwrite to replace the outputs of an earlier run, or choose another directory",
                        some_names(&names, 4)
                    )));
                } else {
                    let foreign: Vec<String> = found
                        .iter()
                        .zip(&names)
                        .filter(|((n, t), _)| !(t.is_file() && is_output_name(n)))
                        .map(|(_, shown)| shown.clone())
                        .collect();
                    if !foreign.is_empty() {
                        return Err(refuse(format!(
                            "--overwrite replaces the outputs of an earlier run (<stack>.arrow files and stats.json), but the directory also holds {}; move that away or choose another directory",
                            some_names(&foreign, 4)
                        )));
                    }
                    if target.parent().is_none() {
                        return Err(refuse("--overwrite cannot replace a root directory".into()));
                    }
                    (
                        target,
                        Mode::Replace {
                            old_files: found.into_iter().map(|(n, _)| n).collect(),
                        },
                    )
                }
            }
        };
        let dir = match mode {
            Mode::Fill => target.join(format!(".staging.tmp-{}", std::process::id())),
            Mode::Create | Mode::Replace { .. } => tmp_path(&target),
        };
        // A leftover of an earlier run with the same process id is ours to remove.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).map_err(io_err(format!(
            "output directory {}: creating the staging directory {}",
            out.display(),
            dir.display()
        )))?;
        Ok(Staged {
            out: out.to_path_buf(),
            target,
            dir,
            mode,
            committed: false,
            stale,
        })
    }

    /// Temporaries of killed runs that [`Staged::prepare`] removed (or restored).
    pub fn stale_removed(&self) -> &[PathBuf] {
        &self.stale
    }

    /// The directory to write the outputs into.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Moves the staged outputs into `--out`. On an error `--out` is as it was.
    pub fn commit(mut self) -> Result<Committed> {
        let new_files: Vec<String> = entries(&self.dir)
            .map_err(io_err(format!(
                "reading the staging directory {}",
                self.dir.display()
            )))?
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        let rename_err = |from: &Path, to: &Path| {
            let context = format!(
                "output directory {}: renaming {} to {}",
                self.out.display(),
                from.display(),
                to.display()
            );
            move |source| Error::Io { context, source }
        };
        let done = match &self.mode {
            Mode::Create => {
                std::fs::rename(&self.dir, &self.target)
                    .map_err(rename_err(&self.dir, &self.target))?;
                Committed {
                    replaced: Vec::new(),
                    stale: Vec::new(),
                }
            }
            Mode::Fill => {
                let mut moved: Vec<PathBuf> = Vec::new();
                for name in &new_files {
                    let (from, to) = (self.dir.join(name), self.target.join(name));
                    if let Err(e) = std::fs::rename(&from, &to) {
                        for p in &moved {
                            let _ = std::fs::remove_file(p);
                        }
                        return Err(rename_err(&from, &to)(e));
                    }
                    moved.push(to);
                }
                let _ = std::fs::remove_dir(&self.dir);
                Committed {
                    replaced: Vec::new(),
                    stale: Vec::new(),
                }
            }
            Mode::Replace { old_files } => {
                let permissions = std::fs::metadata(&self.target).map(|m| m.permissions());
                let old = self.target.with_file_name({
                    let mut n = self
                        .target
                        .file_name()
                        .expect("checked in prepare")
                        .to_os_string();
                    n.push(format!(".old-{}", std::process::id()));
                    n
                });
                let _ = std::fs::remove_dir_all(&old);
                std::fs::rename(&self.target, &old).map_err(rename_err(&self.target, &old))?;
                if let Err(e) = std::fs::rename(&self.dir, &self.target) {
                    let err = rename_err(&self.dir, &self.target)(e);
                    return Err(match std::fs::rename(&old, &self.target) {
                        Ok(()) => err,
                        Err(back) => err.context(format!(
                            "the earlier outputs are in {} (moving them back failed: {back})",
                            old.display()
                        )),
                    });
                }
                if let Ok(p) = permissions {
                    let _ = std::fs::set_permissions(&self.target, p);
                }
                if let Err(e) = std::fs::remove_dir_all(&old) {
                    crate::stdio::warning!(
                        "could not remove the earlier outputs, now in {}: {e}",
                        old.display()
                    );
                }
                let (replaced, stale) = old_files
                    .iter()
                    .cloned()
                    .partition(|n| new_files.contains(n));
                Committed { replaced, stale }
            }
        };
        self.committed = true;
        Ok(done)
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Whether two output paths name the same file: the same path once `.`, `..` and symlinks
/// (of the file itself or of its directories) are resolved, or the same existing file (a hard
/// link).
pub fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    if let (Ok(ma), Ok(mb)) = (std::fs::metadata(a), std::fs::metadata(b)) {
        use std::os::unix::fs::MetadataExt;
        if (ma.dev(), ma.ino()) == (mb.dev(), mb.ino()) {
            return true;
        }
    }
    resolved(a) == resolved(b)
}

/// `p` absolute, with symlinks resolved as far as the file system has them: a file that does
/// not exist yet is its resolved directory joined with its name, and a dangling symlink is
/// followed (a few levels) to where it points.
pub fn resolved(p: &Path) -> PathBuf {
    let mut p = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    for _ in 0..8 {
        if let Ok(c) = std::fs::canonicalize(&p) {
            return c;
        }
        match std::fs::read_link(&p) {
            Ok(target) => p = p.parent().map_or(target.clone(), |dir| dir.join(&target)),
            Err(_) => break,
        }
    }
    match (p.parent().map(std::fs::canonicalize), p.file_name()) {
        (Some(Ok(dir)), Some(name)) => dir.join(name),
        _ => p,
    }
}

/// Writes a config JSON atomically.
pub fn write_config(path: &Path, config: &sparsecore_prep::Config) -> Result<()> {
    clean_stale(path, false);
    sparsecore_prep::fdo::write_atomic(path, config.to_json().as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_names() {
        for n in [
            "stats.json",
            "t00.arrow",
            "a b.arrow",
            "t00.arrow.tmp-123",
            "stats.json.tmp-9",
        ] {
            assert!(is_output_name(n), "{n}");
        }
        for n in [
            ".arrow",
            "notes.txt",
            "stats.json.bak",
            "data.parquet",
            "x.arrows",
        ] {
            assert!(!is_output_name(n), "{n}");
        }
    }

    #[test]
    fn temp_pids() {
        assert_eq!(temp_pid("out.tmp-123", "out", ".tmp-"), Some(123));
        assert_eq!(temp_pid("out.old-7", "out", ".old-"), Some(7));
        for n in [
            "out.tmp-",
            "out.tmp-12a",
            "outx.tmp-1",
            "out.tmp-+1",
            "out.tmp-99999999999",
        ] {
            assert_eq!(temp_pid(n, "out", ".tmp-"), None, "{n}");
        }
        assert!(!process_is_dead(std::process::id()));
        if Path::new("/proc/self").exists() {
            assert!(!process_is_dead(1));
        }
    }

    #[test]
    fn name_lists() {
        let names: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        assert_eq!(some_names(&names, 4), "a, b, c");
        assert_eq!(some_names(&names, 2), "a, b and 1 more");
    }
}
