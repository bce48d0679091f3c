//! What the viewer's pages show, as JSON: the only module of the viewer that reads the store. Every function
//! reads one page (a page of sessions, of a trajectory's steps, one call's bodies), never a whole session's
//! bodies. Costs are the ones the pipeline stored with each call; a call whose price is unknown is counted as
//! unknown, never as $0.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rust_decimal::Decimal;
use serde_json::{Map, Value, json};

use crate::derive::context;
use crate::model::annotation::{Annotation, AnnotationTarget};
use crate::model::cost::CostBreakdown;
use crate::model::exchange::{Api, Outcome};
use crate::model::step::{Purpose, Step, StepRole, TrajectorySummary, session_title};
use crate::model::trace::{ProviderTrace, rfc3339};
use crate::model::usage::Usage;
use crate::proxy::redact::Redactor;
use crate::store::{CallHead, Query, SessionQuery, StoreError};

use super::diff;
use crate::api::replay::key_variable;

/// What the data functions need besides the store.
pub struct Context {
    /// Upstream name → base URL, for "copy as curl".
    pub upstreams: BTreeMap<String, String>,
    /// Decides which header names carry secrets (never rendered, not even redacted).
    pub redactor: Redactor,
    /// Where replays are sent (this llmtap's proxy) when `[viewer] replay` is on; None: replay is off.
    pub replay_proxy: Option<std::net::SocketAddr>,
}

/// One page of sessions (newest first), one row per session id, with totals over every trajectory of the
/// session: main runs, sub-agents, continuations, side calls, titles, warmups and quota probes.
pub fn list_sessions(reader: &dyn Query, query: &SessionQuery) -> Result<Value, StoreError> {
    let heads = reader.session_page(query)?;
    // The page's trajectories, then all their calls: two reads for the page, whatever its length.
    let keys: Vec<String> = heads.iter().map(|h| h.session.clone()).collect();
    let per_session = reader.trajectories_of_sessions(&keys)?;
    let ids: Vec<String> = per_session
        .iter()
        .flatten()
        .map(|(_, t)| t.trajectory_id.clone())
        .collect();
    let mut calls = reader.call_heads_of(&ids)?.into_iter();
    let notes = reader.annotations(&keys, &ids)?;
    let mut rows = Vec::with_capacity(heads.len());
    for (head, trajectories) in heads.iter().zip(per_session) {
        let mut totals = Totals::default();
        for _ in &trajectories {
            for call in calls.next().unwrap_or_default() {
                totals.add(&call);
            }
        }
        let summaries: Vec<&TrajectorySummary> = trajectories.iter().map(|(_, t)| t).collect();
        let lead = lead_trajectory(&summaries);
        rows.push(json!({
            "id": head.session,
            "session_id": head.session,
            "agent": lead.and_then(|t| t.agent.clone()),
            "title": session_title(summaries.iter().copied()),
            "models": totals.models.iter().collect::<Vec<_>>(),
            "started_at": rfc3339(head.started_us),
            "trajectories": trajectories.len(),
            "side_trajectories": summaries.iter().filter(|t| is_dimmed(t)).count(),
            "closed": summaries.iter().all(|t| t.closed),
            "totals": totals.to_json(),
            "annotations": annotations_in(&notes, &head.session, &summaries),
        }));
    }
    let next = match heads.last() {
        Some(last) if heads.len() as u32 >= query.limit => Some(format!("{}:{}", last.started_us, last.session)),
        _ => None,
    };
    Ok(json!({ "sessions": rows, "next": next }))
}

