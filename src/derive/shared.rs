//! One copy of what many open trajectories hold alike: model names, system prompts (hash and text) and tool
//! definitions. An agent's runs, sub-agents and side calls repeat the same tens of kilobytes of tool definitions
//! and system prompt; each open trajectory holds a reference instead of its own copy.
//!
//! An entry lives while an open trajectory refers to it: [`Shared::sweep`] drops those no trajectory holds any
//! more, after trajectories close.

use std::collections::{HashMap, HashSet};
use std::hash::Hasher;
use std::sync::Arc;

use rustc_hash::FxHasher;
use serde_json::Value;

use crate::model::call::ToolDef;

use super::stable_hash::{put_json, put_str};

#[derive(Default)]
pub struct Shared {
    strings: HashSet<Arc<str>>,
    /// Tool definitions (as the summary serializes them) by a hash of the definitions; equal hashes are compared.
    tools: HashMap<u64, Vec<Arc<[Value]>>>,
}

impl Shared {
    pub fn str(&mut self, s: &str) -> Arc<str> {
        if let Some(a) = self.strings.get(s) {
            return a.clone();
        }
        let a: Arc<str> = Arc::from(s);
        self.strings.insert(a.clone());
        a
    }

    /// The definitions of `tools`, serialized as the trajectory summary carries them.
    pub fn tools(&mut self, tools: &[ToolDef]) -> Arc<[Value]> {
        let mut h = FxHasher::default();
        for t in tools {
            put_str(&mut h, &t.name);
            put_str(&mut h, t.description.as_deref().unwrap_or(""));
            if let Some(p) = &t.parameters {
                put_json(&mut h, p);
            }
        }
        let values: Vec<Value> = tools.iter().filter_map(|t| serde_json::to_value(t).ok()).collect();
        let same = self.tools.entry(h.finish()).or_default();
        if let Some(a) = same.iter().find(|a| a[..] == values[..]) {
            return a.clone();
        }
        let a: Arc<[Value]> = values.into();
        same.push(a.clone());
        a
    }

    /// Forget the entries no open trajectory refers to.
    pub fn sweep(&mut self) {
        self.strings.retain(|a| Arc::strong_count(a) > 1);
        self.tools.retain(|_, same| {
            same.retain(|a| Arc::strong_count(a) > 1);
            !same.is_empty()
        });
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.strings.is_empty() && self.tools.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tool(name: &str, params: Value) -> ToolDef {
        ToolDef {
            name: name.into(),
            description: Some("d".into()),
            parameters: Some(params),
        }
    }

    #[test]
    fn equal_values_share_one_copy_until_nobody_holds_it() {
        let mut s = Shared::default();
        let a = s.str("gpt-4o");
        let b = s.str("gpt-4o");
        assert!(Arc::ptr_eq(&a, &b));
        let t1 = s.tools(&[tool("read", json!({"type": "object"}))]);
        let t2 = s.tools(&[tool("read", json!({"type": "object"}))]);
        let other = s.tools(&[tool("read", json!({"type": "string"}))]);
        assert!(Arc::ptr_eq(&t1, &t2));
        assert!(!Arc::ptr_eq(&t1, &other));
        assert_eq!(
            t1[0],
            json!({"name": "read", "description": "d", "parameters": {"type": "object"}})
        );
        drop((a, t1, other));
        s.sweep();
        assert!(!s.is_empty(), "still held");
        drop((b, t2));
        s.sweep();
        assert!(s.is_empty());
    }
}
