use std::time::Instant;
use sparsecore_bess::*;
fn main() {
    let t = synth::uniform(20000, 50, 400000, 1);
    let n = 64; let ppp = 4;
    let mut s = BessStream::builder().triples(t.clone()).n_entity(20000).devices(16,16,4).shard_batch_size(256).negatives(ppp).seed(7).steps(50).build().unwrap();
    for k in 0..5 { let _ = s.draw(k).unwrap(); }
    let t0 = Instant::now();
    for k in 0..50 { let _ = s.draw(k).unwrap(); }
    println!("draw {:?}/batch", t0.elapsed()/50);
    let mut s = BessStream::builder().triples(t.clone()).n_entity(20000).devices(16,16,4).shard_batch_size(256).seed(7).steps(50).build().unwrap();
    for k in 0..5 { let _ = s.draw(k).unwrap(); }
    let t0 = Instant::now();
    for k in 0..50 { let _ = s.draw(k).unwrap(); }
    println!("draw positives only {:?}/batch", t0.elapsed()/50);
    let part = s.partitioned().clone();
    let mut bs = BatchSampler::positives_only(part.clone(), BatchOptions{shard_bs:256,batches_per_step:1,duplicate_batch:false,return_triple_idx:false,kind:SamplerKind::Random{seed_words:vec![1]}}, Corruption::T).unwrap();
    let t0 = Instant::now();
    for k in 0..50 { let _ = bs.sample_indices(k).unwrap(); }
    println!("indices {:?}/batch", t0.elapsed()/50);
    let mut ns = NegativeSampler::Random(RandomNegative::new(ppp, &[1], Corruption::T, false, true).unwrap());
    let sidx = ndarray::ArrayD::<i64>::zeros(ndarray::IxDyn(&[1, n, n, ppp]));
    let t0 = Instant::now();
    for _ in 0..50 { let _ = ns.sample(&part, &sidx).unwrap(); }
    println!("neg {:?}/batch", t0.elapsed()/50);
}
