//! `llmtap tail`: calls and steps of a running llmtap as they complete, from its gRPC live feed (`Subscribe`).
//!
//! One line per LLM call (time, agent, model, tokens with the cache split, cost, duration; errors in red), then
//! the call's tool calls (`→`), and each tool result as it arrives (`←`, with its duration; tool errors in red).
//! Colour only when stdout is a terminal and `NO_COLOR` is unset.
//!
//! When the feed ends (llmtap stopped or restarted, or this client fell too far behind and events were skipped)
//! tail says so on stderr and reconnects, once a second, until it is interrupted: like `kubectl logs -f` across a
//! pod restart, the terminal stays useful while llmtap restarts. What happened while it was disconnected is not
//! replayed (`llmtap traces` / `llmtap sessions` read it from the store). If llmtap cannot be reached when tail
//! starts, tail exits with an error instead: that is a wrong address or token, not a restart.

use std::collections::HashMap;
use std::io::Write;
use std::time::Duration;

use tonic::Status;
use tonic::transport::{Channel, Endpoint};

use crate::api::pb;
use crate::derive::context;
use crate::model::cost::{CostBreakdown, display_usd};
use crate::model::step::{Purpose, Step, StepRole};
use crate::telemetry::error_chain;

/// What to follow.
#[derive(Debug, Clone, Default)]
pub struct TailOptions {
    /// `http://HOST:PORT` of the gRPC API.
    pub endpoint: String,
    pub token: Option<String>,
    pub session: Option<String>,
    pub agent: Option<String>,
    pub color: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum TailError {
    #[error(
        "cannot reach llmtap's API at {endpoint}: {reason}. Is `llmtap serve` running with [api] listen at that \
         address? (use --api HOST:PORT or the config file it runs with, -c)"
    )]
    Unreachable { endpoint: String, reason: String },
    #[error("llmtap's API at {endpoint} refused the subscription: {status}")]
    Refused { endpoint: String, status: String },
    #[error("cannot write the output: {0}")]
    Output(#[from] std::io::Error),
}

/// Whether to colour: stdout is a terminal and `NO_COLOR` is unset or empty (https://no-color.org).
pub fn want_color() -> bool {
    use std::io::IsTerminal;
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

const RECONNECT_EVERY: Duration = Duration::from_secs(1);

/// Follow the feed until interrupted. Returns only on an error at the first connection or on output failure.
pub async fn run(options: &TailOptions, out: &mut impl Write) -> Result<(), TailError> {
    let mut printer = Printer::new(options.color);
    let mut first = true;
    loop {
        let stream = match subscribe(options).await {
            Ok(s) => s,
            Err(e) if first => return Err(e),
            Err(_) => {
                tokio::time::sleep(RECONNECT_EVERY).await;
                continue;
            }
        };
        if !first {
            eprintln!("llmtap tail: reconnected to {}", options.endpoint);
        }
        first = false;
        let reason = follow(stream, &mut printer, out).await?;
        eprintln!(
            "llmtap tail: the live feed from {} ended ({reason}); reconnecting (calls made meanwhile are not \
             shown here: see `llmtap traces`)",
            options.endpoint
        );
        tokio::time::sleep(RECONNECT_EVERY).await;
    }
}

async fn subscribe(options: &TailOptions) -> Result<tonic::Streaming<pb::Event>, TailError> {
    let unreachable = |reason: String| TailError::Unreachable {
        endpoint: options.endpoint.clone(),
        reason,
    };
    let channel: Channel = Endpoint::from_shared(options.endpoint.clone())
        .map_err(|e| unreachable(e.to_string()))?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| unreachable(error_chain(&e)))?;
    let mut request = tonic::Request::new(pb::SubscribeRequest {
        session: options.session.clone().unwrap_or_default(),
        agent: options.agent.clone().unwrap_or_default(),
        steps: true,
        traces: true,
        format: String::new(),
    });
    if let Some(token) = &options.token {
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| unreachable("the API token is not a valid header value".into()))?;
        request.metadata_mut().insert("authorization", value);
    }
    let mut client = pb::llm_tap_client::LlmTapClient::new(channel);
    client
        .subscribe(request)
        .await
        .map(tonic::Response::into_inner)
        .map_err(|status| match status.code() {
            tonic::Code::Unavailable => unreachable(status.message().to_owned()),
            _ => TailError::Refused {
                endpoint: options.endpoint.clone(),
                status: status_text(&status),
            },
        })
}

/// Print events until the stream ends; the reason it ended.
async fn follow(
    mut stream: tonic::Streaming<pb::Event>,
    printer: &mut Printer,
    out: &mut impl Write,
) -> Result<String, TailError> {
    loop {
        match stream.message().await {
            Ok(Some(event)) => {
                for line in printer.event(&event) {
                    writeln!(out, "{line}")?;
                }
                out.flush()?;
            }
            Ok(None) => return Ok("llmtap closed it".into()),
            Err(status) => return Ok(status_text(&status)),
        }
    }
}

