//! The `sparsecore-prep` command-line tool.

mod cli;

fn main() {
    std::process::exit(cli::main());
}
