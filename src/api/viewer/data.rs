//! What the viewer's pages show, as JSON: the only module of the viewer that reads the store. Every function
//! reads one page (a page of sessions, of a trajectory's steps, one call's bodies), never a whole session's
//! bodies. Costs are the ones the pipeline stored with each call; a call whose price is unknown is counted as
//! unknown, never as $0.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rust_decimal::Decimal;
use serde_json::{Map, Value, json};

use crate::model::cost::CostBreakdown;
use crate::model::exchange::{Api, Outcome};
use crate::model::step::{Step, TrajectorySummary};
use crate::model::trace::{ProviderTrace, rfc3339};
use crate::model::usage::Usage;
use crate::proxy::redact::Redactor;
use crate::store::{CallHead, SessionQuery, StoreError, StoreReader, TrajectoryLinks};

/// What the data functions need besides the store.
pub struct Context {
    /// Upstream name → base URL, for "copy as curl".
    pub upstreams: BTreeMap<String, String>,
    /// Decides which header names carry secrets (never rendered, not even redacted).
    pub redactor: Redactor,
}

/// One page of top-level sessions (newest first) with their totals over every trajectory below them.
pub fn list_sessions(reader: &StoreReader, query: &SessionQuery) -> Result<Value, StoreError> {
    let roots = reader.root_trajectories(query)?;
    let links = reader.trajectory_links()?;
    let children = children_of(&links);
    let mut rows = Vec::with_capacity(roots.len());
    for (_, root) in &roots {
        let tree = descendants(&root.trajectory_id, &children);
        let mut totals = Totals::default();
        for id in &tree {
            for call in reader.call_heads(id)? {
                totals.add(&call);
            }
        }
        rows.push(json!({
            "id": root.trajectory_id,
            "session_id": root.session_id,
            "agent": root.agent,
            "models": totals.models.iter().collect::<Vec<_>>(),
            "started_at": root.started_at,
            "trajectories": tree.len(),
            "closed": root.closed,
            "totals": totals.to_json(),
        }));
    }
    let next = match roots.last() {
        Some((started, last)) if roots.len() as u32 >= query.limit => Some(format!("{started}:{}", last.trajectory_id)),
        _ => None,
    };
    Ok(json!({ "sessions": rows, "next": next }))
}

/// A session: the trajectory tree under the top-level trajectory `id` belongs to, each with its totals.
pub fn session(reader: &StoreReader, id: &str) -> Result<Option<Value>, StoreError> {
    let links = reader.trajectory_links()?;
    let root = root_of(id, &links);
    let Some(root_summary) = reader.trajectory_light(&root)? else {
        return Ok(None);
    };
    let children = children_of(&links);
    let mut all = Totals::default();
    let mut trajectories = Vec::new();
    for tid in descendants(&root, &children) {
        let summary = if tid == root {
            root_summary.clone()
        } else {
            match reader.trajectory_light(&tid)? {
                Some(s) => s,
                None => continue,
            }
        };
        let mut totals = Totals::default();
        for call in reader.call_heads(&tid)? {
            totals.add(&call);
            all.add(&call);
        }
        trajectories.push(trajectory_json(&summary, &totals));
    }
    Ok(Some(json!({
        "id": root,
        "agent": root_summary.agent,
        "session_id": root_summary.session_id,
        "started_at": root_summary.started_at,
        "totals": all.to_json(),
        "trajectories": trajectories,
        "exports": export_links(&root),
    })))
}

fn trajectory_json(s: &TrajectorySummary, totals: &Totals) -> Value {
    json!({
        "id": s.trajectory_id,
        "agent": s.agent,
        "models": s.models,
        "steps": s.steps,
        "llm_calls": s.llm_calls,
        "call_types": s.call_types,
        "started_at": s.started_at,
        "ended_at": s.ended_at,
        "parent_trajectory_id": s.parent_trajectory_id,
        "parent_step": s.parent_step,
        "parent_tool_call_id": s.parent_tool_call_id,
        "continues": s.continues,
        "closed": s.closed,
        // Warmups and other side calls: shown dimmed. A trajectory made only of them is a side trajectory.
        "side": !s.call_types.is_empty() && s.call_types.iter().all(|c| c != "main" && c != "subagent"),
        "totals": totals.to_json(),
    })
}

