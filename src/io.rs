//! Reading record batches from files, one at a time: Arrow IPC (file or stream format) and
//! Parquet, told apart by their magic bytes, never loaded whole; and writing output files that
//! appear whole or not at all ([`OutputFile`]).

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use arrow_array::RecordBatch;
use arrow_ipc::reader::{FileReader, StreamReader};
use arrow_ipc::{root_as_footer, root_as_message, Message, MessageHeader};
use arrow_schema::SchemaRef;
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ParquetRecordBatchReaderBuilder};

use crate::error::{Error, Result};

/// The container format of an input file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileFormat {
    /// Arrow IPC file format (`ARROW1` magic).
    ArrowFile,
    /// Arrow IPC stream format.
    ArrowStream,
    /// Parquet (`PAR1` magic).
    Parquet,
}

/// Record batches of a file, in order.
pub struct BatchReader {
    inner:
        Box<dyn Iterator<Item = std::result::Result<RecordBatch, arrow_schema::ArrowError>> + Send>,
    schema: SchemaRef,
    format: FileFormat,
    path: String,
    index: usize,
    num_batches: Option<usize>,
    /// A decoder panicked (and was contained): its state is unknown, so no batch follows.
    poisoned: bool,
}

impl BatchReader {
    /// Opens `path`, detecting its format.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let io_err = |what: &str| {
            let name = name.clone();
            let what = what.to_string();
            move |source| Error::Io {
                context: format!("{what} {name}"),
                source,
            }
        };
        let arrow_err = |source| Error::Arrow {
            context: format!("reading {name}"),
            source,
        };
        let mut file = File::open(path).map_err(io_err("opening"))?;
        let mut magic = [0u8; 6];
        let n = read_up_to(&mut file, &mut magic).map_err(io_err("reading"))?;
        file.seek(SeekFrom::Start(0)).map_err(io_err("reading"))?;
        let format = if n >= 6 && &magic == b"ARROW1" {
            FileFormat::ArrowFile
        } else if n >= 4 && &magic[..4] == b"PAR1" {
            FileFormat::Parquet
        } else {
            FileFormat::ArrowStream
        };
        if format != FileFormat::Parquet {
            // arrow-ipc trusts the lengths and offsets a file declares; check them first.
            let len = file.metadata().map_err(io_err("reading"))?.len();
            let checked = check_ipc(&mut BufReader::new(&mut file), len, format);
            file.seek(SeekFrom::Start(0)).map_err(io_err("reading"))?;
            checked.map_err(|reason| Error::Arrow {
                context: format!("reading {name}"),
                source: arrow_schema::ArrowError::IpcError(reason),
            })?;
        }
        let opened = contain_panics(|| -> Result<_> {
            let mut num_batches = None;
            let (inner, schema): (Box<dyn Iterator<Item = _> + Send>, SchemaRef) = match format {
                FileFormat::ArrowFile => {
                    let r = FileReader::try_new(BufReader::new(file), None).map_err(arrow_err)?;
                    let schema = r.schema();
                    num_batches = Some(r.num_batches());
                    (Box::new(r), schema)
                }
                FileFormat::ArrowStream => {
                    let r =
                        StreamReader::try_new(BufReader::new(file), None).map_err(|source| {
                            Error::Arrow {
                                context: format!(
                                    "{name} is neither Parquet nor an Arrow IPC file or stream"
                                ),
                                source,
                            }
                        })?;
                    let schema = r.schema();
                    (Box::new(r), schema)
                }
                FileFormat::Parquet => {
                    // One record batch per row group: a row group is the writer's batch, and a
                    // batch is one local batch, so row groups must neither merge nor split.
                    let pq = |e: parquet::errors::ParquetError| Error::Arrow {
                        context: format!("reading Parquet {name}"),
                        source: arrow_schema::ArrowError::ExternalError(Box::new(e)),
                    };
                    let meta = ArrowReaderMetadata::load(&file, Default::default()).map_err(pq)?;
                    let schema = meta.schema().clone();
                    let groups: Vec<usize> = meta
                        .metadata()
                        .row_groups()
                        .iter()
                        .map(|g| g.num_rows().max(0) as usize)
                        .collect();
                    num_batches = Some(groups.len());
                    let iter = groups
                        .into_iter()
                        .enumerate()
                        .filter(|&(_, rows)| rows > 0)
                        .flat_map(move |(i, rows)| {
                            let opened = file
                                .try_clone()
                                .map_err(|e| arrow_schema::ArrowError::IoError(e.to_string(), e))
                                .and_then(|f| {
                                    ParquetRecordBatchReaderBuilder::new_with_metadata(
                                        f,
                                        meta.clone(),
                                    )
                                    .with_row_groups(vec![i])
                                    .with_batch_size(rows)
                                    .build()
                                    .map_err(|e| {
                                        arrow_schema::ArrowError::ExternalError(Box::new(e))
                                    })
                                });
                            let boxed: Box<
                                dyn Iterator<
                                        Item = std::result::Result<
                                            RecordBatch,
                                            arrow_schema::ArrowError,
                                        >,
                                    > + Send,
                            > = match opened {
                                Ok(r) => Box::new(r),
                                Err(e) => Box::new(std::iter::once(Err(e))),
                            };
                            boxed
                        });
                    (Box::new(iter), schema)
                }
            };
            Ok((inner, schema, num_batches))
        });
        let (inner, schema, num_batches) = opened.unwrap_or_else(|panic| {
            Err(Error::Arrow {
                context: format!("reading {name}"),
                source: arrow_schema::ArrowError::ParseError(panic),
            })
        })?;
        Ok(BatchReader {
            inner,
            schema,
            format,
            path: name,
            index: 0,
            num_batches,
            poisoned: false,
        })
    }

    /// The file's schema.
    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    /// Record batches in the file, when the format says so up front (Arrow IPC file format).
    pub fn num_batches(&self) -> Option<usize> {
        self.num_batches
    }

    /// The detected format.
    pub fn format(&self) -> FileFormat {
        self.format
    }
}

