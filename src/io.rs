//! Reading record batches from files, one at a time: Arrow IPC (file or stream format) and
//! Parquet, told apart by their magic bytes, never loaded whole.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use arrow_array::RecordBatch;
use arrow_ipc::reader::{FileReader, StreamReader};
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
    inner: Box<dyn Iterator<Item = std::result::Result<RecordBatch, arrow_schema::ArrowError>> + Send>,
    schema: SchemaRef,
    format: FileFormat,
    path: String,
    index: usize,
    num_batches: Option<usize>,
}

impl BatchReader {
    /// Opens `path`, detecting its format.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let io_err = |what: &str| {
            let name = name.clone();
            let what = what.to_string();
            move |source| Error::Io { context: format!("{what} {name}"), source }
        };
        let arrow_err = |source| Error::Arrow { context: format!("reading {name}"), source };
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
        let mut num_batches = None;
        let (inner, schema): (Box<dyn Iterator<Item = _> + Send>, SchemaRef) = match format {
            FileFormat::ArrowFile => {
                let r = FileReader::try_new(BufReader::new(file), None).map_err(arrow_err)?;
                let schema = r.schema();
                num_batches = Some(r.num_batches());
                (Box::new(r), schema)
            }
            FileFormat::ArrowStream => {
                let r = StreamReader::try_new(BufReader::new(file), None).map_err(|source| Error::Arrow {
                    context: format!("{name} is neither Parquet nor an Arrow IPC file or stream"),
                    source,
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
                let groups: Vec<usize> =
                    meta.metadata().row_groups().iter().map(|g| g.num_rows().max(0) as usize).collect();
                num_batches = Some(groups.len());
                let iter = groups.into_iter().enumerate().filter(|&(_, rows)| rows > 0).flat_map(move |(i, rows)| {
                    let opened = file
                        .try_clone()
                        .map_err(|e| arrow_schema::ArrowError::IoError(e.to_string(), e))
                        .and_then(|f| {
                            ParquetRecordBatchReaderBuilder::new_with_metadata(f, meta.clone())
                                .with_row_groups(vec![i])
                                .with_batch_size(rows)
                                .build()
                                .map_err(|e| arrow_schema::ArrowError::ExternalError(Box::new(e)))
                        });
                    let boxed: Box<dyn Iterator<Item = std::result::Result<RecordBatch, arrow_schema::ArrowError>> + Send> =
                        match opened {
                            Ok(r) => Box::new(r),
                            Err(e) => Box::new(std::iter::once(Err(e))),
                        };
                    boxed
                });
                (Box::new(iter), schema)
            }
        };
        Ok(BatchReader { inner, schema, format, path: name, index: 0, num_batches })
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
        let item = self.inner.next()?;
        let i = self.index;
        self.index += 1;
        Some(item.map_err(|source| Error::Arrow { context: format!("{}: record batch {i}", self.path), source }))
    }
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
