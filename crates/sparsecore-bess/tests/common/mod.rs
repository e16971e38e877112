//! What several test files build: the `.npy` members of a sharding's `.npz`, as besskge's
//! `Sharding.save` writes them.

use sparsecore_bess::Sharding;
use sparsecore_prep::fdo::npz::{encode_npy, NpyArray};

/// The five integer members of `s`'s `.npz` (50 entities on 4 shards of at most 13), by file
/// name, each encoded as numpy writes it.
pub fn sharding_members(s: &Sharding) -> [(&'static str, Vec<u8>); 5] {
    let int = |shape: Vec<usize>, data: Vec<i64>| encode_npy(&NpyArray { shape, data });
    [
        ("n_shard.npy", int(vec![], vec![4])),
        (
            "entity_to_shard.npy",
            int(vec![50], s.entity_to_shard.clone()),
        ),
        ("entity_to_idx.npy", int(vec![50], s.entity_to_idx.clone())),
        (
            "shard_and_idx_to_entity.npy",
            int(
                vec![4, 13],
                s.shard_and_idx_to_entity.iter().copied().collect(),
            ),
        ),
        ("shard_counts.npy", int(vec![4], s.shard_counts.clone())),
    ]
}
