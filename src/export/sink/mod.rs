//! The export seam: a [`Sink`] is what one kind of destination does (turn export-log entries into a request,
//! send it, say how it went); the shared [`driver`] does everything around that, the same way for every sink:
//! cursor → batch → send → retry with jittered exponential backoff (capped server delays) → advance the
//! persisted cursor → shutdown flush deadline → per-sink metrics and episode logging.
//!
//! A new destination is one small file implementing [`Sink`] and one [`driver::Driver`] started for it. OTLP
//! (gRPC, HTTP/protobuf, HTTP/JSON) is `export::otlp::OtlpSink`.
//!
//! Outcomes and what the driver does with them:
//! - [`Accepted`]: count, move the cursor on, end any failure episode.
//! - [`SendError::Retryable`]: keep the batch, wait (the server's delay capped at `retry_max`, else backoff), send
//!   it again; the cursor stays, so nothing is lost even across a restart.
//! - [`SendError::Rejected`]: the destination refused this data for good (OTLP forbids retrying it): count it as
//!   failed and move on.
//! - [`SendError::Unauthorized`]: the destination refused *us* (a wrong token): pause the sink with its cursor
//!   kept, show it in `/metrics`, and probe again every `retry_max` until it accepts.

pub mod driver;
pub mod retry;

use std::future::Future;
use std::time::Duration;

use crate::store::{StoreError, StoreReader};

pub use crate::model::record::ExportEntry as LogEntry;

/// A destination for what the store logs for export.
pub trait Sink: Send + Sync + 'static {
    /// One request's worth of data. It may remember what part of it was already delivered, so that a retry only
    /// sends the rest (OTLP: spans accepted, metrics still to send).
    type Batch: Send + 'static;

    /// Build a batch from export-log entries. Blocking (it reads the store): the driver runs it on the blocking
    /// pool at background priority.
    fn build(&self, reader: &StoreReader, entries: &[LogEntry]) -> Result<Self::Batch, StoreError>;

    /// How many items (spans) a batch carries, for `llmtap_exported_total` and `llmtap_export_failed_total`.
    fn items(&self, batch: &Self::Batch) -> usize;

    /// Deliver the batch (or what is left of it) once. Must finish within the sink's own timeout: the driver
    /// does not know how long a destination may take.
    fn send(&self, batch: &mut Self::Batch) -> impl Future<Output = Result<Accepted, SendError>> + Send;
}

/// The destination took the batch; `rejected` of its items were refused (a partial success: final, never
/// retried).
#[derive(Debug, Default)]
pub struct Accepted {
    pub rejected: u64,
    pub message: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// Worth sending again: the destination is down, slow or throttling, optionally saying when to come back.
    #[error("export failed, will retry: {message}")]
    Retryable {
        message: String,
        retry_after: Option<Duration>,
    },
    /// The destination refused this data for good.
    #[error("export rejected: {message}")]
    Rejected { message: String },
    /// The destination refused our credentials (HTTP 401/403, gRPC UNAUTHENTICATED/PERMISSION_DENIED): a
    /// misconfiguration, not bad data. The message holds no response body (it may echo what we sent).
    #[error("export unauthorized: {message}")]
    Unauthorized { message: String },
}
