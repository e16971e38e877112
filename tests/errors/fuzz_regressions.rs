//! Inputs found by the fuzz targets (`fuzz/`, see RELIABILITY.md) that crashed the crate
//! before their fix, each now a typed error. Each test holds its input inline, as libFuzzer
//! saved it (hex), or builds it when it is a corruption of a valid file.

use std::path::PathBuf;

use arrow_array::{Array, ArrayRef, Int32Array, ListArray, RecordBatch};
use arrow_buffer::OffsetBuffer;
use arrow_schema::{DataType, Field, Schema};
use sparsecore_prep::fdo::{csv, npz, FdoStats, LayoutKey};
use sparsecore_prep::io::BatchReader;
use sparsecore_prep::{Error, Result};

fn hex(text: &str) -> Vec<u8> {
    let digits: Vec<u8> = text.bytes().filter(u8::is_ascii_hexdigit).collect();
    digits
        .chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
        .collect()
}

/// A scratch path named `name`, unique to this test process.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "sparsecore-fuzz-regressions-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Writes `bytes` to a scratch file named `name` and reads every record batch from it.
fn read_all(name: &str, bytes: &[u8]) -> Result<Vec<RecordBatch>> {
    let path = scratch(name);
    std::fs::write(&path, bytes).unwrap();
    let result = BatchReader::open(&path).and_then(|r| r.collect::<Result<Vec<_>>>());
    std::fs::remove_file(&path).unwrap();
    result
}

/// The reason inside an `Error::Arrow`, with the file it names.
fn arrow_reason(e: &Error) -> String {
    match e {
        Error::Arrow { context, source } => format!("{context}: {source}"),
        other => panic!("expected Error::Arrow, got {other:?}"),
    }
}

/// arrow_ipc target, `crash-12b0bf3aea221ee8b937b67aa96009edc4ed7171`: an IPC file whose first
/// record batch declares a buffer at offset 234195976716296 in a 176-byte body. arrow-ipc 60
/// sliced it unchecked and panicked ("the offset of the new Buffer cannot exceed the existing
/// length").
const BUFFER_PAST_BODY: &str = "
    4152524f57310000ffffffffc00100001000000000000a000c000600050008000a000000000104000c00000008000800
    0000040008000000040000000400000018010000bc0000006000000004000000ccfeffff0000010c1400000018000000
    0400000001000000100000000200000077620000f8fefffff4feffff00000103100000001c0000000400000000000000
    040000006974656d0000060008000600060000000000010024ffffff0000010c14000000180000000400000001000000
    10000000010000006300000050ffffff4cffffff0000010210000000180000000400000000000000040000006974656d
    000000003cffffff00000001200000007cffffff0000010c140000001800000004000000010000001000000001000000
    62000000a8ffffffa4ffffff0000010210000000180000000400000000000000040000006974656d0000000094ffffff
    0000000120000000d4ffffff0000010c140000001c000000040000000100000024000000010000006100000004000400
    04000000100014000800060007000c000000100010000000000001021000000020000000040000000000000004000000
    6974656d0000000008000c000800070008000000000000012000000000000000ffffffffd80100001400000000000000
    0c0016000600050008000c000c0000000003040018000000b00000000000000000000a0018000c00040008000a000000
    1c0100001000000004000000000000000000000010000000000000000000000001000000000000000800000000d50000
    14000000000000002000000000000000000000000000000020000000000000000c000000000000003000000000000000
    000000000000000030000000000000001400000000000000480000000000000000000000000000004800000000000000
    0c0000000000000058000000000000000000000000000000580000000000000014000000000000007000000000000000
    000000000000000070000000000000001400000000000000880000000000000000000000000000008800000000000000
    1400000000000000a0000000000000000000000000000000a0000000000000000c000000000000000000000008000000
    040000000000000001000000000000000300000000000000000000000000000004000000000000000000000000000000
    030000000000000000000000000000000400000000000000000000000000000005000000000000000000000000000000
    04000000000000000000000000000000030000000000000000000000000000000d000000000000000000000001000000
    010000000300000003000000000000000100000002000000030000000000000000000000010000000200000002000000
    030000000000000004000000040000001c00000000000000000000000100000003000000030000000500000000000000
    7f0200008700000036030000ad000000af03000000000000000000000100000002000000020000000300000000000000
    0000003e00001c400000344000000000ffffffff00000000100000000c001400060008000c0010000c00000000000400
    38000000280000000400000001000000d001000000000000e001000000000000b0000000000000000000000000000000
    080008000000040008000000040000000400000018010000bc0000006000000004000000ccfeffff0000010c14000000
    180000000400000001000000100000000200000077620000f8fefffff4feffff00000103100000001c00000004000000
    00000000040000006974656d0000060008000600060000000000010024ffffff0000010c140000001800000004000000
    0100000010000000010000006300000050ffffff4cffffff000001021000000018000000040000000000000004000000
    6974656d000000003cffffff00000001200000007cffffff0000010c1400000018000000040000000100000010000000
    0100000062000000a8ffffffa4ffffff0000010210000000180000000400000000000000040000006974656d00000000
    94ffffff0000000120000000d4ffffff0000010c140000001c0000000400000001000000240000000100000061000000
    0400040004000000100014000800060007000c0000001000100000000000010210000000200000000400000000000000
    040000006974656d0000000008000c0008000700080000000000000120000000e80100004152524f5731
