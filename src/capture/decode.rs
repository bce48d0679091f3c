//! Undo `content-encoding` on a captured copy (the client always receives the original bytes).

use std::io::Read;

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("cannot decode {encoding} body: {source}")]
    Corrupt {
        encoding: String,
        #[source]
        source: std::io::Error,
    },
    #[error("unsupported content-encoding {0:?}")]
    Unsupported(String),
}

/// A decoded body: at most the cap's bytes of it.
#[derive(Debug, PartialEq)]
pub struct Decoded {
    pub bytes: Vec<u8>,
    /// Decoding produced more than the cap; `bytes` holds the first `cap` bytes. A compression bomb (a 0.3 MB gzip
    /// body that inflates to 300 MiB) ends here instead of exhausting memory.
    pub truncated: bool,
}

/// Decode `body` according to a `content-encoding` header value (possibly a list, applied in order), producing
/// at most `cap` bytes at every stage.
pub fn decode_body(encoding: Option<&str>, body: Vec<u8>, cap: usize) -> Result<Decoded, DecodeError> {
    let Some(encoding) = encoding else {
        return Ok(Decoded {
            bytes: body,
            truncated: false,
        });
    };
    let mut data = body;
    let mut truncated = false;
    // Encodings are listed in the order they were applied; undo them in reverse.
    for enc in encoding.split(',').map(str::trim).rev() {
        let lower = enc.to_ascii_lowercase();
        data = match lower.as_str() {
            "" | "identity" => data,
            "gzip" | "x-gzip" => read_capped(
                &lower,
                flate2::read::MultiGzDecoder::new(&data[..]),
                cap,
                &mut truncated,
            )?,
            "deflate" => {
                // Servers disagree on whether "deflate" is zlib-wrapped; try zlib first, then raw deflate.
                let mut zlib_truncated = false;
                match read_capped(
                    &lower,
                    flate2::read::ZlibDecoder::new(&data[..]),
                    cap,
                    &mut zlib_truncated,
                ) {
                    Ok(out) => {
                        truncated |= zlib_truncated;
                        out
                    }
                    Err(_) => read_capped(
                        &lower,
                        flate2::read::DeflateDecoder::new(&data[..]),
                        cap,
                        &mut truncated,
                    )?,
                }
            }
            "br" => read_capped(
                &lower,
                brotli_decompressor::Decompressor::new(&data[..], 64 * 1024),
                cap,
                &mut truncated,
            )?,
            "zstd" => {
                let decoder = zstd::stream::read::Decoder::new(&data[..]).map_err(|source| DecodeError::Corrupt {
                    encoding: lower.clone(),
                    source,
                })?;
                read_capped(&lower, decoder, cap, &mut truncated)?
            }
            other => return Err(DecodeError::Unsupported(other.to_owned())),
        };
    }
    Ok(Decoded { bytes: data, truncated })
}

/// Past this much decoded output, [`read_capped`] reserves the rest of the cap in one step.
const RESERVE_WHOLE_CAP_PAST: usize = 1 << 20;

/// Read at most `cap` bytes, in a buffer that never grows past `cap` (`read_to_end` doubles its buffer: reading
/// `cap + 1` bytes ended with room for `2 × cap`, and the copy made while growing held both). Whether there was
/// more is learnt from one byte read on the side (the rest is never inflated). A cut stream's error after the
/// cap does not matter: what is kept decoded cleanly.
fn read_capped(
    encoding: &str,
    mut reader: impl Read,
    cap: usize,
    truncated: &mut bool,
) -> Result<Vec<u8>, DecodeError> {
    let corrupt = |source| DecodeError::Corrupt {
        encoding: encoding.to_owned(),
        source,
    };
    let mut out: Vec<u8> = Vec::new();
    let mut block = [0u8; 16 * 1024];
    while out.len() < cap {
        let want = block.len().min(cap - out.len());
        let n = match reader.read(&mut block[..want]) {
            Ok(0) => return Ok(out),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(corrupt(e)),
        };
        if out.capacity() - out.len() < n {
            // Double, as a `Vec` would, up to [`RESERVE_WHOLE_CAP_PAST`]; then room for the whole cap at once.
            // Growing a large body by doubling held the outgrown buffer next to its copy (1.5 times the body)
            // and left the freed ones to the allocator: a bomb's peak was twice the cap before it was even
            // escaped. Room reserved and not written costs address space, not resident memory.
            let doubled = (out.capacity() * 2).max(8 * 1024);
            let target = if doubled > RESERVE_WHOLE_CAP_PAST {
                cap
            } else {
                doubled.min(cap)
            };
            out.reserve_exact((target - out.len()).max(n));
        }
        out.extend_from_slice(&block[..n]);
    }
    let mut probe = [0u8; 1];
    loop {
        match reader.read(&mut probe) {
            Ok(0) => break,
            Ok(_) => {
                *truncated = true;
                break;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            // The cap was reached cleanly; what lies past it is not kept.
            Err(_) => {
                *truncated = true;
                break;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn gzip_roundtrip_and_identity() {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(b"{\"a\":1}").unwrap();
        let gz = enc.finish().unwrap();
        assert_eq!(decode_body(Some("gzip"), gz, CAP).unwrap().bytes, b"{\"a\":1}");
        assert_eq!(decode_body(None, b"x".to_vec(), CAP).unwrap().bytes, b"x");
        assert!(decode_body(Some("gzip"), b"not gzip".to_vec(), CAP).is_err());
        let zst = zstd::encode_all(&b"{\"b\":2}"[..], 3).unwrap();
        assert_eq!(decode_body(Some("zstd"), zst.clone(), CAP).unwrap().bytes, b"{\"b\":2}");
        assert!(
            decode_body(Some("zstd"), zst[..zst.len() - 2].to_vec(), CAP).is_err(),
            "a cut frame"
        );
        assert!(matches!(
            decode_body(Some("snappy"), vec![], CAP),
            Err(DecodeError::Unsupported(_))
        ));
    }

    const CAP: usize = 1 << 20;

    #[test]
    fn a_bomb_is_cut_at_the_cap_in_every_encoding() {
        let zeros = vec![0u8; 8 << 20];
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(&zeros).unwrap();
        let gz = gz.finish().unwrap();
        let zst = zstd::encode_all(&zeros[..], 3).unwrap();
        for (encoding, body) in [
            ("gzip", gz.clone()),
            ("zstd", zst),
            ("gzip, gzip", {
                let mut outer = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
                outer.write_all(&gz).unwrap();
                outer.finish().unwrap()
            }),
        ] {
            let decoded = decode_body(Some(encoding), body, CAP).unwrap();
            assert!(decoded.truncated, "{encoding}");
            assert_eq!(decoded.bytes.len(), CAP, "{encoding}");
            assert_eq!(
                decoded.bytes.capacity(),
                CAP,
                "{encoding}: the buffer never grew past the cap"
            );
        }
        let small = decode_body(Some("gzip"), gz, 8 << 20).unwrap();
        assert!(!small.truncated, "exactly the cap is not truncated");
        assert_eq!(small.bytes.len(), 8 << 20);
    }
}