/// A page of a trajectory's steps after `after`, each agent step with its cost.
pub fn steps(reader: &StoreReader, trajectory: &str, after: Option<u32>, limit: u32) -> Result<Value, StoreError> {
    let page = reader.steps_page(trajectory, after, limit)?;
    let next = (page.len() as u32 >= limit)
        .then(|| page.last().map(|s| s.step_index))
        .flatten();
    let mut steps = Vec::with_capacity(page.len());
    for s in &page {
        let head = match &s.provider_trace_id {
            Some(id) if s.role == crate::model::step::StepRole::Agent => reader.call_head(id)?,
            _ => None,
        };
        steps.push(step_json(s, head.as_ref()));
    }
    Ok(json!({ "steps": steps, "next": next }))
}

/// A step with the cost of the call it came from (priced like the call page: from the stored trace's usage).
fn step_json(s: &Step, call: Option<&CallHead>) -> Value {
    let mut v = serde_json::to_value(s).unwrap_or(Value::Null);
    if let (Value::Object(map), Some(c)) = (&mut v, call) {
        map.insert("cost".into(), head_cost(c));
    }
    v
}

fn head_cost(c: &CallHead) -> Value {
    cost_json(c.usage.as_ref(), c.cost.as_ref())
}

/// One call: what is new in its request compared with the trajectory's previous call, its raw bodies, headers
/// without secrets, timings, usage, cost, a curl command and the session's export links.
pub fn call(reader: &StoreReader, ctx: &Context, trace_id: &str) -> Result<Option<Value>, StoreError> {
    let Some(trace) = reader.trace(trace_id)? else {
        return Ok(None);
    };
    let previous = reader.previous_call(&trace)?;
    let step = reader.step_for_trace(trace_id)?;
    let root = match &trace.trajectory_id {
        Some(t) => Some(root_of(t, &reader.trajectory_links()?)),
        None => None,
    };
    let request = trace.request.to_value();
    let prev_request = previous.as_ref().map(|p| p.request.to_value());
    let t = &trace.timings;
    let cost = cost_json(trace.usage.as_ref(), trace.cost.as_ref());
    Ok(Some(json!({
        "id": trace.id,
        "trajectory_id": trace.trajectory_id,
        "session": root,
        "step": step.map(|s| json!({"step_id": s.step_id, "step_index": s.step_index})),
        "previous_call": previous.as_ref().map(|p| p.id.clone()),
        "upstream": trace.upstream,
        "provider": crate::provider::otel_provider_name(trace.api, &trace.upstream),
        "api": trace.api.as_str(),
        "method": trace.method,
        "path": trace.path,
        "status": trace.status,
        "outcome": trace.outcome.as_str(),
        "error": trace.error,
        "streamed": trace.streamed,
        "model": trace.model,
        "timings": {
            "started_at": rfc3339(t.start),
            "ended_at": rfc3339(t.end),
            "duration_ms": (t.end - t.start) as f64 / 1000.0,
            "time_to_first_byte_ms": t.first_byte.map(|f| (f - t.start) as f64 / 1000.0),
        },
        "usage": trace.usage,
        "cost": cost,
        "request": request_delta(trace.api, &request, prev_request.as_ref()),
        "request_headers": visible_headers(ctx, &trace.request_headers),
        "response_headers": visible_headers(ctx, &trace.response_headers),
        "raw_request": request,
        "raw_response": trace.response.to_value(),
        "raw_stream": trace.raw_response,
        "curl": curl(ctx, &trace),
        "exports": root.as_deref().map(export_links),
    })))
}

