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

/// Read at most `cap` bytes; one byte more tells that there was more (the rest is never inflated). A cut
/// stream's error after the cap does not matter: what is kept decoded cleanly.
fn read_capped(encoding: &str, reader: impl Read, cap: usize, truncated: &mut bool) -> Result<Vec<u8>, DecodeError> {
    let mut out = Vec::new();
    let limit = u64::try_from(cap).unwrap_or(u64::MAX).saturating_add(1);
    reader
        .take(limit)
        .read_to_end(&mut out)
        .map_err(|source| DecodeError::Corrupt {
            encoding: encoding.to_owned(),
            source,
        })?;
    if out.len() > cap {
        out.truncate(cap);
        *truncated = true;
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
        }
        let small = decode_body(Some("gzip"), gz, 8 << 20).unwrap();
        assert!(!small.truncated, "exactly the cap is not truncated");
        assert_eq!(small.bytes.len(), 8 << 20);
    }
}
