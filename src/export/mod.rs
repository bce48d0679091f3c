//! Exports: JSON lines streamed from the store (one record in memory at a time), and OTLP.

pub mod otlp;

use std::io::Write;

use crate::cli::ExportFormat;
use crate::store::{StoreError, StoreReader, TraceFilter};

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot write export: {0}")]
    Io(#[from] std::io::Error),
}

/// Write every selected record as one JSON line. Returns how many were written.
pub fn write_jsonl(
    reader: &StoreReader,
    format: ExportFormat,
    filter: &TraceFilter,
    out: &mut dyn Write,
) -> Result<u64, ExportError> {
    let mut n = 0u64;
    let mut io_err: Option<std::io::Error> = None;
    let mut line = |v: &serde_json::Value| -> Result<(), StoreError> {
        let r = serde_json::to_writer(&mut *out, v)
            .map_err(std::io::Error::from)
            .and_then(|_| out.write_all(b"\n"));
        if let Err(e) = r {
            io_err.get_or_insert(e);
        }
        n += 1;
        Ok(())
    };
    match format {
        ExportFormat::ProviderTraces => reader.for_each_trace(filter, |t| line(&t.to_export_json()))?,
        ExportFormat::Steps => reader.for_each_step(filter, |s| line(&serde_json::to_value(&s).unwrap_or_default()))?,
    }
    if let Some(e) = io_err {
        return Err(e.into());
    }
    out.flush()?;
    Ok(n)
}
