//! How bodies are kept in the store: zlib, one compressor and one decompressor state per thread.
//!
//! Both directions run the same streaming loop ([`run_to_end`]), growing the output as needed. The states are reused (reset between bodies):
//! creating one allocates and zeroes hundreds of kilobytes, which was the largest cost of storing an exchange
//! (see README, Benchmarks).

use std::cell::RefCell;

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

thread_local! {
    /// One deflate state per thread, reset between bodies (`ZlibEncoder::new` zeroed ~300 KB per body).
    static DEFLATE: RefCell<Compress> = RefCell::new(Compress::new(Compression::fast(), true));
    /// One inflate state per thread, reset between bodies (the exporter reads thousands of bodies a second).
    static INFLATE: RefCell<Decompress> = RefCell::new(Decompress::new(true));
}

/// zlib-compress a body for the store (empty if the encoder failed, which the reader reports as unreadable).
pub(crate) fn compress(text: &str) -> Vec<u8> {
    DEFLATE.with(|d| {
        let mut d = d.borrow_mut();
        d.reset();
        let out = Vec::with_capacity(text.len() / 3 + 64);
        run_to_end(&mut *d, text.as_bytes(), out).unwrap_or_default()
    })
}

/// A body written by [`compress`]; None if the blob is missing, truncated or not UTF-8.
pub(crate) fn decompress(blob: Option<Vec<u8>>) -> Option<String> {
    let blob = blob?;
    INFLATE.with(|d| {
        let mut d = d.borrow_mut();
        d.reset(true);
        let out = Vec::with_capacity(blob.len().saturating_mul(4).max(64));
        run_to_end(&mut *d, &blob, out).and_then(|out| String::from_utf8(out).ok())
    })
}

/// One direction of zlib, as the streaming loop below drives it.
trait ZlibStream {
    fn totals(&self) -> (u64, u64);
    fn step(&mut self, input: &[u8], out: &mut Vec<u8>) -> Option<Status>;
}

impl ZlibStream for Compress {
    fn totals(&self) -> (u64, u64) {
        (self.total_in(), self.total_out())
    }
    fn step(&mut self, input: &[u8], out: &mut Vec<u8>) -> Option<Status> {
        self.compress_vec(input, out, FlushCompress::Finish).ok()
    }
}

impl ZlibStream for Decompress {
    fn totals(&self) -> (u64, u64) {
        (self.total_in(), self.total_out())
    }
    fn step(&mut self, input: &[u8], out: &mut Vec<u8>) -> Option<Status> {
        // Not `Finish`: miniz reads that as "the output buffer holds everything" and fails otherwise.
        self.decompress_vec(input, out, FlushDecompress::None).ok()
    }
}

/// Feed all of `input` through a freshly reset `stream`, growing `out` as needed, until the stream ends. None
/// on an error, or when the stream stops moving with room left to write (an inflate input that ended early).
fn run_to_end(stream: &mut impl ZlibStream, input: &[u8], mut out: Vec<u8>) -> Option<Vec<u8>> {
    loop {
        if out.len() == out.capacity() {
            out.reserve(out.capacity().max(64));
        }
        let before = stream.totals();
        let rest = &input[before.0 as usize..];
        match stream.step(rest, &mut out)? {
            Status::StreamEnd => return Some(out),
            _ if before == stream.totals() && out.len() < out.capacity() => return None,
            _ => {}
        }
    }
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