";

#[test]
fn ipc_buffer_past_its_message_body_is_an_error() {
    let e = read_all("buffer_past_body.arrow", &hex(BUFFER_PAST_BODY)).unwrap_err();
    let reason = arrow_reason(&e);
    assert!(reason.contains("buffer_past_body.arrow"), "{reason}");
    assert!(reason.contains("record batch block 0: buffer"), "{reason}");
    assert!(
        reason.contains("offset 234195976716296")
            && reason.contains("outside the 176-byte message body"),
        "{reason}"
    );
}

/// arrow_ipc target, `crash-6e9bc0ed7eadc1881eaf409f7aa79cfa26f6c27c`: an IPC stream whose
/// framing is sound but whose list column's offsets buffer is not a whole number of `i32`s.
/// arrow-data 60's validation asserts the buffer's alignment (`typed_data`) before checking
/// its length, and panicked; `BatchReader` now contains decoder panics.
const OFFSETS_NOT_WHOLE_I32S: &str = "
    ffffffff600100001000000000000a000c000600050008000a000000000104000c000000080008000000040008000000
    0400000003000000bc000000600000000400000024ffffff0000010c1400000018000000040000000100000010000000
    010000006300000050ffffff4cffffff0000010210000000180000000400000000000000040000006974656d00000000
    3cffffff00000001200000007cffffff0000010c14000000180000000400000001000000100000000100000062000000
    a8ffffffa4ffffff0000010210000000180000000400000000000000040000006974656d0000000094ffffff00000001
    20000000d4ffffff0000010c140000001c00000004000000010000002400000001000000610000000400040004000000
    100014000000060007000c0000001000100000000000010210000000200000000400000000000000040000006974656d
    0000000008000c0008000700080000000000000120000000ffffffff7801000014000000000000000c00160006000500
    08000c000c0000000003040018000000680100000000000000000a0018000c00040008000a000000dc00000010000000
    0800000000000000000000000c0000000000000000000000000000000000000000000000000000008300000000000000
    280000000000000000000000000000002800000000000000680000000000000090000000000000000000000000000000
    90000000000000002400000000000000b8000000000000000000000000000000b8000000000000003400000000000000
    f0000000000000000000000000000000f000000000000000240000000000000018010000000000000000000000000000
    18010000000000004c000000000000000000000006000000080000000000000000000000000000001a00000000000000
    0000000000000000080000000000000000000000000000000d0000000000000000000000000000000800000000000000
    0000000000000000130000000000000000000000000000000000000003000000060000000a0000000e00000010000000
    13000000170000001a00000000000000110000003500000013000000350000001f000000270000000b00000001000000
    1b0000000b0000003700000018000000130000002d000000060000002a00000004000000310000002200000036000000
    2b0000001500000017000000040000000e0000002100000000000000030000000400000006000000080000000a000000
    0a0000000a0000000d0000000000000030000000340000000c00000011000000220000000d0000002800000039000000
    08000000380000001c0000002900000008000000000000000000000004000000080000000a0000000b00000010000000
    1100000011000000130000000000000095010000e40300007b020000ab0300004b03000057000000090300005b020000
    3801000081020000b8000000f70200004e020000f502000042010000d1020000bc01000054010000a301000000000000
    ffffffff00000000
";

#[test]
fn ipc_decoder_panic_is_an_error() {
    let e = read_all("offsets.arrows", &hex(OFFSETS_NOT_WHOLE_I32S)).unwrap_err();
    let reason = arrow_reason(&e);
    assert!(
        reason.contains("offsets.arrows: record batch 0"),
        "{reason}"
    );
    assert!(
        reason.contains("malformed file: the decoder panicked"),
        "{reason}"
    );
}

