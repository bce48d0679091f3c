//! llmtap's own gRPC API (`proto/llmtap/v1/llmtap.proto`): a live subscription to steps and provider traces,
//! and queries over the store; and the web viewer (`viewer`). Both are one axum router (`router`) behind shared
//! layers (`auth`: security headers, cross-site refusal, token or loopback Host), served on `[api] listen` and
//! `[viewer] listen` (loopback by default) from its own runtime (`server`), with bounded, stall-timed streams
//! (`streams`).
//!
//! Live events come from the store's commit feed through a broadcast channel: sending costs nothing when nobody
//! listens, and a slow subscriber skips events (it is told how many) instead of holding the writer back.

pub mod auth;
pub mod replay;
pub mod router;
pub mod server;
pub mod streams;
pub mod viewer;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::broadcast;
use tonic::{Request, Response, Status};

use self::streams::{FedStream, Feed, FeedError, StreamLimit};

use crate::export::formats::LocalharnessStream;
use crate::model::cost::CostBreakdown;
use crate::model::format::ExportFormat;
use crate::model::step::{Step, TrajectorySummary};
use crate::model::trace::TraceHead;
use crate::store::{Store, TraceFilter};
use crate::telemetry::{EpisodeLog, EpisodeReport, Metrics};

#[allow(clippy::all, clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]
pub mod pb {
    tonic::include_proto!("llmtap.v1");
}

pub use crate::store::feed::{LiveEvent, LiveTx, live_channel};

/// A cost as the API sends it: exact decimal strings.
pub fn cost_message(c: &CostBreakdown) -> pb::Cost {
    pb::Cost {
        total: c.total.to_string(),
        input: c.input.to_string(),
        cache_read: c.cache_read.to_string(),
        cache_write: c.cache_write.to_string(),
        output: c.output.to_string(),
        reasoning: c.reasoning.to_string(),
    }
}

pub fn trace_summary(t: &TraceHead) -> pb::TraceSummary {
    let usage = t.usage.unwrap_or_default();
    pb::TraceSummary {
        id: t.id.clone(),
        trajectory_id: t.trajectory_id.clone().unwrap_or_default(),
        session_id: t.session.clone().unwrap_or_default(),
        agent: t.agent.clone().unwrap_or_default(),
        upstream: t.upstream.clone(),
        api: t.api.as_str().to_owned(),
        model: t.model.clone().unwrap_or_default(),
        status: t.status.unwrap_or(0) as u32,
        outcome: t.outcome.as_str().to_owned(),
        duration_ms: (t.timings.end - t.timings.start) as f64 / 1000.0,
        streamed: t.streamed,
        cost: t.cost.as_ref().map(cost_message),
        input_tokens: usage.input,
        output_tokens: usage.output,
        cache_read_tokens: usage.cache_read.unwrap_or(0),
        cache_write_tokens: usage.cache_write.unwrap_or(0),
        reasoning_tokens: usage.reasoning.unwrap_or(0),
        error: t.error.clone().unwrap_or_default(),
    }
}

pub fn step_message(s: &Step) -> pb::Step {
    pb::Step {
        step_id: s.step_id.clone(),
        trajectory_id: s.trajectory_id.clone(),
        session_id: s.session_id.clone().unwrap_or_default(),
        agent: s.agent.clone().unwrap_or_default(),
        step_index: s.step_index,
        role: s.role.as_str().to_owned(),
        call_type: s.call_type.map(|c| c.as_str().to_owned()).unwrap_or_default(),
        model: s.model.clone().unwrap_or_default(),
        content: s.content.clone().unwrap_or_default(),
        tool_calls: s.tool_calls.len() as u32,
        observations: s.observations.len() as u32,
        input_tokens: s.token_usage.input_tokens,
        output_tokens: s.token_usage.output_tokens,
        status: s.status.clone(),
        json: serde_json::to_string(s).unwrap_or_default(),
        purpose: s.purpose.map(|p| p.as_str().to_owned()).unwrap_or_default(),
        cost: s.cost_usd.as_ref().map(cost_message),
    }
}

fn session_message(t: TrajectorySummary) -> pb::Session {
    pb::Session {
        trajectory_id: t.trajectory_id,
        session_id: t.session_id.unwrap_or_default(),
        agent: t.agent.unwrap_or_default(),
        models: t.models,
        steps: t.steps,
        llm_calls: t.llm_calls,
        call_types: t.call_types,
        input_tokens: t.input_tokens,
        output_tokens: t.output_tokens,
        started_at: t.started_at,
        ended_at: t.ended_at,
        parent_trajectory_id: t.parent_trajectory_id.unwrap_or_default(),
        closed: t.closed,
        purpose: t.purpose.map(|p| p.as_str().to_owned()).unwrap_or_default(),
        continues: t.continues.unwrap_or_default(),
        cost: t.cost_usd.as_ref().map(cost_message),
        unpriced_calls: t.unpriced_calls,
        cache_read_tokens: t.cache_read_tokens,
        cache_write_tokens: t.cache_write_tokens,
    }
}

