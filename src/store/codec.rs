//! How bodies are kept in the store: zstd (level [`LEVEL`]), one compression and one decompression context
//! per thread; bodies below [`PLAIN_BELOW`] bytes as they are, behind [`PLAIN_MAGIC`] and a CRC-32. Rows
//! written before zstd hold zlib streams; they are still read (neither magic number is a valid zlib header, so
//! the first bytes tell which codec wrote a blob).
//!
//! Why zstd and not zlib: the store thread used to spend ~68% of its instructions resetting its deflate state
//! (miniz zeroes its hash tables on every reset, hundreds of kilobytes per body, however small the body), and on
//! a 2-core machine that background work competes with the proxy's workers. A reused zstd context sizes its
//! tables to the input and does not clear them between frames. On the recorded corpus (`llmtap-bench codec`)
//! zstd level 1 compressed 2.59:1 at ~28 µs per body, zlib level 1 2.42:1 at ~66 µs (README, Benchmarks).

use std::cell::RefCell;
use std::io::Read;

/// zstd level: 1 is its fastest regular level; higher levels gained little on recorded traffic (level 3: 2.60:1
/// at 1.4x the time).
const LEVEL: i32 = 1;

/// The first four bytes of every zstd frame (RFC 8878 §3.1.1, little-endian 0xFD2FB528).
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];

/// Bodies shorter than this are stored plain. A zstd frame costs the store thread a fixed setup (its match
/// and entropy tables) whatever the input's size; below this size that setup is most of the store thread's
/// compression time and the bytes saved are few (`llmtap-bench store-rate` and `bytes`, docs/performance.md,
/// "Store writer CPU per exchange").
const PLAIN_BELOW: usize = 1024;

/// The first four bytes of a plain body; then the CRC-32 of the bytes (little-endian), then the bytes. `L`
/// (0x4C) is no zlib header (compression method 8 in the low nibble) and no zstd magic.
const PLAIN_MAGIC: [u8; 4] = *b"LTP1";

/// A declared content size above this is not trusted for a single up-front allocation; such a frame is
/// decoded as a stream instead (it grows its output only as real data arrives).
const MAX_PREALLOC: u64 = 256 << 20;

thread_local! {
    /// `None` if zstd could not allocate a context (then bodies are stored empty and read back as unreadable).
    static COMPRESSOR: RefCell<Option<zstd::bulk::Compressor<'static>>> = RefCell::new(new_compressor().ok());
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        RefCell::new(zstd::bulk::Decompressor::new().ok());
}

/// Frames carry their content size (the reader allocates once) and a checksum (a damaged body reads back as
/// unreadable rather than as different text: without it, a flipped byte in an uncompressed literal passes).
fn new_compressor() -> std::io::Result<zstd::bulk::Compressor<'static>> {
    let mut c = zstd::bulk::Compressor::new(LEVEL)?;
    c.include_contentsize(true)?;
    c.include_checksum(true)?;
    Ok(c)
}

/// Compress a body for the store (empty if the encoder failed, which the reader reports as unreadable).
pub fn compress(text: &str) -> Vec<u8> {
    compress_bytes(text.as_bytes())
}

/// [`compress`] as a zstd frame whatever the size: for what is written once and read back many times (a
/// chunk of a conversation, see `chunks.rs`), where the bytes matter more than the writer's time.
pub fn compress_frame(text: &str) -> Vec<u8> {
    zstd_frame(text.as_bytes())
}

/// [`compress`] for bytes that are not text (a body manifest, see `chunks.rs`).
pub fn compress_bytes(bytes: &[u8]) -> Vec<u8> {
    if bytes.len() < PLAIN_BELOW {
        return plain(bytes);
    }
    zstd_frame(bytes)
}

fn zstd_frame(bytes: &[u8]) -> Vec<u8> {
    COMPRESSOR.with(|c| {
        c.borrow_mut()
            .as_mut()
            .and_then(|c| c.compress(bytes).ok())
            .unwrap_or_default()
    })
}

/// The checksum guards plain bodies as zstd's guards frames: a damaged one reads back as unreadable.
fn plain(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PLAIN_MAGIC.len() + 4 + bytes.len());
    out.extend_from_slice(&PLAIN_MAGIC);
    out.extend_from_slice(&crc32fast::hash(bytes).to_le_bytes());
    out.extend_from_slice(bytes);
    out
}

/// A blob written by [`plain`]; None if it is not one or is damaged.
fn unplain(blob: &[u8]) -> Option<Vec<u8>> {
    let (crc, bytes) = blob.strip_prefix(&PLAIN_MAGIC)?.split_at_checked(4)?;
    (crc == crc32fast::hash(bytes).to_le_bytes()).then(|| bytes.to_vec())
}

/// A blob written by [`compress_bytes`]; None if it is not one or is damaged.
pub fn decompress_bytes(blob: &[u8]) -> Option<Vec<u8>> {
    if blob.starts_with(&ZSTD_MAGIC) {
        unzstd(blob)
    } else {
        unplain(blob)
    }
}

