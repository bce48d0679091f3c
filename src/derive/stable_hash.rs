//! The canonical byte encoding of tool-call arguments, shared by persisted ids and in-process fingerprints.
//!
//! Anything that ends up in a persisted id, or that two replicas must compute alike, is hashed from bytes this
//! file fixes, never through `std::hash::Hash`: the bytes a `Hash` impl feeds a hasher are not promised to stay
//! the same across Rust versions, and `usize` lengths differ between 32- and 64-bit targets. Ids then hash
//! these bytes with SHA-256 (`model::short_hash`); in-process comparisons may feed them to a fast hasher.
//!
//! Encoding of a JSON value (all integers little-endian):
//! - `null` → `n`; `false` → `f`; `true` → `t`
//! - number → `#` + the IEEE-754 bits of its `f64` value (u64), so `1` and `1.0` agree, as a re-serialized echo
//!   may write either
//! - string → `s` + byte length (u64) + UTF-8 bytes
//! - array → `[` + item count (u64) + each item
//! - object → `{` + entry count (u64) + each entry sorted by key bytes: the key as a string, then the value;
//!   clients re-serialize arguments in any key order

use serde_json::Value;

/// Where canonical bytes go: a buffer to hash with SHA-256, or a fast in-process hasher.
pub trait ByteSink {
    fn put(&mut self, bytes: &[u8]);
}

impl ByteSink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

impl ByteSink for rustc_hash::FxHasher {
    fn put(&mut self, bytes: &[u8]) {
        std::hash::Hasher::write(self, bytes);
    }
}

fn put_len(out: &mut impl ByteSink, len: usize) {
    out.put(&(len as u64).to_le_bytes());
}

/// Write a string as `s` + length + bytes (the length keeps `["ab","c"]` apart from `["a","bc"]`).
pub fn put_str(out: &mut impl ByteSink, s: &str) {
    out.put(b"s");
    put_len(out, s.len());
    out.put(s.as_bytes());
}

/// Write `v` in the canonical encoding described in the module documentation.
pub fn put_json(out: &mut impl ByteSink, v: &Value) {
    match v {
        Value::Null => out.put(b"n"),
        Value::Bool(false) => out.put(b"f"),
        Value::Bool(true) => out.put(b"t"),
        Value::Number(n) => match n.as_f64() {
            Some(f) => {
                out.put(b"#");
                out.put(&f.to_bits().to_le_bytes());
            }
            // Only reachable with serde_json's arbitrary precision: keep the digits rather than lose the value.
            None => {
                out.put(b"#");
                put_str(out, &n.to_string());
            }
        },
        Value::String(s) => put_str(out, s),
        Value::Array(items) => {
            out.put(b"[");
            put_len(out, items.len());
            for item in items {
                put_json(out, item);
            }
        }
        Value::Object(map) => {
            out.put(b"{");
            put_len(out, map.len());
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            for (k, v) in entries {
                put_str(out, k);
                put_json(out, v);
            }
        }
    }
}

/// 16 hex digits identifying a JSON value up to key order and number spelling: SHA-256 of its canonical
/// encoding, truncated like every other content hash in an id (`model::short_hash`).
pub fn json_digest(v: &Value) -> String {
    let mut bytes = Vec::new();
    put_json(&mut bytes, v);
    crate::model::short_hash(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn encoding_is_the_documented_bytes() {
        let mut out = Vec::new();
        put_json(&mut out, &json!({"b": [true, null], "a": 1}));
        let mut want = b"{".to_vec();
        want.extend(2u64.to_le_bytes());
        want.extend(b"s");
        want.extend(1u64.to_le_bytes());
        want.extend(b"a#");
        want.extend(1.0f64.to_bits().to_le_bytes());
        want.extend(b"s");
        want.extend(1u64.to_le_bytes());
        want.extend(b"b[");
        want.extend(2u64.to_le_bytes());
        want.extend(b"tn");
        assert_eq!(out, want);
    }

    #[test]
    fn digest_ignores_key_order_and_number_spelling_but_not_values() {
        let a = json_digest(&json!({"city": "Paris", "days": 3, "opts": {"x": 1, "y": [1, 2]}}));
        let b =
            json_digest(&serde_json::from_str(r#"{"opts":{"y":[1,2],"x":1.0},"days":3.0,"city":"Paris"}"#).unwrap());
        assert_eq!(a, b);
        assert_ne!(
            a,
            json_digest(&json!({"city": "Paris", "days": 4, "opts": {"x": 1, "y": [1, 2]}}))
        );
        // String boundaries count: the length prefix keeps these apart.
        assert_ne!(json_digest(&json!(["ab", "c"])), json_digest(&json!(["a", "bc"])));
    }

    #[test]
    fn digest_is_pinned() {
        // Persisted trajectory ids of Gemini conversations depend on this value: it must never change.
        assert_eq!(json_digest(&json!({"city": "Paris"})), json_digest_reference());
        assert_eq!(json_digest(&json!({"city": "Paris"})), "a1635b3de2bb6194");
    }

    /// The same value computed straight from the documented encoding with sha2, independent of `put_json`.
    fn json_digest_reference() -> String {
        use sha2::{Digest, Sha256};
        let mut bytes = b"{".to_vec();
        bytes.extend(1u64.to_le_bytes());
        bytes.extend(b"s");
        bytes.extend(4u64.to_le_bytes());
        bytes.extend(b"city");
        bytes.extend(b"s");
        bytes.extend(5u64.to_le_bytes());
        bytes.extend(b"Paris");
        Sha256::digest(&bytes)[..8].iter().map(|b| format!("{b:02x}")).collect()
    }
}