/// A small valid IPC file: one `List<Int32>` column `f0` with rows [1, 2], [], [3].
fn valid_file() -> Vec<u8> {
    let values = Int32Array::from(vec![1, 2, 3]);
    let field = Field::new_list_field(DataType::Int32, false);
    let list = ListArray::new(
        field.into(),
        OffsetBuffer::new(vec![0, 2, 2, 3].into()),
        std::sync::Arc::new(values),
        None,
    );
    let schema = Schema::new(vec![Field::new("f0", list.data_type().clone(), false)]);
    let batch = RecordBatch::try_new(
        schema.clone().into(),
        vec![std::sync::Arc::new(list) as ArrayRef],
    )
    .unwrap();
    let mut bytes = Vec::new();
    let mut w = arrow_ipc::writer::FileWriter::try_new(&mut bytes, &schema).unwrap();
    w.write(&batch).unwrap();
    w.finish().unwrap();
    drop(w);
    bytes
}

#[test]
fn the_valid_file_reads() {
    let batches = read_all("valid.arrow", &valid_file()).unwrap();
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].num_rows(), 3);
}

#[test]
fn ipc_footer_longer_than_the_file_is_an_error_not_a_2gib_allocation() {
    // arrow-ipc 60 allocates the declared footer length before reading it.
    let mut bytes = valid_file();
    let n = bytes.len();
    bytes[n - 10..n - 6].copy_from_slice(&i32::MAX.to_le_bytes());
    let reason = arrow_reason(&read_all("long_footer.arrow", &bytes).unwrap_err());
    assert!(
        reason.contains(&format!(
            "footer length 2147483647 exceeds the {} bytes",
            n - 18
        )),
        "{reason}"
    );
}

#[test]
fn ipc_block_with_negative_body_length_is_an_error() {
    // arrow-ipc 60 unwraps `bodyLength().to_usize()` and panics on a negative length.
    let mut bytes = valid_file();
    let n = bytes.len();
    let footer_len = i32::from_le_bytes(bytes[n - 10..n - 6].try_into().unwrap()) as usize;
    let footer_at = n - 10 - footer_len;
    let footer = arrow_ipc::root_as_footer(&bytes[footer_at..n - 10]).unwrap();
    let block = footer.recordBatches().unwrap().get(0);
    let body = block.bodyLength().to_le_bytes();
    // The block is a 24-byte struct inside the footer: offset (i64), metaDataLength (i32, padded), bodyLength (i64).
    let at = footer_at
        + bytes[footer_at..n - 10]
            .windows(8)
            .position(|w| w == body)
            .unwrap();
    bytes[at..at + 8].copy_from_slice(&(-1i64).to_le_bytes());
    let reason = arrow_reason(&read_all("negative_body.arrow", &bytes).unwrap_err());
    assert!(
        reason.contains("record batch block 0")
            && reason.contains("body -1 bytes do not lie within"),
        "{reason}"
    );
}

/// stats_import target, `crash-b7502b5f03e2f88fc3475ce153c10b6944e45da0`: our stats JSON with a
/// stack named " t0". (The fuzzer's file also held a misspelled `max_unique_ids_p'r_partition`,
/// which stats parsing ignored then and rejects now: `misspelled_stats_fields_are_errors`; and a
/// `max_unique_ids_per_partition` of 1 value where layout 1/2/2 gives 4, which
/// `FdoStats::validate` now refuses: here it has 4.) The CSV reader trimmed keys, so exporting these stats to the reference's
/// CSV and importing them back renamed the stack to "t0".
const STACK_NAME_WITH_SPACE: &str = r#"{
 "version": 1,
 "layout": {
  "local_device_count": 1,
  "global_device_count": 2,
  "num_sc_per_device": 2
 },
 "batches": 2,
 "stacks": {
 " t0": {
   "max_ids_per_partition": [
    2,
    2,
    15,
    9
   ],
   "max_unique_ids_per_partition": [
 9,
 1,
 9,
 1
   ],
   "required_buffer_size_per_sc": [
    195,
    124
   ],
   "dropped_id_count": 0
  }
 }
}"#;

