//! Exports: JSON lines streamed from the store (one record in memory at a time), and remote sinks (OTLP) behind
//! one seam and one driver (`sink`).

pub mod formats;
pub mod otlp;
pub mod shared_store;
pub mod sink;

use std::io::Write;

use crate::model::format::ExportFormat;
use crate::store::{Query, Store, StoreError, TraceFilter};

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot write export: {0}")]
    Io(#[from] std::io::Error),
}

/// Writes JSON lines, remembering the first I/O error (the store callbacks cannot return one).
struct Lines<'a> {
    out: &'a mut dyn Write,
    written: u64,
    error: Option<std::io::Error>,
}

impl Lines<'_> {
    fn raw(&mut self, bytes: &[u8]) {
        if self.error.is_none()
            && let Err(e) = self.out.write_all(bytes)
        {
            self.error = Some(e);
        }
    }

    fn value(&mut self, v: &serde_json::Value) {
        if self.error.is_none()
            && let Err(e) = serde_json::to_writer(&mut *self.out, v)
        {
            self.error = Some(e.into());
        }
    }

    fn line(&mut self, v: &serde_json::Value) {
        self.value(v);
        self.raw(b"\n");
        self.written += 1;
    }
}

/// Write every selected record as one JSON line (TurnWise: one `{"conversations": [...]}` document, written
/// one conversation at a time). Returns how many records were written.
pub fn write_jsonl(
    reader: &dyn Query,
    format: ExportFormat,
    filter: &TraceFilter,
    out: &mut dyn Write,
) -> Result<u64, ExportError> {
    let mut lines = Lines {
        out,
        written: 0,
        error: None,
    };
    match format {
        ExportFormat::ProviderTraces => reader.for_each_trace(filter, &mut |t| {
            lines.line(&t.to_export_json());
            Ok(())
        })?,
        ExportFormat::Steps => reader.for_each_step(filter, &mut |s| {
            lines.line(&serde_json::to_value(&s).unwrap_or_default());
            Ok(())
        })?,
        _ => write_trajectories(reader, format, filter, &mut lines)?,
    }
    if let Some(e) = lines.error {
        return Err(e.into());
    }
    lines.out.flush()?;
    Ok(lines.written)
}

/// [`write_jsonl`] with a reader of `store` (blocking).
pub fn write_jsonl_from(
    store: &Store,
    format: ExportFormat,
    filter: &TraceFilter,
    out: &mut dyn Write,
) -> Result<u64, ExportError> {
    let mut result = None;
    store.read(|reader| {
        result = Some(write_jsonl(reader, format, filter, out));
        Ok(())
    })?;
    result.unwrap_or(Ok(0))
}

/// Formats built per trajectory. ATIF and TurnWise embed sub-agents in their parent; the others give each
/// trajectory its own records.
fn write_trajectories(
    reader: &dyn Query,
    format: ExportFormat,
    filter: &TraceFilter,
    lines: &mut Lines<'_>,
) -> Result<(), StoreError> {
    let embeds_children = matches!(format, ExportFormat::Atif | ExportFormat::Turnwise);
    let all: Vec<_> = reader
        .sessions(&TraceFilter::default())?
        .into_iter()
        .map(|r| r.summary)
        .collect();
    let selected = reader.sessions(filter)?;
    let selected_ids: std::collections::HashSet<&str> =
        selected.iter().map(|r| r.summary.trajectory_id.as_str()).collect();
    if format == ExportFormat::Turnwise {
        lines.raw(b"{\"conversations\":[");
    }
    let mut first = true;
    for row in &selected {
        let s = &row.summary;
        let embedded_in_parent = s
            .parent_trajectory_id
            .as_deref()
            .is_some_and(|p| selected_ids.contains(p));
        if embeds_children && embedded_in_parent {
            continue;
        }
        // One trajectory (with its sub-agents when embedded) in memory at a time.
        let mut data = load_trajectory(reader, s.clone(), &all, embeds_children, 0)?;
        if format == ExportFormat::Opentraces {
            // opentraces references sub-agents by id (`subagent_trajectory_ref`): their summaries suffice.
            data.children = child_summaries(&all, &s.trajectory_id);
        }
        match format {
            ExportFormat::Atif => lines.line(&formats::atif(&data)),
            ExportFormat::Invariant => lines.line(&formats::invariant(&data)),
            ExportFormat::Opentraces => lines.line(&formats::opentraces(&data)),
            ExportFormat::Turnwise => {
                if !first {
                    lines.raw(b",");
                }
                lines.value(&formats::turnwise_conversation(&data));
                lines.written += 1;
            }
            ExportFormat::Localharness => {
                let handoffs = all
                    .iter()
                    .filter(|c| c.parent_trajectory_id.as_deref() == Some(s.trajectory_id.as_str()))
                    .filter_map(|c| c.parent_tool_call_id.clone())
                    .collect();
                formats::localharness(&data, &handoffs, |e| lines.line(&e))
            }
            ExportFormat::Letta => {
                let root = otlp::spans::root_trajectory(&s.trajectory_id, |t| {
                    Ok(all
                        .iter()
                        .find(|x| x.trajectory_id == t)
                        .and_then(|x| x.parent_trajectory_id.clone()))
                })?;
                let trace_id = hex(&otlp::spans::trace_id_of(&root));
                let ctx = formats::LettaContext {
                    otel_trace_id: &trace_id,
                };
                // A trace that cannot be read is exported without its provider_trace rather than failing the run.
                formats::letta(&data, &ctx, |id| reader.trace(id).ok().flatten(), |r| lines.line(&r));
            }
            ExportFormat::ProviderTraces | ExportFormat::Steps => {}
        }
        first = false;
    }
    if format == ExportFormat::Turnwise {
        lines.raw(b"]}\n");
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The trajectories `id` started, without their steps.
fn child_summaries(all: &[crate::model::step::TrajectorySummary], id: &str) -> Vec<formats::TrajectoryData> {
    all.iter()
        .filter(|c| c.parent_trajectory_id.as_deref() == Some(id) && c.trajectory_id != id)
        .map(|c| formats::TrajectoryData {
            summary: c.clone(),
            steps: Vec::new(),
            children: Vec::new(),
            annotations: Vec::new(),
        })
        .collect()
}

/// A trajectory's steps and, when `with_children`, the sub-agent trajectories it started (recursively).
fn load_trajectory(
    reader: &dyn Query,
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
    // Its own and its steps' annotations, and those on its session as a whole.
    let session = summary.session_key().to_owned();
    let annotations = reader
        .annotations(std::slice::from_ref(&session), std::slice::from_ref(&id))?
        .into_iter()
        .filter(|a| {
            a.trajectory_id.as_deref() == Some(id.as_str())
                || (a.target == crate::model::annotation::AnnotationTarget::Session && a.target_id == session)
        })
        .collect();
    Ok(formats::TrajectoryData {
        summary,
        steps,
        children,
        annotations,
    })
}
