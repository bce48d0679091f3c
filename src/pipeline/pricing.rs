//! Pricing a processed call: its cost from the model that answered, its usage and its start time, on the
//! pipeline thread (never on the data path), before derivation sums it into the step and trajectory.

use crate::cost::CostTable;
use crate::model::call::NormalizedCall;
use crate::model::trace::ProviderTrace;
use crate::telemetry::Metrics;

/// Set `trace.cost` and count it in `/metrics`. Exchanges that are not LLM calls (no normalized call: a model
/// list, an unknown endpoint) are neither priced nor counted. A call without usage or without a price keeps
/// `cost: None` (unknown), counted as such.
pub fn price(table: &CostTable, trace: &mut ProviderTrace, call: Option<&NormalizedCall>, metrics: &Metrics) {
    if call.is_none() {
        return;
    }
    // A Bedrock path's model id is what AWS bills (its inference profile's geography sets the price).
    let billed = crate::provider::cloud::billed_model(&trace.path);
    let model = billed.as_deref().or(trace.model.as_deref()).unwrap_or("");
    trace.cost = match (&trace.usage, model.is_empty()) {
        (Some(usage), false) => table
            .cost(
                crate::provider::otel_provider_name(trace.api, &trace.upstream, &trace.path, trace.model.as_deref()),
                model,
                trace.timings.start,
                usage,
            )
            .ok()
            .map(|c| c.usd),
        _ => None,
    };
    let label = if model.is_empty() { "unknown" } else { model };
    metrics.costs.record(label, trace.cost.map(|c| c.total));
}
