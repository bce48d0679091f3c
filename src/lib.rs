//! llmtap: a transparent proxy for LLM provider APIs that captures every call, derives agent steps and
//! trajectories from the traffic alone, and keeps them in an embedded store for export.
//!
//! Module map, lowest layer first; a module uses only modules of its own layer or below
//! (`tests/module_graph.rs` fails on an upward import):
//! - [`model`]: canonical types (the exchange vocabulary, calls, usage, traces, steps, records, export formats).
//! - [`telemetry`], [`config`], [`cost`]: counters and logging, configuration, prices.
//! - [`background`]: what every thread off the data path does to stay out of its way.
//! - [`capture`]: the data path ↔ pipeline contract (`RawExchange`), the capture budget, SSE framing, decoding.
//! - [`provider`]: one adapter per wire protocol (reassemble streams, normalize calls). Pure.
//! - [`proxy`]: the data path. hyper server, routing, rustls client, `TapBody` tee. Only `try_send`s.
//! - [`derive`]: trajectories, steps, observations, sub-agents; owns cross-call state.
//! - [`store`]: SQLite (WAL) writer thread and readers.
//! - [`pipeline`]: the pipeline thread: process (decode, reassemble, normalize) → derive → store, and the live feed.
//! - [`export`]: sinks (OTLP) and file formats read from the store.
//! - [`api`]: llmtap's own gRPC API (live subscription, queries, exports).
//! - [`cli`], [`app`]: wiring; [`allocator`]: giving freed memory back when threads go idle; [`semconv`]: the
//!   OpenTelemetry GenAI names.

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
