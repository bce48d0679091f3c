//! Dropping by whole conversation: once the capture queue drops one exchange of a conversation, the later
//! exchanges of that conversation are dropped too, so that a trajectory is either stored from its start up to
//! where capture fell behind, or not at all — never stored with holes (a trajectory with a missing middle call
//! derives wrong steps, tool durations and links, which is worse than one that ends early).
//!
//! The key must be cheap and known without derivation. [`conversation_key`] is, in order:
//! - the session the client named (header or path form, already parsed on the data path), per upstream;
//! - else the conversation's root: the request text from its start through the first non-system member of the
//!   API's conversation array (`messages`, `input`, `contents`): model, system prompt, whatever the client
//!   sends before, and the first user turn. Every later request of the conversation repeats that prefix byte
//!   for byte (clients re-serialize the same history the same way); two conversations that begin with the same
//!   system prompt and the same first user message share a key, and are dropped together;
//! - else (no conversation array: embeddings, model lists, bodies that are not JSON) the exchange's own id:
//!   such an exchange is a trajectory of its own.
//!
//! Where the work happens: the data path computes a key only for an exchange it drops (a scan of the request
//! up to its first user turn and an FxHash of it, a few µs, only while capture is overloaded) and notes it in
//! [`DroppedConversations`]. The pipeline thread, the queue's one consumer, keeps the marks and checks each
//! exchange it takes against them, and only while any mark is alive: a request of a marked conversation that
//! is longer than the dropped one is dropped (a conversation grows with every call), including one queued
//! before the drop but taken after it (the conversation then ends earlier; still no hole). The same request
//! again is kept: it is a retry of the dropped call, or another conversation that begins alike (identical
//! requests, such as a benchmark's, would otherwise all be dropped after one drop). A mark lives until
//! its conversation has been quiet for `derive.idle_timeout` (when derivation would close the trajectory
//! anyway). Each conversation's first drop counts once in `llmtap_capture_dropped_trajectories_total`.
//!
//! Limit: the data path hands an exchange over after its response is written (see `handoff`), so a client
//! that sends its next call within microseconds may have that call queued before the previous one is dropped;
//! the later call is then stored behind a hole. Marks beyond [`MAX_PENDING`] between two passes of the
//! pipeline are not kept (counted as usual per exchange, not per conversation).

use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustc_hash::{FxHashMap, FxHasher};

use super::{Api, RawExchange};

/// Keys noted by the data path between two passes of the pipeline.
pub const MAX_PENDING: usize = 1 << 16;

/// The key of the conversation `exchange` belongs to (see the module comment).
pub fn conversation_key(exchange: &RawExchange) -> u64 {
    let mut h = FxHasher::default();
    exchange.upstream.hash(&mut h);
    if let Some(session) = &exchange.meta.session {
        1u8.hash(&mut h);
        session.hash(&mut h);
        return h.finish();
    }
    let joined;
    let body: &[u8] = match exchange.request.body.as_slice() {
        [one] => one,
        many => {
            joined = many.concat();
            &joined
        }
    };
    match conversation_array(exchange.api).and_then(|name| root_len(body, name)) {
        Some(len) => {
            2u8.hash(&mut h);
            h.write(&body[..len]);
        }
        None => {
            3u8.hash(&mut h);
            exchange.id.as_u128().hash(&mut h);
        }
    }
    h.finish()
}

/// The top-level member holding the conversation, per API.
fn conversation_array(api: Api) -> Option<&'static [u8]> {
    match api {
        Api::OpenAiChat | Api::AnthropicMessages | Api::BedrockConverse => Some(b"messages"),
        Api::OpenAiResponses => Some(b"input"),
        Api::GeminiGenerateContent => Some(b"contents"),
        Api::Other => None,
    }
}

/// How far the conversation's root reaches: through the first member of top-level array `name` that is not a
/// system (or developer) message, or through `name`'s value if it is a string (the Responses API's string
/// input). None if there is no such member or the text is not a JSON object.
fn root_len(body: &[u8], name: &[u8]) -> Option<usize> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    let mut string_start = 0;
    // At depth 1: the key just read, and whether the current value is the conversation.
    let mut last_key_matches = false;
    let mut in_conversation = false;
    let mut member_start: Option<usize> = None;
    for (i, &c) in body.iter().enumerate() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == b'\\' {
                escaped = true;
            } else if c == b'"' {
                in_string = false;
                if depth == 1 {
                    // A key (followed by ':') or a string value.
                    if last_key_matches && body[..string_start].trim_ascii_end().ends_with(b":") {
                        return Some(i + 1);
                    }
                    last_key_matches = &body[string_start + 1..i] == name;
                }
            }
            continue;
        }
        match c {
            b'"' => {
                in_string = true;
                string_start = i;
                if depth == 2 && in_conversation && member_start.is_none() {
                    member_start = Some(i);
                }
            }
            b'{' | b'[' => {
                if depth == 2 && in_conversation && member_start.is_none() {
                    member_start = Some(i);
                }
                if depth == 1 && c == b'[' && last_key_matches {
                    in_conversation = true;
                }
                depth += 1;
            }
            b'}' | b']' => {
                depth = depth.checked_sub(1)?;
                if depth == 2 && in_conversation {
                    if let Some(start) = member_start.take()
                        && !is_system(&body[start..=i])
                    {
                        return Some(i + 1);
                    }
                } else if depth == 1 && in_conversation {
                    // The conversation array closed with no user turn in it.
                    return None;
                }
            }
            b',' if depth == 2 => {
                member_start = None;
            }
            b',' if depth == 1 => last_key_matches = false,
            _ => {}
        }
    }
    None
}

