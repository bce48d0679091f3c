//! The canonical model shared by adapters, derivation, the store and the exporters.

pub mod call;
pub mod json;
pub mod step;
pub mod trace;
pub mod usage;

use sha2::{Digest, Sha256};

/// First 16 hex digits of SHA-256: the short content hash used for ids and references.
pub fn short_hash(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut out = String::with_capacity(16);
    for b in &digest[..8] {
        out.push_str(&format!("{b:02x}"));
    }
    out
}