pub struct ApiService {
    /// Where the API reads: the local store, or the team's shared store.
    pub store: Store,
    pub live: LiveTx,
    pub limit: StreamLimit,
    pub metrics: Arc<Metrics>,
    /// Store reads that failed: counted, logged once per episode.
    pub errors: Arc<EpisodeLog>,
}

/// Live events, fed by a forwarding task.
pub type EventStream = FedStream<pb::Event>;
/// Export chunks, fed by the blocking export task.
pub type ChunkStream = FedStream<pb::ExportChunk>;

/// Export chunks waiting for the client: few, so a client that stalls pins little memory.
const EXPORT_BUFFER: usize = 2;
/// Live events waiting for a subscriber before `Feed::send` waits (and, after the stall timeout, drops it).
const SUBSCRIBE_BUFFER: usize = 256;

fn matches(filter: &pb::SubscribeRequest, session: Option<&str>, trajectory: &str, agent: Option<&str>) -> bool {
    (filter.session.is_empty() || session == Some(filter.session.as_str()) || trajectory == filter.session)
        && (filter.agent.is_empty() || agent == Some(filter.agent.as_str()))
}

impl ApiService {
    /// Store reads run on the API runtime's own small blocking pool (see `server`).
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T, crate::store::StoreError> + Send + 'static,
    ) -> Result<T, Status> {
        let result = tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        match result {
            Ok(v) => {
                self.errors.success();
                Ok(v)
            }
            Err(error) => {
                note_error(&self.metrics, &self.errors, &error);
                Err(Status::internal(error))
            }
        }
    }
}

fn note_error(metrics: &Metrics, errors: &EpisodeLog, error: &str) {
    metrics.api_errors.inc();
    match errors.failure() {
        EpisodeReport::First => tracing::warn!(%error, "gRPC API: a store read failed"),
        EpisodeReport::Summary { count } => tracing::warn!(%error, count, "gRPC API: store reads still failing"),
        EpisodeReport::Quiet => {}
    }
}

#[tonic::async_trait]
impl pb::llm_tap_server::LlmTap for ApiService {
    type SubscribeStream = EventStream;
    type ExportStream = ChunkStream;

    async fn export(&self, request: Request<pb::ExportRequest>) -> Result<Response<ChunkStream>, Status> {
        let req = request.into_inner();
        let format = <ExportFormat as clap::ValueEnum>::from_str(&req.format, true)
            .map_err(|_| Status::invalid_argument(format!("unknown export format {:?}", req.format)))?;
        let filter = TraceFilter {
            session: (!req.session.is_empty()).then_some(req.session),
            since_us: parse_time(&req.since, "since")?,
            until_us: parse_time(&req.until, "until")?,
            limit: None,
        };
        let store = self.store.clone();
        let (feed, out) = self.limit.open(EXPORT_BUFFER)?;
        let runtime = tokio::runtime::Handle::current();
        let metrics = self.metrics.clone();
        let errors = self.errors.clone();
        tokio::task::spawn_blocking(move || {
            let mut writer = ChunkWriter {
                buf: Vec::with_capacity(CHUNK),
                feed,
                runtime,
                metrics: metrics.clone(),
                stopped: None,
            };
            // The store reader reads in pages and holds no read transaction while the writer waits for the
            // client, so a slow client delays only its own export.
            let result = crate::export::write_jsonl_from(&store, format, &filter, &mut writer);
            match (result, writer.stopped) {
                (Ok(_), _) => {
                    errors.success();
                }
                // The client left or stalled: nothing to report to it, and not llmtap's failure.
                (Err(_), Some(_)) => {}
                (Err(e), None) => {
                    note_error(&metrics, &errors, &e.to_string());
                    let _ = writer
                        .runtime
                        .block_on(writer.feed.send(Err(Status::internal(e.to_string())), &metrics));
                }
            }
        });
        Ok(Response::new(out))
    }