impl Iterator for BatchReader {
    type Item = Result<RecordBatch>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.poisoned {
            return None;
        }
        let item = match contain_panics(|| self.inner.next()) {
            Ok(item) => item?,
            Err(panic) => {
                self.poisoned = true;
                Err(arrow_schema::ArrowError::ParseError(panic))
            }
        };
        let i = self.index;
        self.index += 1;
        Some(item.map_err(|source| Error::Arrow {
            context: format!("{}: record batch {i}", self.path),
            source,
        }))
    }
}

/// Checks the framing of an Arrow IPC file or stream of `len` bytes before arrow-ipc reads it:
/// every block and message lies inside the file, and every buffer of every record or dictionary
/// batch inside its message body. arrow-ipc 60 trusts these numbers: it slices buffers past
/// their body (a panic), sizes an allocation by the footer length (up to 2 GiB) and unwraps
/// negative block lengths, so a corrupt file would abort the process instead of returning an
/// error. Only metadata is read; bodies are skipped.
///
/// Framing that arrow-ipc itself reports as an error (a bad magic, a truncated stream, a
/// message that is not a flatbuffer) is left to it, so that its messages stay the same.
fn check_ipc<R: Read + Seek>(
    r: &mut R,
    len: u64,
    format: FileFormat,
) -> std::result::Result<(), String> {
    let io = |e: std::io::Error| e.to_string();
    if format == FileFormat::ArrowStream {
        let mut pos = 0u64;
        for i in 0.. {
            let mut word = [0u8; 4];
            if read_up_to(r, &mut word).map_err(io)? < 4 {
                return Ok(());
            }
            pos += 4;
            if word == [0xff; 4] {
                if read_up_to(r, &mut word).map_err(io)? < 4 {
                    return Ok(());
                }
                pos += 4;
            }
            let meta_len = i32::from_le_bytes(word);
            if meta_len <= 0 || meta_len as u64 > len.saturating_sub(pos) {
                return Ok(()); // end of stream, or an error arrow-ipc reports
            }
            let mut meta = vec![0u8; meta_len as usize];
            r.read_exact(&mut meta).map_err(io)?;
            pos += meta_len as u64;
            let Ok(message) = root_as_message(&meta) else {
                return Ok(());
            };
            let body = message.bodyLength();
            if body < 0 || body as u64 > len.saturating_sub(pos) {
                return Ok(()); // arrow-ipc reports it, after a bounded read
            }
            check_message(&message, body as u64).map_err(|e| format!("IPC message {i}: {e}"))?;
            r.seek(SeekFrom::Current(body)).map_err(io)?;
            pos += body as u64;
        }
        return Ok(());
    }
    // File format: "ARROW1" + padding, messages, footer, footer length (i32), "ARROW1".
    const TAIL: u64 = 10;
    const HEAD: u64 = 8;
    if len < HEAD + TAIL {
        return Ok(());
    }
    let mut tail = [0u8; TAIL as usize];
    r.seek(SeekFrom::End(-(TAIL as i64))).map_err(io)?;
    r.read_exact(&mut tail).map_err(io)?;
    let footer_len = i32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
    if &tail[4..] != b"ARROW1" || footer_len < 0 {
        return Ok(());
    }
    let data_end = len - TAIL;
    if footer_len as u64 > data_end - HEAD {
        return Err(format!(
            "footer length {footer_len} exceeds the {} bytes between header and trailer",
            data_end - HEAD
        ));
    }
    let data_end = data_end - footer_len as u64;
    let mut footer = vec![0u8; footer_len as usize];
    r.seek(SeekFrom::Start(data_end)).map_err(io)?;
    r.read_exact(&mut footer).map_err(io)?;
    let footer =
        root_as_footer(&footer).map_err(|e| format!("footer is not an IPC footer: {e}"))?;
    for (what, blocks) in [
        ("dictionary", footer.dictionaries()),
        ("record batch", footer.recordBatches()),
    ] {
        for (i, block) in blocks.iter().flatten().enumerate() {
            let (offset, meta_len, body) =
                (block.offset(), block.metaDataLength(), block.bodyLength());
            let end = (offset >= 0 && meta_len >= 8 && body >= 0)
                .then(|| {
                    (offset as u64)
                        .checked_add(meta_len as u64)?
                        .checked_add(body as u64)
                })
                .flatten();
            if end.is_none_or(|end| end > data_end) {
                return Err(format!(
                    "{what} block {i}: offset {offset}, metadata {meta_len} and body {body} bytes do not lie \
                     within the file's {data_end} data bytes"
                ));
            }
            let mut meta = vec![0u8; meta_len as usize];
            r.seek(SeekFrom::Start(offset as u64)).map_err(io)?;
            r.read_exact(&mut meta).map_err(io)?;
            let prefix = if meta[..4] == [0xff; 4] { 8 } else { 4 };
            let message = root_as_message(&meta[prefix..])
                .map_err(|e| format!("{what} block {i}: metadata is not an IPC message: {e}"))?;
            check_message(&message, body as u64).map_err(|e| format!("{what} block {i}: {e}"))?;
        }
    }
    Ok(())
}