/// A session: every trajectory with its session id, arranged as a tree (see [`arrange`]), each with its totals.
/// `id` is a session id or the id of one of its trajectories (then `focus` names it, for the page to select).
pub fn session(reader: &dyn Query, id: &str) -> Result<Option<Value>, StoreError> {
    let Some(session) = reader.session_of(id)? else {
        return Ok(None);
    };
    let rows = reader.session_trajectories(&session)?;
    if rows.is_empty() {
        return Ok(None);
    }
    let summaries: Vec<&TrajectorySummary> = rows.iter().map(|(_, t)| t).collect();
    let mut all = Totals::default();
    let mut trajectories = Vec::with_capacity(rows.len());
    for node in arrange(&summaries) {
        let summary = summaries[node.index];
        let mut totals = Totals::default();
        for call in reader.call_heads(&summary.trajectory_id)? {
            totals.add(&call);
            all.add(&call);
        }
        let mut v = trajectory_json(summary, &totals);
        if let Value::Object(map) = &mut v {
            map.insert("under".into(), json!(node.under.map(|i| &summaries[i].trajectory_id)));
            map.insert("depth".into(), json!(node.depth));
            map.insert("run".into(), json!(node.run));
        }
        trajectories.push(v);
    }
    let lead = lead_trajectory(&summaries);
    let focus = summaries.iter().any(|t| t.trajectory_id == id).then_some(id);
    let ids: Vec<String> = summaries.iter().map(|t| t.trajectory_id.clone()).collect();
    let notes = reader.annotations(std::slice::from_ref(&session), &ids)?;
    Ok(Some(json!({
        "id": session,
        "session_id": session,
        "focus": focus,
        "agent": lead.and_then(|t| t.agent.clone()),
        "title": session_title(summaries.iter().copied()),
        "started_at": rows.first().map(|(started, _)| rfc3339(*started)),
        "totals": all.to_json(),
        "trajectories": trajectories,
        "exports": export_links(&session),
        "annotations": annotations_in(&notes, &session, &summaries),
    })))
}

/// The annotations of `notes` made in `session` or on one of its trajectories (or their steps), as JSON.
fn annotations_in(notes: &[Annotation], session: &str, trajectories: &[&TrajectorySummary]) -> Value {
    Value::Array(
        notes
            .iter()
            .filter(|a| {
                a.session_id == session
                    || a.trajectory_id
                        .as_deref()
                        .is_some_and(|t| trajectories.iter().any(|x| x.trajectory_id == t))
            })
            .map(super::annotations::annotation_json)
            .collect(),
    )
}

fn trajectory_json(s: &TrajectorySummary, totals: &Totals) -> Value {
    json!({
        "id": s.trajectory_id,
        "agent": s.agent,
        "models": s.models,
        "steps": s.steps,
        "llm_calls": s.llm_calls,
        "call_types": s.call_types,
        "purpose": s.purpose.map(|p| p.as_str()),
        "title": s.title,
        "started_at": s.started_at,
        "ended_at": s.ended_at,
        "parent_trajectory_id": s.parent_trajectory_id,
        "parent_step": s.parent_step,
        "parent_tool_call_id": s.parent_tool_call_id,
        "continues": s.continues,
        "closed": s.closed,
        "side": is_dimmed(s),
        "totals": totals.to_json(),
    })
}

/// Shown dimmed: side calls, titles, warmups, quota probes (`TrajectorySummary::is_auxiliary`) and compaction
/// summaries. A row written before trajectories had a purpose is dimmed when none of its calls is a main or
/// sub-agent call.
fn is_dimmed(s: &TrajectorySummary) -> bool {
    match s.purpose {
        Some(p) => p.is_auxiliary() || p == Purpose::Compaction,
        None => !s.call_types.is_empty() && s.call_types.iter().all(|c| c != "main" && c != "subagent"),
    }
}

/// The trajectory that names a session (its agent): the first one not dimmed, else the first.
fn lead_trajectory<'a>(trajectories: &[&'a TrajectorySummary]) -> Option<&'a TrajectorySummary> {
    trajectories
        .iter()
        .find(|t| !is_dimmed(t))
        .or_else(|| trajectories.first())
        .copied()
}

/// A trajectory's place in a session's tree.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TreeNode {
    /// Index into the session's trajectories.
    index: usize,
    /// The node it is shown under (None: a top-level run).
    under: Option<usize>,
    depth: usize,
    /// 1, 2, ... for the top-level runs when the session has more than one (`claude -p` twice in one
    /// session), None otherwise.
    run: Option<usize>,
}