    async fn subscribe(&self, request: Request<pb::SubscribeRequest>) -> Result<Response<EventStream>, Status> {
        let filter = request.into_inner();
        let (want_steps, want_traces) = match (filter.steps, filter.traces) {
            (false, false) => (true, true),
            other => other,
        };
        let localharness = match filter.format.as_str() {
            "" => None,
            "localharness" => Some(LocalharnessStream::default()),
            other => {
                return Err(Status::invalid_argument(format!(
                    "unknown subscription format {other:?}"
                )));
            }
        };
        let (want_steps, want_traces) = if localharness.is_some() {
            (true, false)
        } else {
            (want_steps, want_traces)
        };
        let mut localharness = localharness;
        let (feed, out) = self.limit.open(SUBSCRIBE_BUFFER)?;
        let metrics = self.metrics.clone();
        let mut rx = self.live.subscribe();
        tokio::spawn(async move {
            let tx = SubscribeFeed { feed, metrics };
            loop {
                let received = tokio::select! {
                    // A client that left while no events flow gives its stream slot back now.
                    () = tx.feed.closed() => return,
                    r = rx.recv() => r,
                };
                let event = match received {
                    Ok(e) => e,
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        let skipped = Status::data_loss(format!("subscriber too slow: {n} events skipped"));
                        if tx.send(Err(skipped)).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                let msg = match event {
                    LiveEvent::Step(s) if want_steps => {
                        if !matches(&filter, s.session_id.as_deref(), &s.trajectory_id, s.agent.as_deref()) {
                            continue;
                        }
                        if let Some(stream) = localharness.as_mut() {
                            let mut events = Vec::new();
                            stream.push(&s, |_| None, &mut events);
                            for e in events {
                                let kind = pb::event::Kind::Localharness(e.to_string());
                                if tx.send(Ok(pb::Event { kind: Some(kind) })).await.is_err() {
                                    return;
                                }
                            }
                            continue;
                        }
                        pb::event::Kind::Step(step_message(&s))
                    }
                    LiveEvent::Trace(t) if want_traces => {
                        let trajectory = t.trajectory_id.as_deref().unwrap_or("");
                        if !matches(&filter, t.session.as_deref(), trajectory, t.agent.as_deref()) {
                            continue;
                        }
                        pb::event::Kind::Trace(trace_summary(&t))
                    }
                    _ => continue,
                };
                if tx.send(Ok(pb::Event { kind: Some(msg) })).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(out))
    }

    async fn list_sessions(
        &self,
        request: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        let req = request.into_inner();
        let store = self.store.clone();
        let rows = self
            .blocking(move || {
                store.read(|reader| {
                    reader.sessions(&TraceFilter {
                        session: (!req.session.is_empty()).then_some(req.session),
                        limit: (req.limit > 0).then_some(req.limit as u64),
                        ..TraceFilter::default()
                    })
                })
            })
            .await?;
        Ok(Response::new(pb::ListSessionsResponse {
            sessions: rows.into_iter().map(|r| session_message(r.summary)).collect(),
        }))
    }

    async fn get_session_steps(
        &self,
        request: Request<pb::GetSessionStepsRequest>,
    ) -> Result<Response<pb::GetSessionStepsResponse>, Status> {
        let req = request.into_inner();
        if req.session.is_empty() {
            return Err(Status::invalid_argument("session is required"));
        }
        let store = self.store.clone();
        let steps = self
            .blocking(move || {
                store.read(|reader| {
                    reader.steps(&TraceFilter {
                        session: Some(req.session),
                        ..TraceFilter::default()
                    })
                })
            })
            .await?;
        Ok(Response::new(pb::GetSessionStepsResponse {
            steps: steps.iter().map(step_message).collect(),
        }))
    }
}

/// The Subscribe forwarding task's end of its stream.
struct SubscribeFeed {
    feed: Feed<pb::Event>,
    metrics: Arc<Metrics>,
}

impl SubscribeFeed {
    async fn send(&self, item: Result<pb::Event, Status>) -> Result<(), FeedError> {
        self.feed.send(item, &self.metrics).await
    }
}

/// An `io::Write` that hands whole lines to the gRPC stream in chunks of about `CHUNK` bytes. A client that went
/// away or stalled turns into a write error, which stops the export.
struct ChunkWriter {
    buf: Vec<u8>,
    feed: Feed<pb::ExportChunk>,
    /// The API runtime: the writer runs on one of its blocking threads and waits there for the client.
    runtime: tokio::runtime::Handle,
    metrics: Arc<Metrics>,
    /// Why the client stopped the export, when it did.
    stopped: Option<FeedError>,
}

const CHUNK: usize = 64 * 1024;

impl ChunkWriter {
    fn send(&mut self, upto: usize) -> std::io::Result<()> {
        let rest = self.buf.split_off(upto);
        let data = std::mem::replace(&mut self.buf, rest);
        let sent = self
            .runtime
            .block_on(self.feed.send(Ok(pb::ExportChunk { data }), &self.metrics));
        sent.map_err(|e| {
            self.stopped = Some(e);
            std::io::Error::new(std::io::ErrorKind::BrokenPipe, e)
        })
    }
}

impl std::io::Write for ChunkWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK
            && let Some(end) = self.buf.iter().rposition(|b| *b == b'\n')
        {
            self.send(end + 1)?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        self.send(self.buf.len())
    }
}

fn parse_time(s: &str, what: &str) -> Result<Option<i64>, Status> {
    if s.is_empty() {
        return Ok(None);
    }
    chrono::DateTime::parse_from_rfc3339(s)
        .map(|d| Some(d.timestamp_micros()))
        .map_err(|_| Status::invalid_argument(format!("{what} {s:?} is not an RFC 3339 time")))
}

/// Accepted connections as the stream tonic's server wants.
pub fn incoming(listener: tokio::net::TcpListener) -> Incoming {
    Incoming(listener)
}

pub struct Incoming(tokio::net::TcpListener);

impl futures_core::Stream for Incoming {
    type Item = std::io::Result<tokio::net::TcpStream>;
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_accept(cx).map(|r| Some(r.map(|(s, _)| s)))
    }
}