fn status_text(status: &Status) -> String {
    if status.message().is_empty() {
        format!("{:?}", status.code())
    } else {
        status.message().to_owned()
    }
}

/// Turns events into lines; remembers which tool results of each step were printed (a step is sent again when
/// its results arrive).
pub struct Printer {
    color: bool,
    printed_results: HashMap<String, usize>,
}

/// Steps whose printed results are remembered; beyond it the memory starts over (a very old step that gets a
/// late result may then print its earlier results again).
const REMEMBERED_STEPS: usize = 10_000;
/// Text shown for a tool's arguments or result, a user message or the agent's text: one line, this many chars.
const SNIPPET_CHARS: usize = 100;

const RED: &str = "\x1b[31m";
const DIM: &str = "\x1b[2m";
const BOLD: &str = "\x1b[1m";
const RESET: &str = "\x1b[0m";

impl Printer {
    pub fn new(color: bool) -> Printer {
        Printer {
            color,
            printed_results: HashMap::new(),
        }
    }

    fn paint(&self, style: &str, text: &str) -> String {
        if self.color {
            format!("{style}{text}{RESET}")
        } else {
            text.to_owned()
        }
    }

    pub fn event(&mut self, event: &pb::Event) -> Vec<String> {
        match &event.kind {
            Some(pb::event::Kind::Trace(t)) => vec![self.call_line(t)],
            Some(pb::event::Kind::Step(s)) => match serde_json::from_str::<Step>(&s.json) {
                Ok(step) => self.step_lines(&step),
                Err(_) => Vec::new(),
            },
            _ => Vec::new(),
        }
    }

    /// `12:03:04.512 agent model  in 1,234 (cache read 1,000, write 200) out 56  $0.0123  1.9s [error]`.
    pub fn call_line(&self, t: &pb::TraceSummary) -> String {
        let time = chrono::Local::now().format("%H:%M:%S%.3f").to_string();
        let agent = [&t.agent, &t.session_id]
            .into_iter()
            .find(|s| !s.is_empty())
            .map_or("-", |s| s.as_str());
        let model = if t.model.is_empty() { "-" } else { t.model.as_str() };
        let mut cache = Vec::new();
        if t.cache_read_tokens > 0 {
            cache.push(format!("read {}", t.cache_read_tokens));
        }
        if t.cache_write_tokens > 0 {
            cache.push(format!("write {}", t.cache_write_tokens));
        }
        let cache = if cache.is_empty() {
            String::new()
        } else {
            format!(" (cache {})", cache.join(", "))
        };
        let cost = match &t.cost {
            Some(c) => cost_text(c),
            None => "unknown".to_owned(),
        };
        let body = format!(
            "{agent} {model}  in {}{cache} out {}  {cost}  {:.1}s",
            t.input_tokens,
            t.output_tokens,
            t.duration_ms / 1000.0
        );
        let failed = !t.error.is_empty() || t.status >= 400 || !matches!(t.outcome.as_str(), "complete" | "");
        if failed {
            let what = if t.error.is_empty() {
                format!("{} {}", t.status, t.outcome)
            } else {
                t.error.clone()
            };
            let what: String = one_line(&what);
            format!(
                "{} {}",
                self.paint(DIM, &time),
                self.paint(RED, &format!("{body}  ERROR {what}"))
            )
        } else {
            format!("{} {}", self.paint(DIM, &time), self.paint(BOLD, &body))
        }
    }