/// A record or dictionary batch's lengths are non-negative and its buffers lie inside its
/// `body`-byte message body.
fn check_message(message: &Message<'_>, body: u64) -> std::result::Result<(), String> {
    let batch = match message.header_type() {
        MessageHeader::RecordBatch => message.header_as_record_batch(),
        MessageHeader::DictionaryBatch => {
            message.header_as_dictionary_batch().and_then(|d| d.data())
        }
        _ => None,
    };
    let Some(batch) = batch else { return Ok(()) };
    if batch.length() < 0 {
        return Err(format!("negative row count {}", batch.length()));
    }
    for (j, node) in batch.nodes().iter().flatten().enumerate() {
        if node.length() < 0 || node.null_count() < 0 {
            return Err(format!(
                "field node {j}: negative length {} or null count {}",
                node.length(),
                node.null_count()
            ));
        }
    }
    for (j, buffer) in batch.buffers().iter().flatten().enumerate() {
        let (offset, length) = (buffer.offset(), buffer.length());
        let end = (offset >= 0 && length >= 0)
            .then(|| (offset as u64).checked_add(length as u64))
            .flatten();
        if end.is_none_or(|end| end > body) {
            return Err(format!("buffer {j} (offset {offset}, {length} bytes) lies outside the {body}-byte message body"));
        }
    }
    Ok(())
}