/// A body written by [`compress`] (or by an earlier version's zlib); None if the blob is missing, truncated,
/// corrupt or not UTF-8.
pub fn decompress(blob: Option<Vec<u8>>) -> Option<String> {
    let blob = blob?;
    let bytes = if blob.starts_with(&ZSTD_MAGIC) {
        unzstd(&blob)?
    } else if blob.starts_with(&PLAIN_MAGIC) {
        unplain(&blob)?
    } else {
        inflate(&blob)?
    };
    String::from_utf8(bytes).ok()
}

fn unzstd(blob: &[u8]) -> Option<Vec<u8>> {
    match zstd::zstd_safe::get_frame_content_size(blob) {
        Ok(Some(size)) if size <= MAX_PREALLOC => DECOMPRESSOR.with(|d| {
            let mut d = d.borrow_mut();
            let out = d.as_mut()?.decompress(blob, size as usize).ok()?;
            // A frame that produced less than it declared was cut or tampered with.
            (out.len() as u64 == size).then_some(out)
        }),
        // Size not recorded, or too large to trust: decode as a stream.
        Ok(_) => {
            let mut out = Vec::new();
            zstd::stream::read::Decoder::new(blob)
                .ok()?
                .read_to_end(&mut out)
                .ok()?;
            Some(out)
        }
        Err(_) => None,
    }
}

/// A zlib stream (rows written before zstd: rare, so no state is kept for them).
fn inflate(blob: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(blob.len().saturating_mul(4));
    flate2::read::ZlibDecoder::new(blob).read_to_end(&mut out).ok()?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::{compress, decompress};

    #[test]
    fn bodies_round_trip_through_the_reused_contexts() {
        let big: String = (0..200_000)
            .map(|i| format!("line {i} {}\n", i * 7919 % 1000))
            .collect();
        let small = "x".repeat(super::PLAIN_BELOW - 1);
        let just_big = "x".repeat(super::PLAIN_BELOW);
        for text in ["", "{}", "{\"a\":\"é ✓\"}", &small, &just_big, big.as_str(), "{}"] {
            let blob = compress(text);
            let magic = if text.len() < super::PLAIN_BELOW {
                super::PLAIN_MAGIC
            } else {
                super::ZSTD_MAGIC
            };
            assert!(blob.starts_with(&magic), "{} bytes", text.len());
            assert_eq!(decompress(Some(blob.clone())).as_deref(), Some(text));
            assert_eq!(super::decompress_bytes(&blob).as_deref(), Some(text.as_bytes()));
            let frame = super::compress_frame(text);
            assert!(frame.starts_with(&super::ZSTD_MAGIC), "{} bytes", text.len());
            assert_eq!(decompress(Some(frame)).as_deref(), Some(text));
        }
        let blob = compress(&big);
        assert!(blob.len() < big.len() / 3, "{} of {}", blob.len(), big.len());
        // A cut blob is reported as unreadable, and the state is still good for the next body.
        assert_eq!(decompress(Some(blob[..blob.len() / 2].to_vec())), None);
        assert_eq!(decompress(Some(b"not zlib".to_vec())), None);
        let blob = compress(&big);
        for at in (0..blob.len()).step_by(blob.len() / 40) {
            let mut corrupt = blob.clone();
            corrupt[at] ^= 0x5a;
            assert_eq!(
                decompress(Some(corrupt)),
                None,
                "byte {at} damaged: unreadable, not other text"
            );
        }
        assert_eq!(decompress(Some(compress("ok"))).as_deref(), Some("ok"));
        // A plain body: damaged or cut, it is unreadable too.
        let blob = compress("{\"a\":\"é ✓\"}");
        for at in 0..blob.len() {
            let mut corrupt = blob.clone();
            corrupt[at] ^= 0x5a;
            assert_eq!(decompress(Some(corrupt)), None, "plain byte {at} damaged");
        }
        assert_eq!(decompress(Some(blob[..blob.len() - 1].to_vec())), None);
    }

    /// Stores written before zstd hold zlib streams; they still read back, cut ones as unreadable.
    #[test]
    fn zlib_bodies_from_earlier_versions_still_read() {
        use std::io::Write;
        let big: String = (0..50_000).map(|i| format!("{{\"n\":{i}}}\n")).collect();
        for text in ["", "{\"a\":\"é ✓\"}", big.as_str()] {
            let mut enc = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
            enc.write_all(text.as_bytes()).unwrap();
            let blob = enc.finish().unwrap();
            assert_eq!(blob[0], 0x78, "zlib header");
            assert_eq!(decompress(Some(blob.clone())).as_deref(), Some(text));
            if !text.is_empty() {
                assert_eq!(decompress(Some(blob[..blob.len() - 5].to_vec())), None);
            }
        }
    }

    /// Every recorded body (requests, JSON and SSE responses) comes back byte for byte: streaming inflate
    /// must cope with outputs many times larger than the blob.
    #[test]
    fn every_fixture_body_round_trips_through_the_store_codec() {
        let mut n = 0;
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
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