    /// A user step's text; an agent step's text and tool calls (first time), and tool results not yet printed.
    pub fn step_lines(&mut self, s: &Step) -> Vec<String> {
        let mut lines = Vec::new();
        let seen = self.printed_results.get(&s.step_id).copied();
        match s.role {
            StepRole::User => {
                // The person's words: context the client injected (`<system-reminder>` ...) is left out.
                let text = s.content.as_deref().map(context::user_text).unwrap_or_default();
                if !text.is_empty() {
                    lines.push(self.paint(DIM, &format!("  user: {}", one_line(&text))));
                }
                return lines;
            }
            StepRole::Agent if seen.is_none() && s.purpose == Some(Purpose::Title) => {
                // A title call names its session: shown as the title, not as the JSON it was answered in.
                if let Some(title) = s.content.as_deref().and_then(context::title_from_answer) {
                    lines.push(self.paint(BOLD, &format!("  title: {title}")));
                }
            }
            StepRole::Agent if seen.is_none() => {
                if let Some(text) = s.content.as_deref().filter(|t| !t.trim().is_empty()) {
                    lines.push(format!("  {}", one_line(text)));
                }
                for c in &s.tool_calls {
                    lines.push(format!("  → {} {}", c.tool_name, one_line(&c.input.to_string())));
                }
            }
            _ => {}
        }
        let already = seen.unwrap_or(0);
        for o in s.observations.iter().skip(already) {
            let call = s.tool_calls.iter().find(|c| c.tool_call_id == o.source_call_id);
            let name = call.map_or(o.source_call_id.as_str(), |c| c.tool_name.as_str());
            let took = call
                .and_then(|c| c.duration_ms)
                .map(|ms| format!(" ({:.1}s)", ms as f64 / 1000.0))
                .unwrap_or_default();
            let text = o.content.as_deref().or(o.output_summary.as_deref()).unwrap_or("");
            match &o.error {
                Some(e) => lines.push(self.paint(RED, &format!("  ← {name}{took} {e}: {}", one_line(text)))),
                None => lines.push(format!("  ← {name}{took} {}", one_line(text))),
            }
        }
        if self.printed_results.len() >= REMEMBERED_STEPS {
            self.printed_results.clear();
        }
        self.printed_results
            .insert(s.step_id.clone(), s.observations.len().max(already));
        lines
    }
}

/// `$0.0123`, from the API's exact decimal string.
fn cost_text(c: &pb::Cost) -> String {
    match c.total.parse() {
        Ok(total) => CostBreakdown {
            total,
            ..Default::default()
        }
        .display_total(),
        Err(_) => display_usd(Default::default()),
    }
}

/// The first line of `text`, at most [`SNIPPET_CHARS`] characters, `…` when cut.
fn one_line(text: &str) -> String {
    let first = text.trim().lines().next().unwrap_or("");
    let more = first.chars().count() > SNIPPET_CHARS || text.trim().lines().nth(1).is_some();
    let mut s: String = first.chars().take(SNIPPET_CHARS).collect();
    if more {
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(error: &str) -> pb::TraceSummary {
        pb::TraceSummary {
            agent: "coder".into(),
            model: "gpt-4o".into(),
            status: if error.is_empty() { 200 } else { 429 },
            outcome: "complete".into(),
            input_tokens: 1200,
            output_tokens: 30,
            cache_read_tokens: 1000,
            error: error.into(),
            duration_ms: 1500.0,
            cost: Some(pb::Cost {
                total: "0.0012345".into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_call_line_shows_model_tokens_and_cost_and_only_errors_are_red() {
        let p = Printer::new(true);
        let ok = p.call_line(&call(""));
        assert!(
            ok.contains("coder gpt-4o  in 1200 (cache read 1000) out 30  $0.001235  1.5s"),
            "{ok}"
        );
        assert!(!ok.contains(RED), "{ok}");
        let failed = p.call_line(&call("rate_limit_error: slow down"));
        assert!(failed.contains(&format!("{RED}coder gpt-4o")), "{failed}");
        assert!(failed.contains("ERROR rate_limit_error: slow down"), "{failed}");
        assert!(!Printer::new(false).call_line(&call("x")).contains('\x1b'));
    }

    fn step(role: &str, purpose: &str, content: &str) -> Step {
        serde_json::from_value(serde_json::json!({
            "step_id": format!("tr_x/{role}"), "trajectory_id": "tr_x", "step_index": 0, "role": role,
            "content": content, "reasoning_content": null, "model": null, "system_prompt_hash": null,
            "agent_role": null, "parent_step": null, "call_type": "main", "purpose": purpose,
            "tools_available": [], "tool_calls": [], "observations": [], "snippets": [],
            "token_usage": {"input_tokens": 0, "output_tokens": 0, "cache_read_tokens": 0,
                "cache_write_tokens": 0, "prefix_reuse_tokens": 0, "reasoning_tokens": 0},
            "timestamp": "2026-11-27T00:00:00Z", "status": "ok"
        }))
        .unwrap()
    }

    #[test]
    fn a_title_call_shows_its_title_and_user_steps_leave_injected_context_out() {
        let mut p = Printer::new(false);
        let title = p.step_lines(&step("agent", "title", "{\"title\": \"Fix the parser\"}"));
        assert_eq!(title, ["  title: Fix the parser"]);
        let user = p.step_lines(&step(
            "user",
            "main",
            "<system-reminder>\n# claudeMd\nUse tabs.\n</system-reminder>\nfix the parser",
        ));
        assert_eq!(user, ["  user: fix the parser"]);
        let only_context = p.step_lines(&step("user", "main", "<system-reminder>x</system-reminder>"));
        assert!(only_context.is_empty(), "{only_context:?}");
    }

    #[test]
    fn unknown_cost_is_shown_as_unknown() {
        let mut t = call("");
        t.cost = None;
        assert!(Printer::new(false).call_line(&t).contains("  unknown  "));
    }
}
