//! Derivation's content hashes of long texts, remembered.
//!
//! Every call of an agent hashes texts that have not changed since its previous call: the system prompt three
//! times (in the root key's prefix, on its own, and as the step's `sp_` hash) and the first user turn twice (in
//! the prefix and the history key). In agent traffic those are tens of kilobytes; hashed afresh on every call,
//! their SHA-256 is ~30% of the pipeline thread's samples per ~30 KB agent request (`llmtap-bench store-rate`,
//! docs/performance.md). This keeps the digest of recent long inputs, found by a fast non-cryptographic hash and
//! confirmed byte for byte, so a repeated input costs that hash and one comparison. The digest is the one
//! `model::short_hash` gives: ids do not change.
//!
//! The memo is per thread (derivation runs on the pipeline thread) and holds at most [`HELD_BYTES`] of inputs;
//! past that it starts again empty, so an llmtap serving many agents keeps the recent ones.

use std::cell::RefCell;
use std::hash::Hasher;

use rustc_hash::{FxHashMap, FxHasher};

/// Shorter inputs are hashed at once: SHA-256 of a kilobyte costs about what a lookup does.
const MIN_BYTES: usize = 1024;
/// Longer inputs (inline media, say) are hashed at once and not kept.
const MAX_BYTES: usize = 256 * 1024;
/// The most input bytes the memo holds.
const HELD_BYTES: usize = 4 * 1024 * 1024;

#[derive(Default)]
struct Memo {
    /// Fast hash of the input → the input and its digest.
    by_hash: FxHashMap<u64, (Box<[u8]>, String)>,
    held: usize,
}

thread_local! {
    static MEMO: RefCell<Memo> = RefCell::new(Memo::default());
}

/// `model::short_hash(bytes)`, remembered for inputs of [`MIN_BYTES`] to [`MAX_BYTES`].
pub fn short_hash(bytes: &[u8]) -> String {
    if !(MIN_BYTES..=MAX_BYTES).contains(&bytes.len()) {
        return crate::model::short_hash(bytes);
    }
    let mut fast = FxHasher::default();
    fast.write(bytes);
    let key = fast.finish();
    MEMO.with(|memo| {
        let mut memo = memo.borrow_mut();
        if let Some((input, digest)) = memo.by_hash.get(&key)
            && **input == *bytes
        {
            return digest.clone();
        }
        let digest = crate::model::short_hash(bytes);
        if memo.held + bytes.len() > HELD_BYTES {
            memo.by_hash.clear();
            memo.held = 0;
        }
        if let Some((replaced, _)) = memo.by_hash.insert(key, (bytes.into(), digest.clone())) {
            memo.held -= replaced.len();
        }
        memo.held += bytes.len();
        digest
    })
}

#[cfg(test)]
fn held() -> (usize, usize) {
    MEMO.with(|m| {
        let m = m.borrow();
        (m.by_hash.len(), m.held)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_model_short_hash_remembered_or_not() {
        for len in [0, 10, MIN_BYTES - 1, MIN_BYTES, 20_000, MAX_BYTES, MAX_BYTES + 1] {
            let text: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let expected = crate::model::short_hash(&text);
            assert_eq!(short_hash(&text), expected, "first, {len} bytes");
            assert_eq!(short_hash(&text), expected, "again, {len} bytes");
        }
    }

    #[test]
    fn a_repeated_input_is_found_and_a_changed_one_is_not() {
        let a = "You are a coding agent. ".repeat(400);
        let mut b = a.clone();
        b.replace_range(100..101, "X");
        let before = held();
        let first = short_hash(a.as_bytes());
        let after_a = held();
        assert_eq!(after_a.0, before.0 + 1, "kept");
        assert_eq!(short_hash(a.as_bytes()), first);
        assert_eq!(held(), after_a, "found: nothing added");
        // Same length, one byte different: its own digest, its own entry.
        let other = short_hash(b.as_bytes());
        assert_ne!(other, first);
        assert_eq!(other, crate::model::short_hash(b.as_bytes()));
        assert_eq!(held().0, after_a.0 + 1);
    }

    #[test]
    fn the_inputs_held_stay_within_the_bound() {
        for i in 0..(2 * HELD_BYTES / 50_000) {
            let text = format!("{i:08} {}", "y".repeat(50_000));
            assert_eq!(short_hash(text.as_bytes()), crate::model::short_hash(text.as_bytes()));
            assert!(held().1 <= HELD_BYTES, "{:?} after {i}", held());
        }
    }
}