/// The request split into what is new since the previous call (`new_messages`), how many messages were already
/// there (`history`), the tool definitions and system prompt (shown collapsed), and the remaining parameters.
fn request_delta(api: Api, request: &Value, previous: Option<&Value>) -> Value {
    let key = match api {
        Api::GeminiGenerateContent => "contents",
        Api::OpenAiResponses => "input",
        _ => "messages",
    };
    let Value::Object(obj) = request else {
        return json!({ "new_messages": [], "history": 0, "params": request });
    };
    let messages = obj.get(key).and_then(Value::as_array).cloned().unwrap_or_default();
    let before = previous
        .and_then(|p| p.get(key))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let history = messages.iter().zip(&before).take_while(|(a, b)| a == b).count();
    let mut params = Map::new();
    for (k, v) in obj {
        if k != key && k != "tools" && k != "system" && k != "systemInstruction" && k != "instructions" {
            params.insert(k.clone(), v.clone());
        }
    }
    let system = obj
        .get("system")
        .or_else(|| obj.get("systemInstruction"))
        .or_else(|| obj.get("instructions"));
    let new_messages = match obj.get(key) {
        Some(Value::String(text)) => json!([{"role": "user", "content": text}]),
        _ => Value::Array(messages[history..].to_vec()),
    };
    json!({
        "new_messages": new_messages,
        "history": history,
        "system": system,
        "tools": obj.get("tools").cloned().unwrap_or(Value::Array(Vec::new())),
        "params": params,
    })
}

/// Headers safe to render: secret ones are left out entirely (the store holds them redacted already).
fn visible_headers(ctx: &Context, headers: &[(String, String)]) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(k, _)| !is_secret_header(ctx, k))
        .cloned()
        .collect()
}

fn is_secret_header(ctx: &Context, name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    ctx.redactor.is_secret_name(lower.as_bytes())
        || matches!(
            lower.as_str(),
            "authorization" | "proxy-authorization" | "x-api-key" | "api-key" | "x-goog-api-key" | "cookie"
        )
}

/// A curl command repeating the request against the provider. The key is a shell variable placeholder; only
/// content headers are copied.
fn curl(ctx: &Context, trace: &ProviderTrace) -> String {
    let base = ctx
        .upstreams
        .get(&trace.upstream)
        .map_or("https://PROVIDER", String::as_str);
    let url = format!("{}{}", base.trim_end_matches('/'), trace.path);
    let env = format!(
        "{}_API_KEY",
        trace.upstream.to_ascii_uppercase().replace(['-', '.'], "_")
    );
    let key_header = match trace.api {
        Api::AnthropicMessages => format!("x-api-key: ${env}"),
        Api::GeminiGenerateContent => format!("x-goog-api-key: ${env}"),
        _ => format!("authorization: Bearer ${env}"),
    };
    let mut cmd = format!(
        "curl -sS -X {} '{}' \\\n  -H \"{key_header}\"",
        trace.method,
        url.replace('\'', "%27")
    );
    for (k, v) in &trace.request_headers {
        let lower = k.to_ascii_lowercase();
        if matches!(
            lower.as_str(),
            "content-type" | "anthropic-version" | "anthropic-beta" | "accept"
        ) && !is_secret_header(ctx, &lower)
        {
            cmd.push_str(&format!(" \\\n  -H '{}: {}'", lower, v.replace('\'', "'\\''")));
        }
    }
    let body = trace.request.as_str();
    if !body.is_empty() && body != "null" {
        cmd.push_str(" \\\n  --data-binary @- <<'LLMTAP_EOF'\n");
        cmd.push_str(body);
        cmd.push_str("\nLLMTAP_EOF");
    }
    cmd
}

/// The viewer's download URL for each `llmtap export --format` format of a session.
fn export_links(session: &str) -> Value {
    let formats: Vec<Value> = <crate::model::format::ExportFormat as clap::ValueEnum>::value_variants()
        .iter()
        .filter_map(clap::ValueEnum::to_possible_value)
        .map(|p| {
            let name = p.get_name().to_owned();
            json!({ "format": name, "url": format!("api/export/{name}?session={}", urlencode(session)) })
        })
        .collect();
    Value::Array(formats)
}