/// An output file that appears whole or not at all: written to a temporary sibling
/// ([`tmp_path`]) and renamed over its path by [`OutputFile::commit`]; dropped before that, the
/// temporary is removed, so a failed write (a full disk, a bad input found halfway) leaves
/// nothing behind.
///
/// The path is resolved through symlinks first, so that a symlink keeps pointing at the new
/// file rather than being replaced by it. A path that exists and is neither a regular file nor
/// a directory (a FIFO, `/dev/null`, a terminal) is written in place: a rename would replace
/// the pipe or device with a regular file. A directory is refused before anything is written.
#[derive(Debug)]
pub struct OutputFile {
    /// The path as given, for messages.
    given: PathBuf,
    /// The path resolved through symlinks: what the rename replaces.
    target: PathBuf,
    /// The temporary written until [`Self::commit`]; `None` when written in place.
    tmp: Option<PathBuf>,
}

impl OutputFile {
    /// Plans writing `path` (nothing is created yet).
    pub fn new(path: impl AsRef<Path>) -> Result<Self> {
        let given = path.as_ref().to_path_buf();
        let is_link = std::fs::symlink_metadata(&given).is_ok_and(|m| m.file_type().is_symlink());
        // A dangling symlink is replaced like a missing file.
        let target = if is_link {
            std::fs::canonicalize(&given).unwrap_or_else(|_| given.clone())
        } else {
            given.clone()
        };
        let tmp = match std::fs::metadata(&target) {
            Ok(m) if m.is_dir() => {
                let source =
                    std::io::Error::new(std::io::ErrorKind::IsADirectory, "is a directory");
                return Err(Error::Io {
                    context: format!("writing {}", given.display()),
                    source,
                });
            }
            Ok(m) if !m.is_file() => None,
            _ => Some(tmp_path(&target)),
        };
        Ok(OutputFile { given, target, tmp })
    }

    /// Where to write until [`Self::commit`]: the temporary, or the path itself when it is
    /// written in place.
    pub fn path(&self) -> &Path {
        self.tmp.as_deref().unwrap_or(&self.target)
    }

    /// Creates (or truncates) [`Self::path`] for writing.
    pub fn create(&self) -> Result<File> {
        File::create(self.path()).map_err(|source| Error::Io {
            context: format!("creating {}", self.path().display()),
            source,
        })
    }

    /// Renames the temporary over the path: the file appears whole.
    pub fn commit(mut self) -> Result<()> {
        let Some(tmp) = self.tmp.take() else {
            return Ok(());
        };
        std::fs::rename(&tmp, &self.target).map_err(|source| {
            let _ = std::fs::remove_file(&tmp);
            Error::Io {
                context: format!("renaming {} to {}", tmp.display(), self.given.display()),
                source,
            }
        })
    }
}

impl Drop for OutputFile {
    fn drop(&mut self) {
        if let Some(tmp) = self.tmp.take() {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// The temporary name used while `path` is being written: a sibling, so that the rename stays
/// on one file system, named by the process so that concurrent writers do not collide.
pub fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

/// Runs a step of arrow-ipc's or parquet's decoding, turning a panic inside it into an error
/// message.
///
/// Both crates (version 60) still panic on some malformed files, past the framing that
/// [`check_ipc`] verifies: arrow-data's validation asserts that an offsets buffer is a whole
/// number of aligned `i32`s before it checks its length, for one. A corrupt file must be an
/// error, not the end of the process, so file decoding is the one place the crate catches
/// panics. (Under `panic = "abort"` they still abort; allocation failures always do.)
fn contain_panics<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_string());
        format!("malformed file: the decoder panicked: {what}")
    })
}

fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}
