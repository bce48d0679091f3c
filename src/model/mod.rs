//! The canonical model shared by adapters, derivation, the store and the exporters.

pub mod annotation;
pub mod call;
pub mod cost;
pub mod exchange;
pub mod format;
pub mod json;
pub mod record;
pub mod step;
pub mod trace;
pub mod usage;

use sha2::{Digest, Sha256};

/// First 16 hex digits of SHA-256: the short content hash used for ids and references.
pub fn short_hash(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digest = Sha256::digest(bytes);
    let mut out = String::with_capacity(16);
    // Runs several times per derived call: a table, not `format!` per byte.
    for b in &digest[..8] {
        out.push(HEX[usize::from(b >> 4)] as char);
        out.push(HEX[usize::from(b & 0xf)] as char);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn short_hash_is_the_first_8_bytes_of_sha256_in_hex() {
        // SHA-256("abc") = ba7816bf8f01cfea414140de5dae2223...
        assert_eq!(super::short_hash(b"abc"), "ba7816bf8f01cfea");
    }
}