/// A session's trajectories (oldest first) in the order the page shows them, depth first:
/// - top-level runs: trajectories not dimmed with no parent or continued trajectory in the session;
/// - under each, its sub-agents and continuations (`TrajectorySummary::tree_parent`), oldest first;
/// - then, still under the run, the dimmed trajectories without a parent (warmups, quota probes, titles,
///   side calls) that started while it was the latest run (those before the first run go under the first);
/// - a session with no run shows its dimmed trajectories at the top level. Trajectories caught in a corrupt
///   link cycle come last, at the top level.
fn arrange(trajectories: &[&TrajectorySummary]) -> Vec<TreeNode> {
    let index: HashMap<&str, usize> = trajectories
        .iter()
        .enumerate()
        .map(|(i, t)| (t.trajectory_id.as_str(), i))
        .collect();
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); trajectories.len()];
    let mut runs = Vec::new();
    let mut loose = Vec::new();
    for (i, t) in trajectories.iter().enumerate() {
        match t.tree_parent().and_then(|p| index.get(p).copied()) {
            Some(p) if p != i => children[p].push(i),
            _ if is_dimmed(t) => loose.push(i),
            _ => runs.push(i),
        }
    }
    // Loose side trajectories join the latest run started before them (input is oldest first).
    let mut side_of: Vec<Vec<usize>> = vec![Vec::new(); trajectories.len()];
    let mut top = Vec::new();
    for i in loose {
        match runs.iter().rev().find(|&&r| r < i).or(runs.first()) {
            Some(&r) => side_of[r].push(i),
            None => top.push(i),
        }
    }
    let numbered = runs.len() > 1;
    let mut walk = TreeWalk {
        children: &children,
        side_of: &side_of,
        seen: vec![false; trajectories.len()],
        out: Vec::with_capacity(trajectories.len()),
    };
    for (n, &r) in runs.iter().enumerate() {
        walk.visit(r, None, 0, numbered.then_some(n + 1));
    }
    for &i in &top {
        walk.visit(i, None, 0, None);
    }
    for i in 0..trajectories.len() {
        walk.visit(i, None, 0, None);
    }
    walk.out
}

/// A depth-first walk of the arranged tree; `seen` keeps a corrupt link cycle from looping.
struct TreeWalk<'a> {
    children: &'a [Vec<usize>],
    side_of: &'a [Vec<usize>],
    seen: Vec<bool>,
    out: Vec<TreeNode>,
}

impl TreeWalk<'_> {
    fn visit(&mut self, i: usize, under: Option<usize>, depth: usize, run: Option<usize>) {
        if self.seen[i] {
            return;
        }
        self.seen[i] = true;
        self.out.push(TreeNode {
            index: i,
            under,
            depth,
            run,
        });
        let (children, side_of) = (self.children, self.side_of);
        for &c in children[i].iter().chain(&side_of[i]) {
            self.visit(c, Some(i), depth + 1, None);
        }
    }
}

/// A page of a trajectory's steps after `after`, each agent step with its cost.
pub fn steps(reader: &dyn Query, trajectory: &str, after: Option<u32>, limit: u32) -> Result<Value, StoreError> {
    let page = reader.steps_page(trajectory, after, limit)?;
    let next = (page.len() as u32 >= limit)
        .then(|| page.last().map(|s| s.step_index))
        .flatten();
    let notes = reader.annotations(&[], &[trajectory.to_owned()])?;
    let mut steps = Vec::with_capacity(page.len());
    for s in &page {
        let head = match &s.provider_trace_id {
            Some(id) if s.role == crate::model::step::StepRole::Agent => reader.call_head(id)?,
            _ => None,
        };
        let mut v = step_json(s, head.as_ref());
        if let Value::Object(map) = &mut v {
            let own: Vec<Value> = notes
                .iter()
                .filter(|a| a.target == AnnotationTarget::Step && a.target_id == s.step_id)
                .map(super::annotations::annotation_json)
                .collect();
            map.insert("annotations".into(), Value::Array(own));
        }
        steps.push(v);
    }
    Ok(json!({ "steps": steps, "next": next }))
}

/// A step with the cost of the call it came from (priced like the call page: from the stored trace's usage),
/// and, where a user turn or a tool result holds context the client injected (`derive::context`), its text in
/// `content_parts` (the person's text and the injected blocks with a summary line) for the page to fold.
fn step_json(s: &Step, call: Option<&CallHead>) -> Value {
    let mut v = serde_json::to_value(s).unwrap_or(Value::Null);
    let Value::Object(map) = &mut v else { return v };
    if let Some(c) = call {
        map.insert("cost".into(), head_cost(c));
    }
    if s.role == StepRole::User
        && let Some(parts) = s.content.as_deref().and_then(injected_parts)
    {
        map.insert("content_parts".into(), parts);
    }
    if let Some(Value::Array(observations)) = map.get_mut("observations") {
        for (o, stored) in observations.iter_mut().zip(&s.observations) {
            if let (Value::Object(o), Some(parts)) = (o, stored.content.as_deref().and_then(injected_parts)) {
                o.insert("content_parts".into(), parts);
            }
        }
    }
    v
}