fn urlencode(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// A call's stored cost as JSON: the breakdown in dollars (decimal strings), `{"unknown": reason}` when it was
/// not priced, null for a call without usage (nothing was billed in tokens).
fn cost_json(usage: Option<&Usage>, cost: Option<&CostBreakdown>) -> Value {
    match (usage, cost) {
        (None, _) => Value::Null,
        (Some(_), Some(c)) => serde_json::to_value(c).unwrap_or(Value::Null),
        (Some(_), None) => json!({ "unknown": "no price for this model and date" }),
    }
}

/// Totals over calls: tokens, errors, cost (known part and how many calls had an unknown price).
#[derive(Default)]
struct Totals {
    calls: u64,
    input: u64,
    output: u64,
    cache_read: u64,
    cache_write: u64,
    errors: u64,
    cost: Decimal,
    priced: u64,
    unpriced: u64,
    models: BTreeSet<String>,
    started: Option<i64>,
    ended: Option<i64>,
}

impl Totals {
    fn add(&mut self, c: &CallHead) {
        self.calls += 1;
        if c.status.is_some_and(|s| s >= 400) || c.outcome == Outcome::UpstreamError {
            self.errors += 1;
        }
        self.started = Some(self.started.map_or(c.timings.start, |s| s.min(c.timings.start)));
        self.ended = Some(self.ended.map_or(c.timings.end, |e| e.max(c.timings.end)));
        if let Some(m) = &c.model {
            self.models.insert(m.clone());
        }
        // A call without usage (an error, a non-LLM endpoint) was not billed for tokens: nothing to price.
        let Some(u) = &c.usage else { return };
        self.input += u.input;
        self.output += u.output;
        self.cache_read += u.cache_read.unwrap_or(0);
        self.cache_write += u.cache_write.unwrap_or(0);
        match &c.cost {
            Some(cost) => {
                self.cost += cost.total;
                self.priced += 1;
            }
            None => self.unpriced += 1,
        }
    }

    fn to_json(&self) -> Value {
        json!({
            "calls": self.calls,
            "input_tokens": self.input,
            "output_tokens": self.output,
            "cache_read_tokens": self.cache_read,
            "cache_write_tokens": self.cache_write,
            "errors": self.errors,
            // null when no call could be priced: unknown, not $0.
            "cost_usd": (self.priced > 0).then(|| self.cost.normalize().to_string()),
            "unpriced_calls": self.unpriced,
            "duration_ms": match (self.started, self.ended) {
                (Some(s), Some(e)) => Some((e - s) as f64 / 1000.0),
                _ => None,
            },
        })
    }
}

fn children_of(links: &TrajectoryLinks) -> HashMap<&str, Vec<&str>> {
    let mut children: HashMap<&str, Vec<&str>> = HashMap::new();
    for (id, (parent, continues)) in links {
        for p in [parent, continues].into_iter().flatten() {
            children.entry(p.as_str()).or_default().push(id.as_str());
        }
    }
    for list in children.values_mut() {
        list.sort_unstable();
    }
    children
}

/// `root` and every trajectory below it (sub-agents, continuations), root first.
fn descendants(root: &str, children: &HashMap<&str, Vec<&str>>) -> Vec<String> {
    let mut out = vec![root.to_owned()];
    let mut i = 0;
    while i < out.len() {
        if let Some(list) = children.get(out[i].as_str()) {
            for c in list {
                // Links form a forest; the check keeps a corrupt cycle from looping.
                if !out.iter().any(|o| o == c) {
                    out.push((*c).to_owned());
                }
            }
        }
        i += 1;
    }
    out
}

/// The top-level trajectory above `id`.
fn root_of(id: &str, links: &TrajectoryLinks) -> String {
    let mut cur = id.to_owned();
    for _ in 0..links.len() + 1 {
        match links.get(&cur) {
            Some((Some(parent), _)) | Some((None, Some(parent))) => cur = parent.clone(),
            _ => break,
        }
    }
    cur
}