/// A conversation member that is a system or developer message (its role is said early: look at its head).
fn is_system(member: &[u8]) -> bool {
    let head = &member[..member.len().min(64)];
    [&b"\"system\""[..], b"\"developer\""]
        .iter()
        .any(|needle| head.windows(needle.len()).any(|w| w == *needle))
}

/// Conversations the data path dropped an exchange of, waiting for the pipeline to take them over.
#[derive(Default)]
pub struct DroppedConversations {
    /// (conversation key, request length of the dropped exchange).
    pending: Mutex<Vec<(u64, u64)>>,
    /// Some mark may be alive: the consumer must check what it takes. Set by the data path with each note;
    /// cleared by the consumer, under the `pending` lock, once it holds no mark and nothing is pending.
    active: AtomicBool,
}

impl DroppedConversations {
    /// The data path dropped `exchange`: note its conversation.
    pub fn note(&self, exchange: &RawExchange) {
        let key = conversation_key(exchange);
        if let Ok(mut pending) = self.pending.lock()
            && pending.len() < MAX_PENDING
        {
            pending.push((key, exchange.request.len));
            self.active.store(true, Ordering::Release);
        }
    }
}

/// The consumer's side: live marks, each with when its conversation was last seen and the request length of
/// its first dropped exchange.
pub struct Marks {
    marks: FxHashMap<u64, (Instant, u64)>,
    lifetime: Duration,
    last_expiry: Instant,
}

/// What [`Marks::check`] decided for one exchange.
#[derive(Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The exchange belongs to a conversation that lost an exchange: drop it.
    pub drop: bool,
    /// Conversations newly marked (their first drop) since the last check.
    pub new_trajectories: u64,
}

impl Marks {
    pub fn new(lifetime: Duration) -> Marks {
        Marks {
            marks: FxHashMap::default(),
            lifetime,
            last_expiry: Instant::now(),
        }
    }

    pub fn set_lifetime(&mut self, lifetime: Duration) {
        self.lifetime = lifetime;
    }

    /// Take over the data path's notes (also when no exchange follows, so that a conversation whose last
    /// exchange was dropped is counted too) and expire quiet marks. Returns how many conversations were
    /// newly marked. Costs one atomic load while no mark lives.
    pub fn absorb(&mut self, shared: &DroppedConversations) -> u64 {
        if !shared.active.load(Ordering::Acquire) {
            return 0;
        }
        let mut new = 0;
        let now = Instant::now();
        if let Ok(mut pending) = shared.pending.lock() {
            for (key, len) in pending.drain(..) {
                match self.marks.get_mut(&key) {
                    Some(mark) => mark.1 = mark.1.min(len),
                    None => {
                        self.marks.insert(key, (now, len));
                        new += 1;
                    }
                }
            }
            if now.duration_since(self.last_expiry) >= Duration::from_secs(1) {
                self.last_expiry = now;
                let lifetime = self.lifetime;
                self.marks.retain(|_, (seen, _)| now.duration_since(*seen) < lifetime);
            }
            if self.marks.is_empty() {
                shared.active.store(false, Ordering::Release);
            }
        }
        new
    }

