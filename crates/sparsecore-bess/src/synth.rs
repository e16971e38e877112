//! Synthetic knowledge graphs for tests, measurements and examples: uniform and power-law
//! entity degrees, from the crate's seeded generator (reproducible everywhere).

use crate::partition::Triples;
use crate::rng::NumpyRng;

/// A uniform value in `[0, 1)` (53 bits).
fn unit(rng: &mut NumpyRng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// `n_triples` triples with heads, relations and tails uniform.
#[must_use]
pub fn uniform(n_entity: usize, n_relation: usize, n_triples: usize, seed: u64) -> Triples {
    let mut rng = NumpyRng::new(u128::from(seed));
    let mut pick = |m: usize| (rng.integers_63() % m as u64) as i64;
    let mut t = Triples::default();
    for _ in 0..n_triples {
        t.head.push(pick(n_entity));
        t.relation.push(pick(n_relation));
        t.tail.push(pick(n_entity));
    }
    t
}

/// `n_triples` triples whose heads and tails follow a power law: the entity of popularity rank
/// `k` (0-based) is drawn with probability proportional to `(k + 1)^-alpha`. Ranks are assigned
/// to entity ids by a random permutation, so popular entities are spread over the id space
/// (as in real graphs, and so that `id mod N` is not trivially skewed). Self-loops are allowed.
#[must_use]
pub fn power_law(
    n_entity: usize,
    n_relation: usize,
    n_triples: usize,
    alpha: f64,
    seed: u64,
) -> Triples {
    let mut rng = NumpyRng::new(u128::from(seed));
    let ids = rng.permutation(n_entity);
    let mut cdf = Vec::with_capacity(n_entity);
    let mut acc = 0.0;
    for k in 0..n_entity {
        acc += ((k + 1) as f64).powf(-alpha);
        cdf.push(acc);
    }
    let mut t = Triples::default();
    for _ in 0..n_triples {
        let ent = |rng: &mut NumpyRng| {
            let u = unit(rng) * acc;
            let k = cdf.partition_point(|&c| c <= u).min(n_entity - 1);
            ids[k] as i64
        };
        let h = ent(&mut rng);
        let tl = ent(&mut rng);
        t.head.push(h);
        t.relation
            .push((rng.integers_63() % n_relation as u64) as i64);
        t.tail.push(tl);
    }
    t
}