/// `text` as segments when it holds an injected block; None when it is all the person's (the page shows
/// `content` as it is).
fn injected_parts(text: &str) -> Option<Value> {
    let segments = context::segments(text);
    segments
        .iter()
        .any(|s| s.injected.is_some())
        .then(|| serde_json::to_value(&segments).unwrap_or(Value::Null))
}

/// What changed in call `id`'s request since `against` (default: the previous call of its trajectory), as
/// `diff::requests` says; `against` null when there is none to compare with.
pub fn call_diff(reader: &dyn Query, id: &str, against: Option<&str>) -> Result<Option<Value>, StoreError> {
    let Some(trace) = reader.trace(id)? else {
        return Ok(None);
    };
    let other = match against {
        Some(a) => match reader.trace(a)? {
            Some(t) => Some(t),
            None => return Ok(None),
        },
        None => reader.previous_call(&trace)?,
    };
    let new = trace.request.to_value();
    let (against_id, diff) = match &other {
        Some(o) => (
            Some(o.id.clone()),
            diff::requests(trace.api, &o.request.to_value(), &new),
        ),
        // The first call: everything is added.
        None => (None, diff::requests(trace.api, &Value::Null, &new)),
    };
    Ok(Some(json!({
        "id": trace.id,
        "trajectory_id": trace.trajectory_id,
        "against": against_id,
        "against_trajectory_id": other.as_ref().and_then(|o| o.trajectory_id.clone()),
        "diff": diff,
    })))
}

/// The trajectory `id` names, or, for a session id, the session's first run (two runs of one task are often two
/// sessions).
fn compared(reader: &dyn Query, id: &str) -> Result<Option<TrajectorySummary>, StoreError> {
    if let Some(t) = reader.trajectory(id)? {
        return Ok(Some(t));
    }
    let rows = reader.session_trajectories(id)?;
    let summaries: Vec<&TrajectorySummary> = rows.iter().map(|(_, t)| t).collect();
    Ok(lead_trajectory(&summaries).cloned())
}

/// Steps compared side by side, at most this many of each trajectory.
const COMPARED_STEPS: u32 = 1_000;

/// Two trajectories side by side: each one's summary and steps, and `rows` pairing their steps (`a`, `b`: the
/// step's position in its list, null where the other has no counterpart), aligned by `diff::align_steps`.
pub fn compare(reader: &dyn Query, a: &str, b: &str) -> Result<Option<Value>, StoreError> {
    let (Some(sa), Some(sb)) = (compared(reader, a)?, compared(reader, b)?) else {
        return Ok(None);
    };
    let steps_a = reader.steps_page(&sa.trajectory_id, None, COMPARED_STEPS)?;
    let steps_b = reader.steps_page(&sb.trajectory_id, None, COMPARED_STEPS)?;
    let rows: Vec<Value> = diff::align_steps(&steps_a, &steps_b)
        .into_iter()
        .map(|(i, j)| json!({"a": i, "b": j}))
        .collect();
    let side = |s: &TrajectorySummary, steps: &[Step]| -> Result<Value, StoreError> {
        let mut totals = Totals::default();
        for call in reader.call_heads(&s.trajectory_id)? {
            totals.add(&call);
        }
        Ok(json!({
            "trajectory": trajectory_json(s, &totals),
            "steps": steps.iter().map(|st| step_json(st, None)).collect::<Vec<_>>(),
            "truncated": steps.len() as u32 >= COMPARED_STEPS,
        }))
    };
    Ok(Some(
        json!({ "a": side(&sa, &steps_a)?, "b": side(&sb, &steps_b)?, "rows": rows }),
    ))
}

fn head_cost(c: &CallHead) -> Value {
    cost_json(c.usage.as_ref(), c.cost.as_ref())
}

