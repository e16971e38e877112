//! Writing to stdout and stderr without panicking.
//!
//! `println!` panics when stdout is a pipe whose reader has gone (`sparsecore-prep ... | head`):
//! Rust ignores SIGPIPE, so the write fails with `BrokenPipe` and `println!` turns that into a
//! panic and exit status 101. Every line the tool prints on stdout goes through [`outln!`]
//! instead: a closed stdout ends the process quietly with status 141 (128 + SIGPIPE, what a
//! shell reports for `yes | head`); any other write error (a full disk behind a redirection) is
//! one error line on stderr and status 1. Lines on stderr ([`warning!`], errors) never end the
//! process: a closed stderr only loses them.

use std::fmt;
use std::io::{self, Write};

/// The exit status after stdout was closed by its reader: 128 + SIGPIPE (13).
pub const BROKEN_PIPE_EXIT: i32 = 141;

/// Writes to stdout; a failed write ends the process (see the module docs).
pub fn write_stdout(args: fmt::Arguments<'_>) {
    let mut out = io::stdout().lock();
    if let Err(e) = out.write_fmt(args) {
        stdout_failed(e);
    }
}

/// Flushes stdout; a failed flush ends the process like a failed write.
pub fn flush_stdout() {
    if let Err(e) = io::stdout().lock().flush() {
        stdout_failed(e);
    }
}

fn stdout_failed(e: io::Error) -> ! {
    if e.kind() == io::ErrorKind::BrokenPipe {
        std::process::exit(BROKEN_PIPE_EXIT);
    }
    write_stderr(format_args!(
        "sparsecore-prep: error: writing to stdout: {e}\n"
    ));
    std::process::exit(1);
}

/// Writes to stderr, ignoring errors (there is nowhere left to report them).
pub fn write_stderr(args: fmt::Arguments<'_>) {
    let _ = io::stderr().lock().write_fmt(args);
}

/// `println!` on stdout that ends the process quietly when stdout is closed.
macro_rules! outln {
    () => {
        $crate::stdio::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::stdio::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// One `sparsecore-prep: warning: ...` line on stderr.
macro_rules! warning {
    ($($arg:tt)*) => {
        $crate::stdio::write_stderr(format_args!("sparsecore-prep: warning: {}\n", format_args!($($arg)*)))
    };
}

pub(crate) use {outln, warning};