#[test]
fn misspelled_stats_fields_are_errors() {
    let text = STACK_NAME_WITH_SPACE.replace(
        "\"max_unique_ids_per_partition\": [",
        "\"max_unique_ids_p'r_partition\": [5, 10, 1],\n   \"max_unique_ids_per_partition\": [",
    );
    let e = FdoStats::from_json(&text).unwrap_err();
    assert!(matches!(e, Error::UnknownField { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        "unknown field `max_unique_ids_p'r_partition` in stack ` t0`; did you mean `max_unique_ids_per_partition`?"
    );
}

#[test]
fn csv_export_keeps_stack_names_verbatim() {
    let stats = FdoStats::from_json(STACK_NAME_WITH_SPACE).unwrap();
    assert!(stats.stacks.contains_key(" t0"));
    let path = scratch("space.csv");
    csv::export(&path, &stats).unwrap();
    let back = csv::import(&path, stats.layout).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(back.stacks.keys().collect::<Vec<_>>(), vec![" t0"]);
    assert_eq!(back.stacks[" t0"], stats.stacks[" t0"]);
}

#[test]
fn csv_export_refuses_names_that_cannot_be_keys() {
    let mut stats = FdoStats::from_json(STACK_NAME_WITH_SPACE).unwrap();
    let st = stats.stacks.remove(" t0").unwrap();
    stats.stacks.insert("a,b".into(), st);
    let path = scratch("comma.csv");
    let e = csv::export(&path, &stats).unwrap_err();
    assert!(matches!(e, Error::InvalidData { .. }), "{e:?}");
    assert!(
        e.to_string().contains("comma.csv") && e.to_string().contains("\"a,b\""),
        "{e}"
    );
    assert!(!path.exists());
}

/// An `.npy` of shape (0, 2^40): no data, so it decodes, but the row width sized the result of
/// `max_over_rows` (8 TiB) and aborted the process. Found while writing the stats_import
/// target (its run had not reached it yet).
#[test]
fn npy_without_rows_sizes_nothing() {
    let mut header =
        String::from("{'descr': '<i8', 'fortran_order': False, 'shape': (0, 1099511627776), }");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    let a = npz::decode_npy(&bytes, "t0_max_ids.npy").unwrap();
    assert_eq!(a.shape, vec![0, 1 << 40]);
    assert_eq!(a.max_over_rows(), Vec::<i64>::new());
    let layout = LayoutKey {
        local_device_count: 1,
        global_device_count: 1,
        num_sc_per_device: 4,
    };
    let stats =
        npz::stats_from_arrays(layout, &[("t0_max_ids".to_string(), a)].into(), "x.npz").unwrap();
    assert!(stats.stacks["t0"].max_ids_per_partition.is_empty());
}

/// stats_import target (merging parsed stats with themselves): counts near `u64::MAX` in a
/// stats file overflowed `merge` (a panic with overflow checks, a wrap without).
#[test]
fn merging_huge_counts_saturates() {
    let text = STACK_NAME_WITH_SPACE
        .replace("\"batches\": 2", "\"batches\": 18446744073709551615")
        .replace(
            "\"dropped_id_count\": 0",
            "\"dropped_id_count\": 18446744073709551000",
        );
    let stats = FdoStats::from_json(&text).unwrap();
    let mut merged = stats.clone();
    merged.merge(&stats).unwrap();
    assert_eq!(merged.batches, u64::MAX);
    assert_eq!(merged.stacks[" t0"].dropped_id_count, u64::MAX);
    assert_eq!(
        merged.stacks[" t0"].max_ids_per_partition,
        vec![2, 2, 15, 9]
    );
}

/// stats_import target: a reference CSV with a negative count was imported, and the JSON
/// written from it did not read back (`from_json` refuses negative counts). Every reader now
/// holds stats to the same rules, so whatever one accepts, the JSON reader accepts back.
#[test]
fn imported_negative_counts_are_refused_like_json_ones() {
    let text = "key,values\nt0\u{f}\0\0\0_max_ids,-9";
    // One partition, as the one value needs (the fuzzer's layout 1/2/2 gives 4, now refused).
    let layout = LayoutKey {
        local_device_count: 1,
        global_device_count: 1,
        num_sc_per_device: 1,
    };
    let arrays = csv::parse(text, "fuzz.csv").unwrap();
    let e = npz::stats_from_arrays(layout, &arrays, "fuzz.csv").unwrap_err();
    assert!(
        e.to_string()
            .contains("`max_ids_per_partition`[0] is -9: counts cannot be negative"),
        "{e}"
    );
    let fine = csv::parse("key,values\nt0_max_ids,9", "fine.csv").unwrap();
    let stats = npz::stats_from_arrays(layout, &fine, "fine.csv").unwrap();
    assert_eq!(FdoStats::from_json(&stats.to_json()).unwrap(), stats);
}
