//! llmtap: a transparent proxy for LLM provider APIs that captures every call, derives agent steps and
//! trajectories from the traffic alone, and keeps them in an embedded store for export.
//!
//! Module map (data flows top to bottom):
//! - [`proxy`]: the data path. hyper server, routing, rustls client, `TapBody` tee. Only `try_send`s.
//! - [`capture`]: the data path ↔ pipeline contract (`RawExchange`), SSE framing, body decoding.
//! - [`pipeline`]: the pipeline thread: process (decode, reassemble, normalize) → derive → store.
//! - [`provider`]: one adapter per wire protocol (reassemble streams, normalize calls). Pure.
//! - [`derive`]: trajectories, steps, observations, sub-agents; owns cross-call state.
//! - [`model`]: canonical types (calls, usage, traces, steps).
//! - [`store`]: SQLite (WAL) writer thread and readers.
//! - [`export`]: JSONL exports read from the store.
//! - [`api`]: llmtap's own gRPC API (live subscription, queries).
//! - [`config`], [`cli`], [`app`], [`telemetry`], [`background`]: wiring, self-observability, background threads; [`allocator`]: giving freed
//!   memory back when threads go idle.

pub mod allocator;
pub mod api;
pub mod app;
pub mod background;
pub mod capture;
pub mod cli;
pub mod config;
pub mod cost;
pub mod derive;
pub mod export;
pub mod model;
pub mod pipeline;
pub mod provider;
pub mod proxy;
pub mod semconv;
pub mod store;
pub mod telemetry;
