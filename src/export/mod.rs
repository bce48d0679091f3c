//! Exports: JSON lines streamed from the store (one record in memory at a time), and OTLP.

pub mod formats;
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
        ExportFormat::Opentraces | ExportFormat::Atif | ExportFormat::Invariant => {
            let all: Vec<_> = reader
                .sessions(&TraceFilter::default())?
                .into_iter()
                .map(|r| r.summary)
                .collect();
            let selected = reader.sessions(filter)?;
            let selected_ids: std::collections::HashSet<&str> =
                selected.iter().map(|r| r.summary.trajectory_id.as_str()).collect();
            for row in &selected {
                let s = &row.summary;
                let embedded_in_parent = s
                    .parent_trajectory_id
                    .as_deref()
                    .is_some_and(|p| selected_ids.contains(p));
                if format == ExportFormat::Atif && embedded_in_parent {
                    continue;
                }
                // One trajectory (with its sub-agents for ATIF) in memory at a time.
                let data = load_trajectory(reader, s.clone(), &all, format == ExportFormat::Atif, 0)?;
                let v = match format {
                    ExportFormat::Atif => formats::atif(&data),
                    ExportFormat::Invariant => formats::invariant(&data),
                    _ => formats::opentraces(&data),
                };
                line(&v)?;
            }
        }
    }
    if let Some(e) = io_err {
        return Err(e.into());
    }
    out.flush()?;
    Ok(n)
}

/// A trajectory's steps and, when `with_children`, the sub-agent trajectories it started (recursively).
fn load_trajectory(
    reader: &StoreReader,
    summary: crate::model::step::TrajectorySummary,
    all: &[crate::model::step::TrajectorySummary],
    with_children: bool,
    depth: usize,
) -> Result<formats::TrajectoryData, StoreError> {
    let id = summary.trajectory_id.clone();
    let mut steps = reader.steps(&TraceFilter {
        session: Some(id.clone()),
        ..TraceFilter::default()
    })?;
    steps.retain(|s| s.trajectory_id == id);
    let mut children = Vec::new();
    if with_children && depth < 8 {
        for c in all
            .iter()
            .filter(|c| c.parent_trajectory_id.as_deref() == Some(id.as_str()) && c.trajectory_id != id)
        {
            children.push(load_trajectory(reader, c.clone(), all, true, depth + 1)?);
        }
    }
    Ok(formats::TrajectoryData {
        summary,
        steps,
        children,
    })
}