    /// [`Marks::absorb`], then judge `exchange`.
    pub fn check(&mut self, shared: &DroppedConversations, exchange: &RawExchange) -> Verdict {
        let new_trajectories = self.absorb(shared);
        let mut drop = false;
        // Only a longer request continues the conversation (it grows by at least the dropped call's answer):
        // the same request again is a retry of the dropped call, or another conversation that begins alike,
        // and neither leaves a hole.
        if !self.marks.is_empty()
            && let Some((seen, len)) = self.marks.get_mut(&conversation_key(exchange))
            && exchange.request.len > *len
        {
            *seen = Instant::now();
            drop = true;
        }
        Verdict { drop, new_trajectories }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exchange(api: Api, body: &str, id: u128) -> RawExchange {
        let mut e = RawExchange::for_test(id);
        e.api = api;
        e.request.body = [bytes::Bytes::from(body.to_owned())].into();
        e.request.len = body.len() as u64;
        e
    }

    #[test]
    fn the_root_is_the_prefix_through_the_first_user_turn() {
        let chat = r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}]}"#;
        let end = root_len(chat.as_bytes(), b"messages").unwrap_or(0);
        assert!(
            chat[..end].ends_with(r#"{"role":"user","content":"hi"}"#),
            "{}",
            &chat[..end]
        );
        let gemini = r#"{"contents": [ {"role": "user", "parts": [{"text": "]\"}"}]}, {"role":"model"}], "x": 1}"#;
        let end = root_len(gemini.as_bytes(), b"contents").unwrap_or(0);
        assert!(gemini[..end].ends_with(r#""]\"}"}]}"#), "{}", &gemini[..end]);
        let responses = r#"{"model":"m","instructions":"x","input":"hello there","tools":[]}"#;
        let end = root_len(responses.as_bytes(), b"input").unwrap_or(0);
        assert_eq!(
            &responses[..end],
            r#"{"model":"m","instructions":"x","input":"hello there""#
        );
        // A string value equal to the name is not the key; no conversation array, no root.
        assert_eq!(root_len(br#"{"a":"messages","b":[1]}"#, b"messages"), None);
        assert_eq!(root_len(br#"{"messages":[{"role":"system"}]}"#, b"messages"), None);
        assert_eq!(root_len(b"not json", b"messages"), None);
    }

    #[test]
    fn later_calls_of_a_conversation_share_its_key_and_others_do_not() {
        let call = |turns: &[&str]| {
            let messages: Vec<String> = turns
                .iter()
                .map(|t| format!(r#"{{"role":"user","content":"{t}"}}"#))
                .collect();
            format!(r#"{{"model":"m","messages":[{}]}}"#, messages.join(","))
        };
        let a1 = exchange(Api::OpenAiChat, &call(&["a"]), 1);
        let a2 = exchange(Api::OpenAiChat, &call(&["a", "more", "and more"]), 2);
        let b1 = exchange(Api::OpenAiChat, &call(&["b"]), 3);
        assert_eq!(conversation_key(&a1), conversation_key(&a2));
        assert_ne!(conversation_key(&a1), conversation_key(&b1));
        // A named session wins over the body; bodies without a conversation are their own trajectory.
        let mut s = exchange(Api::OpenAiChat, &call(&["b"]), 4);
        s.meta.session = Some("s1".into());
        assert_ne!(conversation_key(&s), conversation_key(&b1));
        let other1 = exchange(Api::Other, &call(&["a"]), 5);
        let other2 = exchange(Api::Other, &call(&["a"]), 6);
        assert_ne!(conversation_key(&other1), conversation_key(&other2));
    }

    #[test]
    fn marks_drop_later_exchanges_of_a_dropped_conversation_and_count_it_once() {
        let body = |n: usize| {
            let mut turns = vec![r#"{"role":"user","content":"start"}"#.to_owned()];
            turns.extend((0..n).map(|i| format!(r#"{{"role":"assistant","content":"{i}"}}"#)));
            format!(r#"{{"messages":[{}]}}"#, turns.join(","))
        };
        let shared = DroppedConversations::default();
        let mut marks = Marks::new(Duration::from_secs(60));
        let other = exchange(
            Api::OpenAiChat,
            r#"{"messages":[{"role":"user","content":"other"}]}"#,
            9,
        );
        assert_eq!(
            marks.check(&shared, &exchange(Api::OpenAiChat, &body(0), 1)),
            Verdict {
                drop: false,
                new_trajectories: 0
            }
        );
        shared.note(&exchange(Api::OpenAiChat, &body(1), 2));
        shared.note(&exchange(Api::OpenAiChat, &body(2), 3));
        let v = marks.check(&shared, &exchange(Api::OpenAiChat, &body(3), 4));
        assert_eq!(
            v,
            Verdict {
                drop: true,
                new_trajectories: 1
            }
        );
        assert!(!marks.check(&shared, &other).drop);
        assert!(marks.check(&shared, &exchange(Api::OpenAiChat, &body(4), 5)).drop);
        // The dropped request again (a retry, or a conversation that begins alike) is kept.
        assert!(!marks.check(&shared, &exchange(Api::OpenAiChat, &body(1), 7)).drop);

        // Marks expire once their conversation has been quiet for the lifetime.
        marks.set_lifetime(Duration::ZERO);
        marks.last_expiry = Instant::now() - Duration::from_secs(2);
        assert!(!marks.check(&shared, &exchange(Api::OpenAiChat, &body(5), 6)).drop);
        assert!(
            !shared.active.load(Ordering::Acquire),
            "no mark left: checks are free again"
        );
    }
}
