//! Small hand-made calls and traces for the derivation unit tests.

use serde_json::Value;

use crate::config::DeriveConfig;
use crate::model::call::{Message, NormalizedCall, Output, Part, Role, ToolCall};
use crate::model::exchange::{Api, ExchangeMeta, Outcome, Timings, UnixMicros};
use crate::model::json::JsonText;
use crate::model::record::Record;
use crate::model::step::{Step, TrajectorySummary};
use crate::model::trace::ProviderTrace;
use crate::model::usage::Usage;

use super::Deriver;

pub const T0: UnixMicros = 1_700_000_000_000_000;

pub fn user(text: &str) -> Message {
    Message {
        role: Role::User,
        parts: vec![Part::Text { text: text.into() }],
    }
}

pub fn assistant(text: &str) -> Message {
    Message {
        role: Role::Assistant,
        parts: vec![Part::Text { text: text.into() }],
    }
}

pub fn tool_call(id: &str, name: &str, args: Value) -> ToolCall {
    ToolCall {
        id: id.into(),
        name: name.into(),
        arguments: args,
    }
}

pub fn calls(calls: &[ToolCall]) -> Message {
    Message {
        role: Role::Assistant,
        parts: calls.iter().cloned().map(Part::ToolCall).collect(),
    }
}

/// An OpenAI-style `role: tool` message answering `call_id`.
pub fn result(call_id: &str, content: &str) -> Message {
    results(&[(call_id, None, content)])
}

/// One message carrying several results: (call id, function name where the provider sends one, content).
pub fn results(items: &[(&str, Option<&str>, &str)]) -> Message {
    Message {
        role: Role::Tool,
        parts: items
            .iter()
            .map(|(id, name, content)| Part::ToolResult {
                call_id: (*id).into(),
                name: name.map(str::to_owned),
                content: (*content).into(),
                is_error: false,
            })
            .collect(),
    }
}

pub fn text_out(text: &str) -> Output {
    Output {
        text: Some(text.into()),
        ..Output::default()
    }
}

pub fn calls_out(calls: &[ToolCall]) -> Output {
    Output {
        tool_calls: calls.to_vec(),
        ..Output::default()
    }
}

pub fn call(system: &str, messages: Vec<Message>, output: Output) -> NormalizedCall {
    NormalizedCall {
        system: (!system.is_empty()).then(|| system.to_owned()),
        messages,
        output,
        model_requested: Some("m-1".into()),
        usage: Some(Usage {
            input: 100,
            output: 10,
            ..Usage::default()
        }),
        ..NormalizedCall::default()
    }
}

pub fn trace(api: Api, start: UnixMicros, end: UnixMicros) -> ProviderTrace {
    ProviderTrace {
        id: format!("trace-{start}"),
        upstream: "openai".into(),
        api,
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        status: Some(200),
        outcome: Outcome::Complete,
        error: None,
        streamed: false,
        timings: Timings {
            start,
            first_byte: Some(start + 100),
            end,
        },
        request_headers: Vec::new(),
        response_headers: Vec::new(),
        request: JsonText::default(),
        response: JsonText::default(),
        raw_response: None,
        meta: ExchangeMeta::default(),
        request_bytes: 0,
        response_bytes: 0,
        model: None,
        usage: None,
        facts: None,
        cost: None,
        trajectory_id: None,
        session_id: None,
    }
}

/// A deriver fed calls one after another, each starting `gap` after the previous one and lasting 1 s.
pub struct Harness {
    pub deriver: Deriver,
    pub api: Api,
    pub session: Option<String>,
    pub now: UnixMicros,
}

/// The records of one call, by kind.
pub struct Out {
    pub trajectory_id: String,
    pub steps: Vec<Step>,
    pub summary: TrajectorySummary,
}

impl Out {
    /// The call's own agent step (always the last step record).
    pub fn agent(&self) -> &Step {
        &self.steps[self.steps.len() - 1]
    }
}

impl Harness {
    pub fn new(api: Api) -> Harness {
        Harness {
            deriver: Deriver::new(DeriveConfig::default()),
            api,
            session: None,
            now: T0,
        }
    }

    /// Send a call that starts at `self.now` and ends 1 s later; the clock then moves on by `gap_us`.
    pub fn send_after(&mut self, call: NormalizedCall, gap_us: i64) -> Out {
        let mut t = trace(self.api, self.now, self.now + 1_000_000);
        t.meta.session = self.session.clone();
        self.now += 1_000_000 + gap_us;
        split(self.deriver.observe(t, Some(call)))
    }

    pub fn send(&mut self, call: NormalizedCall) -> Out {
        self.send_after(call, 0)
    }
}

pub fn split(records: Vec<Record>) -> Out {
    let mut trajectory_id = String::new();
    let mut steps = Vec::new();
    let mut summary = TrajectorySummary::default();
    for r in records {
        match r {
            Record::Trace(t) => trajectory_id = t.trajectory_id.unwrap_or_default(),
            Record::Step(s) => steps.push(*s),
            Record::Trajectory(s) => summary = *s,
        }
    }
    Out {
        trajectory_id,
        steps,
        summary,
    }
}
