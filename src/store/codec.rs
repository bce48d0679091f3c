//! How bodies are kept in the store: zlib, one compressor and one decompressor state per thread.
//!
//! Both run a streaming loop that grows the output as needed. The states are reused (reset between bodies):
//! creating one allocates and zeroes hundreds of kilobytes, which was the largest cost of storing an exchange
//! (see README, Benchmarks).

use std::cell::RefCell;

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

thread_local! {
    /// One deflate state per thread, reset between bodies (`ZlibEncoder::new` zeroed ~300 KB per body).
    static DEFLATE: RefCell<Compress> = RefCell::new(Compress::new(Compression::fast(), true));
}

/// zlib-compress a body for the store.
pub(crate) fn compress(text: &str) -> Vec<u8> {
    DEFLATE.with(|d| {
        let mut d = d.borrow_mut();
        d.reset();
        let input = text.as_bytes();
        let mut out = Vec::with_capacity(input.len() / 3 + 64);
        loop {
            if out.len() == out.capacity() {
                out.reserve(out.capacity());
            }
            let before = (d.total_in(), d.total_out());
            let rest = &input[d.total_in() as usize..];
            match d.compress_vec(rest, &mut out, FlushCompress::Finish) {
                Ok(Status::StreamEnd) => return out,
                // With room in `out` the encoder always moves; if it did not, give up rather than spin.
                Ok(_) if before == (d.total_in(), d.total_out()) && out.len() < out.capacity() => return Vec::new(),
                Ok(_) => {}
                Err(_) => return Vec::new(),
            }
        }
    })
}

thread_local! {
    /// One inflate state per thread, reset between bodies (the exporter reads thousands of bodies a second).
    static INFLATE: RefCell<Decompress> = RefCell::new(Decompress::new(true));
}

/// A body written by `write::compress`; None if the blob is missing, truncated or not UTF-8.
pub(crate) fn decompress(blob: Option<Vec<u8>>) -> Option<String> {
    let blob = blob?;
    INFLATE.with(|d| {
        let mut d = d.borrow_mut();
        d.reset(true);
        let mut out = Vec::with_capacity(blob.len().saturating_mul(4).max(64));
        loop {
            if out.len() == out.capacity() {
                out.reserve(out.capacity());
            }
            let before = (d.total_in(), d.total_out());
            let rest = &blob[d.total_in() as usize..];
            // Not `Finish`: miniz reads that as "the output buffer holds everything" and fails otherwise.
            match d.decompress_vec(rest, &mut out, FlushDecompress::None) {
                Ok(Status::StreamEnd) => return String::from_utf8(out).ok(),
                // No progress with room to write: the input ended early.
                Ok(_) if before == (d.total_in(), d.total_out()) && out.len() < out.capacity() => return None,
                Ok(_) => {}
                Err(_) => return None,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::{compress, decompress};

    #[test]
    fn bodies_round_trip_through_the_reused_deflate_and_inflate_states() {
        let big: String = (0..200_000)
            .map(|i| format!("line {i} {}\n", i * 7919 % 1000))
            .collect();
        for text in ["", "{}", "{\"a\":\"é ✓\"}", big.as_str(), "{}"] {
            let blob = compress(text);
            assert!(!blob.is_empty(), "a zlib stream has a header even for empty input");
            assert_eq!(decompress(Some(blob)).as_deref(), Some(text));
        }
        let blob = compress(&big);
        assert!(blob.len() < big.len() / 3, "{} of {}", blob.len(), big.len());
        // A cut blob is reported as unreadable, and the state is still good for the next body.
        assert_eq!(decompress(Some(blob[..blob.len() / 2].to_vec())), None);
        assert_eq!(decompress(Some(b"not zlib".to_vec())), None);
        assert_eq!(decompress(Some(compress("ok"))).as_deref(), Some("ok"));
    }

    /// Every recorded body (requests, JSON and SSE responses) comes back byte for byte: streaming inflate
    /// must cope with outputs many times larger than the blob.
    #[test]
    fn every_fixture_body_round_trips_through_the_store_codec() {
        let mut n = 0;
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures");
        for entry in walkdir(&fixtures) {
            let Ok(text) = std::fs::read_to_string(&entry) else {
                continue;
            };
            let blob = compress(&text);
            let back = decompress(Some(blob));
            assert_eq!(back.as_deref(), Some(text.as_str()), "{entry:?}");
            n += 1;
        }
        assert!(n > 10, "{n}");
    }
    fn walkdir(p: &std::path::Path) -> Vec<std::path::PathBuf> {
        let mut out = Vec::new();
        if let Ok(rd) = std::fs::read_dir(p) {
            for e in rd.flatten() {
                let path = e.path();
                if path.is_dir() {
                    out.extend(walkdir(&path));
                } else {
                    out.push(path);
                }
            }
        }
        out
    }
}
