//! The TCP all-reduce's frame, written by hand (as a peer holding the token, or a stranger,
//! would), for the tests that talk to a `TcpAllReduce` directly (`tests/pipeline/allreduce.rs`,
//! `tests/reference/golden_mh.rs`).

use hmac::{Hmac, KeyInit, Mac};

/// One frame: magic, src, dst, seq, key, value, HMAC-SHA256 under `token`.
pub fn frame(
    token: &[u8],
    challenge: &[u8],
    src: u32,
    dst: u32,
    seq: u64,
    key: u64,
    value: u64,
) -> [u8; 68] {
    let mut m = <Hmac<sha2::Sha256> as KeyInit>::new_from_slice(token).unwrap();
    m.update(b"sparsecore-prep/allreduce/v1");
    m.update(challenge);
    let mut f = [0u8; 68];
    f[..4].copy_from_slice(b"SCAF");
    f[4..8].copy_from_slice(&src.to_le_bytes());
    f[8..12].copy_from_slice(&dst.to_le_bytes());
    f[12..20].copy_from_slice(&seq.to_le_bytes());
    f[20..28].copy_from_slice(&key.to_le_bytes());
    f[28..36].copy_from_slice(&value.to_le_bytes());
    m.update(&f[4..36]);
    f[36..].copy_from_slice(&m.finalize().into_bytes());
    f
}
