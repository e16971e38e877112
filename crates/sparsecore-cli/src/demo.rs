//! `demo`: the bundled batch through the whole pipeline, with a summary table.

use std::io::Cursor;
use std::time::Instant;

use arrow_ipc::reader::FileReader;
use sparsecore_prep::input::{features_from_record_batch, SampleSource};
use sparsecore_prep::{Config, Error, Output, Preprocessor};

use super::error;
use super::stdio::outln;
use super::table;

const CONFIG: &str = include_str!("../../../testdata/demo/criteo_256.json");
const BATCH: &[u8] = include_bytes!("../../../testdata/demo/criteo_256.arrow");

pub fn run(threads: Option<usize>) -> error::Result<()> {
    let config = Config::from_json(CONFIG)?;
    let mut reader =
        FileReader::try_new(Cursor::new(BATCH), None).map_err(|source| Error::Arrow {
            context: "bundled demo batch".into(),
            source,
        })?;
    let batch = reader
        .next()
        .ok_or_else(|| Error::data("demo", "the bundled Arrow file has no record batch"))?
        .map_err(|source| Error::Arrow {
            context: "bundled demo batch".into(),
            source,
        })?;

    let mut builder = Preprocessor::builder(config);
    if let Some(t) = threads {
        builder = builder.threads(t);
    }
    let mut prep = builder.build()?;
    let mut out = Output::new();
    let features = features_from_record_batch(prep.config(), &batch)?;
    let inputs: Vec<&dyn SampleSource> = features.iter().map(|f| f as &dyn SampleSource).collect();
    let start = Instant::now();
    prep.run(&inputs, &mut out)?;
    let elapsed = start.elapsed();

    let plan = prep.plan().expect("a batch was planned");
    let ids = table::count_ids(plan, &inputs);
    let total: u64 = ids.iter().sum();
    outln!(
        "demo batch: {} samples, {} features, {} ids, layout L/G/S = {}/{}/{}, {} stacks, preprocessed in {:.2} ms",
        batch.num_rows(),
        plan.features.len(),
        total,
        plan.layout.local_devices,
        plan.layout.global_devices,
        plan.layout.sc_per_device,
        plan.stacks.len(),
        elapsed.as_secs_f64() * 1e3
    );
    let stats: Vec<_> = out.stacks.iter().map(|s| &s.stats).collect();
    table::print(
        &table::rows(plan, &stats, &ids, true),
        plan.layout.sc_per_device,
    );
    Ok(())
}
