//! Two hosts of one job, each with its own preprocessor and TCP all-reduce on 127.0.0.1, agree
//! on minibatching: the host whose batch fits its limits still splits like the one whose batch
//! does not, under the sync keys of the same batch number.

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use sparsecore_prep::input::{RaggedInput, SampleSource};
use sparsecore_prep::{AllReduce, Config, Error, Output, Preprocessor, TcpAllReduce};

fn config() -> Config {
    Config::from_json(
        r#"{"config": {"local_device_count": 1, "global_device_count": 2, "num_sc_per_device": 4,
                        "enable_minibatching": true, "allow_id_dropping": true},
            "tables": [{"name": "t0", "vocabulary_size": 4096, "embedding_dim": 8, "combiner": "sum",
                        "max_ids_per_partition": 4, "max_unique_ids_per_partition": 4}],
            "features": [{"name": "f0", "table": "t0"}]}"#,
    )
    .unwrap()
}

/// 32 samples; `skewed` gives each sample 6 distinct ids of one partition (over the limits).
fn batch(skewed: bool) -> (Vec<i32>, Vec<i32>) {
    let mut values = Vec::new();
    let mut splits = vec![0];
    for r in 0..32 {
        if skewed {
            values.extend((0..6).map(|k| 8 * (6 * r + k)));
        } else {
            values.push(r);
        }
        splits.push(values.len() as i32);
    }
    (values, splits)
}

fn run_host(rank: usize, all_reduce: Arc<dyn AllReduce>, skewed: bool) -> Result<Output, Error> {
    let mut prep = Preprocessor::builder(config()).all_reduce(all_reduce).build()?;
    prep.set_batch_number(7);
    let (values, splits) = batch(skewed);
    let f0 = RaggedInput::from_i32("f0", &values, &splits)?;
    let mut out = Output::new();
    prep.run(&[&f0 as &dyn SampleSource], &mut out)?;
    let _ = rank;
    Ok(out)
}

#[test]
fn hosts_agree_on_one_split() {
    let listeners: Vec<TcpListener> = (0..2).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let hosts: Vec<Arc<dyn AllReduce>> = listeners
        .into_iter()
        .enumerate()
        .map(|(r, l)| Arc::new(TcpAllReduce::with_listener(r, l, addrs.clone(), Duration::from_secs(20)).unwrap()) as Arc<dyn AllReduce>)
        .collect();
    let outs: Vec<Output> = std::thread::scope(|s| {
        let handles: Vec<_> = hosts
            .iter()
            .enumerate()
            .map(|(r, h)| {
                let h = h.clone();
                s.spawn(move || run_host(r, h, r == 0).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(outs[0].num_minibatches > 1, "the skewed host needs minibatches");
    assert_eq!(outs[0].num_minibatches, outs[1].num_minibatches, "both hosts use the agreed split");

    // Alone, the balanced host would not split at all.
    let alone = {
        let cfg = {
            let mut c = config();
            c.config.global_device_count = 1;
            c
        };
        let mut prep = Preprocessor::new(cfg).unwrap();
        let (values, splits) = batch(false);
        let f0 = RaggedInput::from_i32("f0", &values, &splits).unwrap();
        prep.run_new(&[&f0 as &dyn SampleSource]).unwrap()
    };
    assert_eq!(alone.num_minibatches, 1);
}

#[test]
fn a_missing_host_is_an_error_not_a_hang() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let nobody = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap(); // closed at once
    let me = listener.local_addr().unwrap();
    let h: Arc<dyn AllReduce> =
        Arc::new(TcpAllReduce::with_listener(0, listener, vec![me, nobody], Duration::from_millis(500)).unwrap());
    let started = std::time::Instant::now();
    let e = run_host(0, h, true).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(matches!(e, Error::AllReduce { key: 14, .. }), "{e:?}"); // 2 * batch number 7
    assert!(e.to_string().contains(&nobody.to_string()), "{e}");
}