/// One call: what is new in its request compared with the trajectory's previous call, its raw bodies, headers
/// without secrets, timings, usage, cost, a curl command and the session's export links.
pub fn call(reader: &dyn Query, ctx: &Context, trace_id: &str) -> Result<Option<Value>, StoreError> {
    let Some(trace) = reader.trace(trace_id)? else {
        return Ok(None);
    };
    let previous = reader.previous_call(&trace)?;
    let step = reader.step_for_trace(trace_id)?;
    // The session the page links back to: the trace's own, else its trajectory's.
    let root = match (&trace.session_id, &trace.trajectory_id) {
        (Some(s), _) => Some(s.clone()),
        (None, Some(t)) => reader.session_of(t)?,
        (None, None) => None,
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
        "provider": crate::provider::otel_provider_name(trace.api, &trace.upstream, &trace.path, trace.model.as_deref()),
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
///
/// Whoever sends a request through the proxy chooses its method, path, headers and body, and the user pastes
/// this command into a shell: every value from the trace is single-quoted (POSIX), so the shell runs curl and
/// nothing else. The body reaches curl on stdin from `printf` (a shell builtin: no argument-length limit);
/// text with control characters goes through printf's octal escapes instead of verbatim, because a terminal
/// pasting without bracketed paste would act on them (DEL and ^U edit the line, which could open the quote).
fn curl(ctx: &Context, trace: &ProviderTrace) -> String {
    let base = ctx
        .upstreams
        .get(&trace.upstream)
        .map_or("https://PROVIDER", String::as_str);
    let url = format!("{}{}", base.trim_end_matches('/'), trace.path);
    let env = key_variable(&trace.upstream);
    let key_header = match trace.api {
        Api::AnthropicMessages => "x-api-key",
        Api::GeminiGenerateContent => "x-goog-api-key",
        _ => "authorization",
    };
    let key_value = if key_header == "authorization" { "Bearer " } else { "" };
    let mut cmd = String::new();
    let body = trace.request.as_str();
    let has_body = !body.is_empty() && body != "null";
    if has_body {
        cmd.push_str("printf ");
        if body.chars().any(char::is_control) {
            cmd.push_str(&shell_quote(&printf_format(body)));
        } else {
            cmd.push_str("'%s' ");
            cmd.push_str(&shell_quote(body));
        }
        cmd.push_str(" |\n");
    }
    // The only expansion: a variable whose name `key_variable` builds from [A-Z0-9_] alone.
    cmd.push_str(&format!(
        "curl -sS -X {} {} \\\n  -H \"{key_header}: {key_value}${env}\"",
        shell_quote(&trace.method),
        shell_quote(&url)
    ));
    for (k, v) in &trace.request_headers {
        let lower = k.to_ascii_lowercase();
        if matches!(
            lower.as_str(),
            "content-type" | "anthropic-version" | "anthropic-beta" | "accept"
        ) && !is_secret_header(ctx, &lower)
            && !v.chars().any(char::is_control)
        {
            cmd.push_str(" \\\n  -H ");
            cmd.push_str(&shell_quote(&format!("{lower}: {v}")));
        }
    }
    if has_body {
        cmd.push_str(" \\\n  --data-binary @-");
    }
    cmd
}

/// `text` as one POSIX shell word that the shell takes literally: in single quotes, each `'` written `'\''`.
fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', "'\\''"))
}

/// A printf format printing `text` exactly: `\` and `%` escaped, every byte of a control character (C0, DEL,
/// C1) as an octal escape, so the command holds no control character; a leading `-` too (printf would take the
/// format for an option).
fn printf_format(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 16);
    for (i, c) in text.chars().enumerate() {
        match c {
            '-' if i == 0 => out.push_str("\\055"),
            '\\' => out.push_str("\\\\"),
            '%' => out.push_str("%%"),
            c if c.is_control() => {
                let mut utf8 = [0u8; 4];
                for b in c.encode_utf8(&mut utf8).bytes() {
                    out.push_str(&format!("\\{b:03o}"));
                }
            }
            c => out.push(c),
        }
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;

    fn traj(id: &str, purpose: Purpose, parent: Option<&str>, continues: Option<&str>) -> TrajectorySummary {
        TrajectorySummary {
            trajectory_id: id.into(),
            session_id: Some("s".into()),
            purpose: Some(purpose),
            parent_trajectory_id: parent.map(str::to_owned),
            continues: continues.map(str::to_owned),
            ..TrajectorySummary::default()
        }
    }

    /// (id, under, depth, run) in page order.
    fn shape(rows: &[TrajectorySummary]) -> Vec<(String, Option<String>, usize, Option<usize>)> {
        let refs: Vec<&TrajectorySummary> = rows.iter().collect();
        arrange(&refs)
            .into_iter()
            .map(|n| {
                (
                    rows[n.index].trajectory_id.clone(),
                    n.under.map(|u| rows[u].trajectory_id.clone()),
                    n.depth,
                    n.run,
                )
            })
            .collect()
    }

    fn row(
        id: &str,
        under: Option<&str>,
        depth: usize,
        run: Option<usize>,
    ) -> (String, Option<String>, usize, Option<usize>) {
        (id.into(), under.map(str::to_owned), depth, run)
    }

    /// Both ways of writing a body, run by the system's POSIX `sh` (dash on Debian, not bash): each prints the
    /// text exactly, and the command holds no control character.
    #[test]
    fn quoted_and_printf_escaped_text_reads_back_exactly_in_a_posix_shell() {
        let texts = [
            "plain {\"json\": 1}",
            "it's '$(touch x)' `touch x` $HOME \\ %s %% \\n",
            "-n leading dash",
            "-1\t",
            "line\nLLMTAP_EOF\nEOF\n",
            "del \u{7f} c1 \u{9b} bell \u{7} nul-free \u{1b}[201~ end",
            "'",
            "",
        ];
        for text in texts {
            let commands = [
                format!("printf '%s' {}", shell_quote(text)),
                format!("printf {}", shell_quote(&printf_format(text))),
            ];
            for (i, cmd) in commands.iter().enumerate() {
                if i == 1 || !text.chars().any(char::is_control) {
                    assert!(!cmd.chars().any(char::is_control), "{cmd:?}");
                }
                let out = std::process::Command::new("sh").arg("-c").arg(cmd).output().unwrap();
                assert!(
                    out.status.success(),
                    "{cmd:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                assert_eq!(String::from_utf8_lossy(&out.stdout), text, "{cmd:?}");
            }
        }
        assert_eq!(key_variable("my.proxy-1"), "MY_PROXY_1_API_KEY");
        assert_eq!(key_variable("9$(x)"), "_9__X__API_KEY");
    }

    #[test]
    fn side_calls_go_under_the_run_they_happened_in_and_sub_agents_under_their_parent() {
        // Oldest first, as the store reads them.
        let rows = vec![
            traj("quota", Purpose::Quota, None, None),
            traj("main1", Purpose::Main, None, None),
            traj("warm", Purpose::Warmup, None, None),
            traj("sub", Purpose::Subagent, Some("main1"), None),
            traj("cont", Purpose::Main, None, Some("main1")),
            traj("main2", Purpose::Main, None, None),
            traj("title", Purpose::Title, None, None),
        ];
        assert_eq!(
            shape(&rows),
            vec![
                row("main1", None, 0, Some(1)),
                row("sub", Some("main1"), 1, None),
                row("cont", Some("main1"), 1, None),
                row("quota", Some("main1"), 1, None),
                row("warm", Some("main1"), 1, None),
                row("main2", None, 0, Some(2)),
                row("title", Some("main2"), 1, None),
            ]
        );
        assert!(is_dimmed(&rows[0]) && is_dimmed(&rows[2]) && is_dimmed(&rows[6]));
        assert!(!is_dimmed(&rows[3]) && !is_dimmed(&rows[4]));
    }

    #[test]
    fn a_session_of_side_calls_only_and_a_link_cycle_still_show_every_trajectory() {
        let rows = vec![
            traj("w", Purpose::Warmup, None, None),
            traj("a", Purpose::Main, Some("b"), None),
            traj("b", Purpose::Main, Some("a"), None),
        ];
        let got = shape(&rows);
        assert_eq!(got.len(), 3);
        assert_eq!(got[0], row("w", None, 0, None));
        let single = vec![traj("only", Purpose::Main, None, None)];
        assert_eq!(shape(&single), vec![row("only", None, 0, None)]);
    }
}
