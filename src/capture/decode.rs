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

/// Decode `body` according to a `content-encoding` header value (possibly a list, applied in order).
pub fn decode_body(encoding: Option<&str>, body: Vec<u8>) -> Result<Vec<u8>, DecodeError> {
    let Some(encoding) = encoding else {
        return Ok(body);
    };
    let mut data = body;
    // Encodings are listed in the order they were applied; undo them in reverse.
    for enc in encoding.split(',').map(str::trim).rev() {
        let lower = enc.to_ascii_lowercase();
        data = match lower.as_str() {
            "" | "identity" => data,
            "gzip" | "x-gzip" => read_all(&lower, flate2::read::MultiGzDecoder::new(&data[..]))?,
            "deflate" => {
                // Servers disagree on whether "deflate" is zlib-wrapped; try zlib first, then raw deflate.
                read_all(&lower, flate2::read::ZlibDecoder::new(&data[..]))
                    .or_else(|_| read_all(&lower, flate2::read::DeflateDecoder::new(&data[..])))?
            }
            "br" => read_all(&lower, brotli_decompressor::Decompressor::new(&data[..], 64 * 1024))?,
            "zstd" => {
                let decoder = zstd::stream::read::Decoder::new(&data[..]).map_err(|source| DecodeError::Corrupt {
                    encoding: lower.clone(),
                    source,
                })?;
                read_all(&lower, decoder)?
            }
            other => return Err(DecodeError::Unsupported(other.to_owned())),
        };
    }
    Ok(data)
}

fn read_all(encoding: &str, mut reader: impl Read) -> Result<Vec<u8>, DecodeError> {
    let mut out = Vec::new();
    reader.read_to_end(&mut out).map_err(|source| DecodeError::Corrupt {
        encoding: encoding.to_owned(),
        source,
    })?;
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
        assert_eq!(decode_body(Some("gzip"), gz).unwrap(), b"{\"a\":1}");
        assert_eq!(decode_body(None, b"x".to_vec()).unwrap(), b"x");
        assert!(decode_body(Some("gzip"), b"not gzip".to_vec()).is_err());
        let zst = zstd::encode_all(&b"{\"b\":2}"[..], 3).unwrap();
        assert_eq!(decode_body(Some("zstd"), zst.clone()).unwrap(), b"{\"b\":2}");
        assert!(
            decode_body(Some("zstd"), zst[..zst.len() - 2].to_vec()).is_err(),
            "a cut frame"
        );
        assert!(matches!(
            decode_body(Some("snappy"), vec![]),
            Err(DecodeError::Unsupported(_))
        ));
    }
}
