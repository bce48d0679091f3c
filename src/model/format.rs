//! The file formats llmtap writes (`llmtap export --format`, the gRPC API's `Export`).

use clap::ValueEnum;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExportFormat {
    /// One JSON object per captured HTTP exchange, streams reassembled.
    ProviderTraces,
    /// One JSON object per derived step (opentraces Step fields plus trajectory and trace ids).
    Steps,
    /// One opentraces TraceRecord (schema 0.2.0) per trajectory; sub-agents are their own records.
    Opentraces,
    /// One ATIF v1.7 trajectory per top-level trajectory, sub-agents embedded.
    Atif,
    /// One Invariant trace (a JSON array of OpenAI-style events, metadata first) per trajectory.
    Invariant,
    /// TurnWise dataset: one `{"conversations": [...]}` document, a conversation per top-level trajectory.
    Turnwise,
    /// Letta: one line per LLM call with its Step, StepMetrics, ProviderTrace and step messages.
    Letta,
    /// localharness Step events (text/thought deltas, tool calls, tool results, turn ends), one per line.
    Localharness,
}
