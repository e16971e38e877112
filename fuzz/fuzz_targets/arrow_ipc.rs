//! Arbitrary bytes as an input file: `io::BatchReader` (Arrow IPC file or stream, or Parquet,
//! by magic bytes) → `features_from_record_batch` → `Preprocessor::run` under three small
//! fixed configs (feature stacking with drops, auto stacking, minibatching). Every step must be
//! `Ok` or a typed `Err`, and a batch must give the same bytes on one and two threads and
//! (without minibatching) equal the oracle model's result.
//!
//! The configs read columns `a` (ids), `b` (ids) with `wb` (weights) and `c` (ids): the seeds
//! in `fuzz/corpus/arrow_ipc` have them.

#![no_main]

use fuzz_common::{
    check_oracle, kind_of, let_decoder_panics_unwind, run_deterministic, verbose, write_scratch,
};
use libfuzzer_sys::fuzz_target;
use sparsecore_prep::input::{features_from_record_batch, SampleSource};
use sparsecore_prep::io::BatchReader;
use sparsecore_prep::Config;

/// Feature stacking, dropping on, weights on `b`: L/G/S = 1/2/2.
const FEATURE_STACKED: &str = r#"{
  "config": {"local_device_count": 1, "global_device_count": 2, "num_sc_per_device": 2, "allow_id_dropping": true},
  "tables": [
    {"name": "t0", "vocabulary_size": 64, "embedding_dim": 8, "combiner": "sum", "max_ids_per_partition": 8, "max_unique_ids_per_partition": 6},
    {"name": "t1", "vocabulary_size": 1000, "embedding_dim": 16, "combiner": "sqrtn", "max_ids_per_partition": 16, "max_unique_ids_per_partition": 16, "suggested_coo_buffer_size_per_device": 64}
  ],
  "features": [
    {"name": "a", "table": "t0"},
    {"name": "b", "table": "t0", "weights_column": "wb"},
    {"name": "c", "table": "t1"}
  ]
}"#;

/// Auto stacking, no dropping (limits are errors), mean combiner: L/G/S = 2/2/1.
const AUTO_STACKED: &str = r#"{
  "config": {"local_device_count": 2, "global_device_count": 2, "num_sc_per_device": 1, "stacking": "auto",
             "stack_limits": {"max_ids_per_partition": 8, "max_unique_ids_per_partition": 8}},
  "tables": [
    {"name": "t0", "vocabulary_size": 64, "embedding_dim": 8, "combiner": "mean", "max_ids_per_partition": 4, "max_unique_ids_per_partition": 4},
    {"name": "t1", "vocabulary_size": 1000, "embedding_dim": 8, "combiner": "mean", "max_ids_per_partition": 8, "max_unique_ids_per_partition": 8}
  ],
  "features": [
    {"name": "a", "table": "t0"},
    {"name": "b", "table": "t1", "weights_column": "wb"},
    {"name": "c", "table": "t1"}
  ]
}"#;

/// Minibatching on one host (L/G/S = 1/1/4), small limits so that batches split.
const MINIBATCHED: &str = r#"{
  "config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4, "enable_minibatching": true},
  "tables": [
    {"name": "t0", "vocabulary_size": 64, "embedding_dim": 8, "combiner": "sum", "max_ids_per_partition": 2, "max_unique_ids_per_partition": 2},
    {"name": "t1", "vocabulary_size": 1000, "embedding_dim": 8, "combiner": "sqrtn", "max_ids_per_partition": 2, "max_unique_ids_per_partition": 2}
  ],
  "features": [
    {"name": "a", "table": "t0"},
    {"name": "b", "table": "t1", "weights_column": "wb"},
    {"name": "c", "table": "t1"}
  ]
}"#;

/// Record batches read per input: a fuzzer-made stream can declare many.
const MAX_BATCHES: usize = 4;

fuzz_target!(init: let_decoder_panics_unwind(), |data: &[u8]| {
    let configs = [FEATURE_STACKED, AUTO_STACKED, MINIBATCHED].map(|c| Config::from_json(c).expect("fixed config"));
    let scratch = write_scratch("input", data);
    let reader = match BatchReader::open(scratch.path()) {
        Ok(r) => r,
        Err(e) => return note("open", &e),
    };
    let _ = reader.schema();
    for (i, batch) in reader.take(MAX_BATCHES).enumerate() {
        let batch = match batch {
            Ok(b) => b,
            Err(e) => return note("batch", &e),
        };
        for config in &configs {
            let features = match features_from_record_batch(config, &batch) {
                Ok(f) => f,
                Err(e) => {
                    note("columns", &e);
                    continue;
                }
            };
            let inputs: Vec<&dyn SampleSource> = features.iter().map(|f| f as &dyn SampleSource).collect();
            let ours = run_deterministic(config, |b| b, i as u64, &inputs);
            check_oracle(config, &inputs, i as u64, ours.as_ref());
        }
    }
});

/// Reports where an input stopped, under `SPARSECORE_FUZZ_VERBOSE=1`.
fn note(stage: &str, e: &sparsecore_prep::Error) {
    if verbose() {
        eprintln!("fuzz outcome: {stage} Err {}", kind_of(e.root()));
    }
}
