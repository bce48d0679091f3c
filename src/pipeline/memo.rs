//! Conversation items already read, keyed by their exact bytes.
//!
//! An agent resends its whole history on every call, so in steady state all but the last item or two of a
//! request were read on an earlier call. Parsing them into `serde_json::Value` again was most of the pipeline's
//! time (allocation per node); with the memo a request is scanned once (`RawValue`, no tree) and only new
//! items are parsed and normalized. Hits compare the stored bytes, so a hash collision cannot return another
//! item. Memory is bounded by two generations: when the current one fills up, it becomes the previous one
//! and the oldest generation is dropped; a hit in the previous generation is promoted.

use std::hash::Hasher;

use rustc_hash::{FxHashMap, FxHasher};

use crate::provider::ItemOut;

/// Items per generation.
const GENERATION: usize = 16 * 1024;
/// Larger items are read every time rather than pinned in memory.
const MAX_ITEM_BYTES: usize = 256 * 1024;

#[derive(Default)]
pub struct ItemMemo {
    current: FxHashMap<u64, (Box<[u8]>, ItemOut)>,
    previous: FxHashMap<u64, (Box<[u8]>, ItemOut)>,
    pub hits: u64,
    pub misses: u64,
}

fn key(scope: u8, bytes: &[u8]) -> u64 {
    let mut h = FxHasher::default();
    h.write_u8(scope);
    h.write(bytes);
    h.finish()
}

impl ItemMemo {
    /// The item read from `bytes` (within `scope`, one per protocol), reading it with `read` on a miss.
    pub fn get_or_read(&mut self, scope: u8, bytes: &[u8], read: impl FnOnce() -> ItemOut) -> ItemOut {
        let k = key(scope, bytes);
        if let Some((b, out)) = self.current.get(&k)
            && **b == *bytes
        {
            self.hits += 1;
            return out.clone();
        }
        if let Some((b, out)) = self.previous.remove(&k) {
            if *b == *bytes {
                self.hits += 1;
                let result = out.clone();
                self.insert(k, b, out);
                return result;
            }
            self.previous.insert(k, (b, out));
        }
        self.misses += 1;
        let out = read();
        if bytes.len() <= MAX_ITEM_BYTES {
            self.insert(k, bytes.into(), out.clone());
        }
        out
    }

    fn insert(&mut self, k: u64, bytes: Box<[u8]>, out: ItemOut) {
        if self.current.len() >= GENERATION {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current.insert(k, (bytes, out));
    }

    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> ItemOut {
        ItemOut::System(s.to_owned())
    }

    #[test]
    fn hits_return_what_was_read_and_misses_read() {
        let mut m = ItemMemo::default();
        assert_eq!(m.get_or_read(1, b"{\"a\":1}", || text("one")), text("one"));
        assert_eq!(m.get_or_read(1, b"{\"a\":1}", || text("other")), text("one"));
        // Same bytes in another protocol are another item.
        assert_eq!(m.get_or_read(2, b"{\"a\":1}", || text("two")), text("two"));
        assert_eq!((m.hits, m.misses), (1, 2));
    }

    #[test]
    fn memory_stays_within_two_generations() {
        let mut m = ItemMemo::default();
        for i in 0..(GENERATION * 5) {
            let bytes = format!("{{\"i\":{i}}}");
            m.get_or_read(1, bytes.as_bytes(), || text("x"));
        }
        assert!(m.len() <= 2 * GENERATION, "{}", m.len());
        // A recent item is still there; the oldest are gone.
        let last = format!("{{\"i\":{}}}", GENERATION * 5 - 1);
        assert_eq!(m.get_or_read(1, last.as_bytes(), || text("new")), text("x"));
        assert_eq!(m.get_or_read(1, b"{\"i\":0}", || text("new")), text("new"));
    }
}
