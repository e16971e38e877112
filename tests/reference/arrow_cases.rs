//! Reference outputs for Arrow IPC batches (`testdata/arrow_cases`): each case holds the
//! workload (`batch.arrow`, `config.json`, made by `../shared/peer/make_workload.py`) and the
//! reference's output for it (`input.json`, `expected.json`, from `run_peer.py --dump`). We read
//! the Arrow file itself, through the zero-copy Arrow path, and must match bit for bit.

use crate::common;

use std::fs::File;
use std::path::Path;

use arrow_ipc::reader::FileReader;
use sparsecore_prep::{Config, Output, Preprocessor};

fn check_case(dir: &Path) -> Result<(), String> {
    let config = Config::from_path(dir.join("config.json")).map_err(|e| e.to_string())?;
    let input = common::load_json(&dir.join("input.json"));
    let expected = common::load_json(&dir.join("expected.json"));
    let file = File::open(dir.join("batch.arrow")).map_err(|e| e.to_string())?;
    let mut reader = FileReader::try_new(file, None).map_err(|e| e.to_string())?;
    let batch = reader
        .next()
        .ok_or("no record batch")?
        .map_err(|e| e.to_string())?;
    let mut prep = Preprocessor::builder(config)
        .threads(2)
        .build()
        .map_err(|e| e.to_string())?;
    let mut out = Output::new();
    let result = prep.run_record_batch(&batch, &mut out);
    if let Some(err) = expected.get("error") {
        return common::check_error(err, result);
    }
    result.map_err(|e| format!("preprocessing failed: {e}"))?;
    common::check_output(&input, &expected, prep.plan().ok_or("no plan")?, &out)
}

#[test]
fn arrow_reference_cases() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/arrow_cases");
    common::run_dir(&root, "arrow cases", check_case);
}
