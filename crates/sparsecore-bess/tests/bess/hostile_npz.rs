//! Sharding files built to exhaust memory are refused before they are inflated.

use crate::common;

use std::io::Write;

use sparsecore_bess::{BessError, Sharding};
use sparsecore_prep::{Error, NpzBound};

/// A sharding `.npz` of 50 entities on 4 shards whose `entity_to_shard` member holds its 50
/// values followed by `mib` MiB of zeros, every member deflated.
fn write_sharding(path: &std::path::Path, s: &Sharding, mib: usize) {
    let members = common::sharding_members(s);
    let mut zip = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    let zeros = vec![0u8; 1 << 20];
    for (name, bytes) in members {
        zip.start_file(name, opts).unwrap();
        zip.write_all(&bytes).unwrap();
        if name == "entity_to_shard.npy" {
            for _ in 0..mib {
                zip.write_all(&zeros).unwrap();
            }
        }
    }
    zip.finish().unwrap();
}

// Regression: every member was inflated whole before its header was looked at, so a small
// sharding file took about a thousand times its size in memory before it was refused.
#[test]
fn a_deflate_bomb_member_is_refused_naming_file_member_size_and_limit() {
    let s = Sharding::create(50, 4, &[9], None).unwrap();
    let dir = std::env::temp_dir().join(format!("bess-npz-bomb-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("s.npz");
    write_sharding(&path, &s, 0);
    assert_eq!(Sharding::load_npz(&path).unwrap(), s);

    write_sharding(&path, &s, 16);
    assert!(
        std::fs::metadata(&path).unwrap().len() < 200_000,
        "the bomb is small on disk"
    );
    let start = std::time::Instant::now();
    let e = Sharding::load_npz(&path).unwrap_err();
    let took = start.elapsed();
    let name = path.display().to_string();
    // encode_npy's header of a (50,) int64 array takes 128 bytes, its data 400.
    match &e {
        BessError::Prep(Error::NpzMemberTooLarge {
            file,
            member,
            size,
            bound,
            limit,
        }) => {
            assert_eq!(
                (file.as_str(), member.as_str(), *size, *bound, *limit),
                (
                    name.as_str(),
                    "entity_to_shard",
                    16_777_744,
                    NpzBound::Declared,
                    528
                )
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(e.to_string(), format!("{name}: member `entity_to_shard`: 16777744 bytes decompressed, more than its .npy header declares: 528"));
    assert!(
        took < std::time::Duration::from_secs(2),
        "refused in {took:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
