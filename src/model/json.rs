//! `Json<'a>`: a read-only JSON tree that borrows its strings from the bytes it was parsed from.
//!
//! Why not `serde_json::Value`: normalizing a call reads every request, and a 20-message request is mostly
//! strings. Building a `Value` allocates each string and an ordered hash map per object; that was half of the
//! derivation time (see README, Benchmarks). Here strings without escapes are borrowed from the body, objects are
//! small vectors of pairs in wire order (lookups are linear: provider objects have a handful of keys), and the
//! parsing itself is still serde_json's. Adapters read requests and responses through this one type; they turn a
//! piece into an owned `Value` only where the normalized call keeps it (tool parameters, arguments, raw usage).

use std::borrow::Cow;
use std::fmt;

use bytes::Bytes;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};
use serde_json::{Number, Value};

#[derive(Debug, Clone, PartialEq, Default)]
pub enum Json<'a> {
    #[default]
    Null,
    Bool(bool),
    Number(Number),
    String(Cow<'a, str>),
    Array(Vec<Json<'a>>),
    /// Members in wire order; a repeated key keeps every occurrence and `get` finds the last (as serde_json's
    /// parse keeps the last value).
    Object(Vec<(Cow<'a, str>, Json<'a>)>),
}

static NULL: Json<'static> = Json::Null;

impl<'a> Json<'a> {
    /// Parse `text`, borrowing every string that has no escapes.
    pub fn parse(text: &'a str) -> Result<Json<'a>, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Parse bytes: UTF-8 is checked once for the whole text (serde_json's slice reader checks each string
    /// separately, which costs more on string-heavy bodies).
    pub fn parse_slice(bytes: &'a [u8]) -> Result<Json<'a>, serde_json::Error> {
        match std::str::from_utf8(bytes) {
            Ok(text) => serde_json::from_str(text),
            // Let serde_json report where the text is not UTF-8.
            Err(_) => serde_json::from_slice(bytes),
        }
    }

    /// A view of an owned value (borrows its strings; allocates only the vectors of the tree).
    pub fn from_value(v: &'a Value) -> Json<'a> {
        match v {
            Value::Null => Json::Null,
            Value::Bool(b) => Json::Bool(*b),
            Value::Number(n) => Json::Number(n.clone()),
            Value::String(s) => Json::String(Cow::Borrowed(s)),
            Value::Array(a) => Json::Array(a.iter().map(Json::from_value).collect()),
            Value::Object(m) => Json::Object(
                m.iter()
                    .map(|(k, v)| (Cow::Borrowed(k.as_str()), Json::from_value(v)))
                    .collect(),
            ),
        }
    }

    /// An owned copy.
    pub fn to_value(&self) -> Value {
        match self {
            Json::Null => Value::Null,
            Json::Bool(b) => Value::Bool(*b),
            Json::Number(n) => Value::Number(n.clone()),
            Json::String(s) => Value::String(s.clone().into_owned()),
            Json::Array(a) => Value::Array(a.iter().map(Json::to_value).collect()),
            Json::Object(m) => {
                let mut out = serde_json::Map::with_capacity(m.len());
                for (k, v) in m {
                    // Last occurrence wins, as when serde_json parses the same text.
                    out.insert(k.clone().into_owned(), v.to_value());
                }
                Value::Object(out)
            }
        }
    }

    /// The member `key` of an object; None for anything else.
    pub fn get(&self, key: &str) -> Option<&Json<'a>> {
        match self {
            Json::Object(m) => m.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// Element `i` of an array.
    pub fn at(&self, i: usize) -> Option<&Json<'a>> {
        match self {
            Json::Array(a) => a.get(i),
            _ => None,
        }
    }

    /// The member `key`, or Null: for chains where absent and null mean the same.
    pub fn field(&self, key: &str) -> &Json<'a> {
        self.get(key).unwrap_or(&NULL)
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Json<'a>]> {
        match self {
            Json::Array(a) => Some(a),
            _ => None,
        }
    }

    pub fn as_object(&self) -> Option<&[(Cow<'a, str>, Json<'a>)]> {
        match self {
            Json::Object(m) => Some(m),
            _ => None,
        }
    }

    /// The elements if an array, else nothing: `for m in v.items()`.
    pub fn items(&self) -> std::slice::Iter<'_, Json<'a>> {
        self.as_array().unwrap_or(&[]).iter()
    }

    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Json::Number(n) => n.as_u64(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Json::Number(n) => n.as_i64(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Json::Number(n) => n.as_f64(),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Json::Bool(b) => Some(*b),
            _ => None,
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(self, Json::Null)
    }

    pub fn is_object(&self) -> bool {
        matches!(self, Json::Object(_))
    }

    pub fn is_array(&self) -> bool {
        matches!(self, Json::Array(_))
    }

    pub fn is_string(&self) -> bool {
        matches!(self, Json::String(_))
    }

    /// An owned copy of the string at `key`.
    pub fn owned_str(&self, key: &str) -> Option<String> {
        self.get(key).and_then(Json::as_str).map(str::to_owned)
    }

    pub fn str_at(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Json::as_str)
    }
}

/// Compact JSON, as `serde_json::Value` prints it.
impl fmt::Display for Json<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match serde_json::to_string(self) {
            Ok(s) => f.write_str(&s),
            Err(_) => Err(fmt::Error),
        }
    }
}

impl Serialize for Json<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Json::Null => s.serialize_unit(),
            Json::Bool(b) => s.serialize_bool(*b),
            Json::Number(n) => n.serialize(s),
            Json::String(v) => s.serialize_str(v),
            Json::Array(a) => {
                let mut seq = s.serialize_seq(Some(a.len()))?;
                for v in a {
                    seq.serialize_element(v)?;
                }
                seq.end()
            }
            Json::Object(m) => {
                let mut map = s.serialize_map(Some(m.len()))?;
                for (k, v) in m {
                    map.serialize_entry(k.as_ref(), v)?;
                }
                map.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for Json<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

/// A key that borrows when the text has no escapes.
struct Key<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string key")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Json<'de>, E> {
        Ok(Json::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Json<'de>, E> {
        Ok(Json::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Json<'de>, D::Error> {
        Json::deserialize(d)
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Json<'de>, E> {
        Ok(Json::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Json<'de>, E> {
        Ok(Json::Number(v.into()))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Json<'de>, E> {
        Ok(Json::Number(v.into()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Json<'de>, E> {
        Ok(Number::from_f64(v).map_or(Json::Null, Json::Number))
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Borrowed(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Owned(v)))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json<'de>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(v) = seq.next_element()? {
            out.push(v);
        }
        Ok(Json::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json<'de>, A::Error> {
        let mut out = Vec::with_capacity(map.size_hint().unwrap_or(0));
        while let Some((Key(k), v)) = map.next_entry::<Key<'de>, Json<'de>>()? {
            out.push((k, v));
        }
        Ok(Json::Object(out))
    }
}

/// A body kept as JSON text: the bytes as received when they are valid JSON on one line (the common case, so
/// the pipeline neither copies nor re-serializes a request), otherwise their compact re-serialization. Empty
/// means no body (JSON null). Cheap to clone. Written to the store as-is, parsed only by who reads it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct JsonText(Bytes);

impl JsonText {
    /// `bytes` if they are valid JSON: the view parsed from them, and the text to keep. Invalid JSON → None.
    pub fn parse(bytes: &Bytes) -> Option<(Json<'_>, JsonText)> {
        let view = Json::parse_slice(bytes).ok()?;
        // JSON whitespace may hold raw line breaks; one-line text embeds in JSONL exports verbatim.
        let text = if memchr::memchr2(b'\n', b'\r', bytes).is_some() {
            JsonText(Bytes::from(view.to_string()))
        } else {
            JsonText(bytes.clone())
        };
        Some((view, text))
    }

    pub fn from_value(v: &Value) -> JsonText {
        if v.is_null() {
            JsonText::default()
        } else {
            JsonText(Bytes::from(v.to_string()))
        }
    }

    /// `text` as a JSON string (a body that was not JSON).
    pub fn string(text: &str) -> JsonText {
        JsonText::string_within(text.as_bytes().to_vec(), usize::MAX).0
    }

    /// `bytes` (invalid UTF-8 replaced) as a JSON string of at most `max` bytes, cut at a character when the
    /// whole would not fit, and whether it was cut. The text is escaped in place, in the buffer it came in: a
    /// body of control characters grows up to sixfold as JSON (`\u0000`), and escaping a decoded compression
    /// bomb into a second buffer held the decoded body and its escaped copy at once, twice the capture cap.
    /// First a pass measures how much of the input fits in `max`; the kept input is then moved to the end of
    /// the escaped length and escaped piece by piece from the front. A piece's escaped text is never shorter
    /// than the piece, so what is written never reaches input not yet read.
    pub fn string_within(mut buf: Vec<u8>, max: usize) -> (JsonText, bool) {
        let mut scratch = Vec::new();
        // Measure: the input kept (`kept`) and the escaped length with both quotes (`total`).
        let (mut kept, mut escaped, mut cut) = (0, 0usize, false);
        while let Some(piece) = next_piece(&buf[kept..]) {
            let n = escape_piece(&buf[kept..kept + piece.len], piece.valid, &mut scratch);
            // The opening quote, what is kept, this piece, and room for the closing quote.
            if 1 + escaped + n >= max {
                cut = true;
                break;
            }
            escaped += n;
            kept += piece.len;
        }
        let total = escaped + 2;
        // Escape: the kept input moved to just before the closing quote, then read from there and written
        // from the front. Written stays at or behind read: the escaped text of the input before any point is at
        // least as long as that input.
        buf.truncate(kept);
        buf.resize(total, 0);
        let from = total - 1 - kept;
        buf.copy_within(0..kept, from);
        buf[0] = b'"';
        let (mut write, mut read) = (1, from);
        while let Some(piece) = next_piece(&buf[read..total - 1]) {
            let n = escape_piece(&buf[read..read + piece.len], piece.valid, &mut scratch);
            buf[write..write + n].copy_from_slice(&scratch[1..=n]);
            write += n;
            read += piece.len;
        }
        buf[total - 1] = b'"';
        (JsonText(Bytes::from(buf)), cut)
    }

    /// Text made from a `JsonText` by replacing string values with other strings (see `pipeline::secrets`):
    /// still valid JSON on one line.
    pub fn from_redacted(text: String) -> JsonText {
        JsonText(Bytes::from(text))
    }

    /// Text read back from the store (written by `as_str`, so already compact JSON); None → null.
    pub fn from_stored(text: Option<String>) -> JsonText {
        text.map_or_else(JsonText::default, |t| JsonText(Bytes::from(t)))
    }

    pub fn is_null(&self) -> bool {
        self.0.is_empty() || &self.0[..] == b"null"
    }

    /// Bytes of JSON text held (0 when there is no body).
    pub fn byte_len(&self) -> usize {
        self.0.len()
    }

    /// The JSON text ("null" when there is no body).
    pub fn as_str(&self) -> &str {
        if self.0.is_empty() {
            return "null";
        }
        std::str::from_utf8(&self.0).unwrap_or("null")
    }

    /// A borrowed view (Null if the text does not parse, which construction rules out).
    pub fn view(&self) -> Json<'_> {
        Json::parse(self.as_str()).unwrap_or_default()
    }

    pub fn to_value(&self) -> Value {
        serde_json::from_str(self.as_str()).unwrap_or(Value::Null)
    }
}

/// Escaped at a time by [`JsonText::string_within`]: small enough that stopping at the limit wastes little.
const PIECE: usize = 4096;

/// A run of input that [`JsonText::string_within`] escapes at once.
struct Piece {
    len: usize,
    /// Valid UTF-8; else one invalid sequence, written as U+FFFD.
    valid: bool,
}

/// The next piece at the start of `text`: valid UTF-8 of at most [`PIECE`] bytes ending on a character, or one
/// invalid sequence. Only the first `PIECE + 3` bytes are looked at, so that the same input is cut the same way
/// whatever follows it beyond the piece (the measuring pass sees more input than the escaping one).
fn next_piece(text: &[u8]) -> Option<Piece> {
    let window = &text[..text.len().min(PIECE + 3)];
    let chunk = window.utf8_chunks().next()?;
    let valid = chunk.valid();
    if valid.is_empty() {
        return Some(Piece {
            len: chunk.invalid().len(),
            valid: false,
        });
    }
    let mut len = valid.len().min(PIECE);
    while !valid.is_char_boundary(len) {
        len -= 1;
    }
    Some(Piece { len, valid: true })
}

/// `piece` as serde_json writes it inside a string, into `out` (with the quotes around it, at `out[0]` and at
/// the end); the length without the quotes.
fn escape_piece(piece: &[u8], valid: bool, out: &mut Vec<u8>) -> usize {
    let text = match std::str::from_utf8(piece) {
        Ok(text) if valid => text,
        _ => "\u{FFFD}",
    };
    out.clear();
    // Writing a string into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, text);
    out.len() - 2
}

impl fmt::Debug for JsonText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Embedded verbatim (it is already JSON).
impl Serialize for JsonText {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match serde_json::from_str::<&serde_json::value::RawValue>(self.as_str()) {
            Ok(raw) => raw.serialize(s),
            Err(_) => s.serialize_unit(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn borrows_plain_strings_and_owns_escaped_ones() {
        let text = r#"{"a":"plain","b":"line\nbreak","c":[1,-2,3.5,true,null],"d":{"x":{}}}"#;
        let j = Json::parse(text).unwrap();
        assert!(matches!(j.get("a"), Some(Json::String(Cow::Borrowed("plain")))));
        assert!(matches!(j.get("b"), Some(Json::String(Cow::Owned(s))) if s == "line\nbreak"));
        assert_eq!(j.field("c").at(1).and_then(Json::as_i64), Some(-2));
        assert_eq!(j.field("c").at(2).and_then(Json::as_f64), Some(3.5));
        assert!(j.field("missing").field("deeper").is_null());
        // Same text as serde_json prints, same value as serde_json parses.
        let v: Value = serde_json::from_str(text).unwrap();
        assert_eq!(j.to_string(), v.to_string());
        assert_eq!(j.to_value(), v);
        assert_eq!(Json::from_value(&v), j);
    }

    #[test]
    fn keeps_wire_order_and_last_duplicate_for_get() {
        let j = Json::parse(r#"{"z":1,"a":2,"z":3}"#).unwrap();
        let keys: Vec<&str> = j.as_object().unwrap().iter().map(|(k, _)| k.as_ref()).collect();
        assert_eq!(keys, ["z", "a", "z"]);
        assert_eq!(j.get("z").and_then(Json::as_u64), Some(3));
        assert_eq!(j.to_value()["z"], 3);
    }

    #[test]
    fn json_text_keeps_one_line_bodies_and_compacts_the_rest() {
        let one_line = Bytes::from_static(br#"{"b": 1, "a": [true]}"#);
        let (view, text) = JsonText::parse(&one_line).unwrap();
        assert_eq!(text.as_str(), r#"{"b": 1, "a": [true]}"#);
        assert_eq!(view.get("b").and_then(Json::as_u64), Some(1));
        let pretty = Bytes::from_static(b"{\n  \"b\": 1,\r\n  \"a\": \"x\\ny\"\n}");
        let (_, text) = JsonText::parse(&pretty).unwrap();
        assert_eq!(text.as_str(), r#"{"b":1,"a":"x\ny"}"#);
        assert!(JsonText::parse(&Bytes::from_static(b"{not json")).is_none());
        assert_eq!(JsonText::string("a \"page\"\n").as_str(), r#""a \"page\"\n""#);
        assert!(JsonText::default().is_null());
        assert_eq!(JsonText::default().as_str(), "null");
        // Serialized inside a record, the body is embedded as JSON, not as a string.
        let rec = serde_json::json!({"request": serde_json::to_value(&text).unwrap()});
        assert_eq!(rec.to_string(), r#"{"request":{"b":1,"a":"x\ny"}}"#);
    }

    /// What `string_within` must produce: the text (invalid UTF-8 replaced) escaped by serde_json, cut at a
    /// piece boundary so that it fits in `max` with its quotes.
    fn escaped_by_serde(bytes: &[u8], max: usize) -> (String, bool) {
        let mut out = String::from("\"");
        let mut rest = bytes;
        while let Some(piece) = next_piece(rest) {
            let text = match std::str::from_utf8(&rest[..piece.len]) {
                Ok(t) if piece.valid => t.to_owned(),
                _ => "\u{FFFD}".to_owned(),
            };
            let escaped = serde_json::to_string(&text).unwrap();
            let inner = &escaped[1..escaped.len() - 1];
            if out.len() + inner.len() >= max {
                out.push('"');
                return (out, true);
            }
            out.push_str(inner);
            rest = &rest[piece.len..];
        }
        out.push('"');
        (out, false)
    }

    #[test]
    fn a_text_escaped_in_place_is_what_serde_json_writes_and_fits_its_limit() {
        // Control characters (six bytes each as JSON), quotes, multi-byte characters, invalid sequences (one
        // replacement character each) across piece boundaries, at lengths around the piece size.
        let mut seed = 7u64;
        let mut next = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as usize
        };
        let alphabet: [&[u8]; 9] = [
            b"a",
            b"\0",
            b"\"",
            b"\\",
            b"\n",
            "é".as_bytes(),
            "😀".as_bytes(),
            b"\xff",
            b"\xe2\x82",
        ];
        for round in 0..200 {
            let len = [10, PIECE - 1, PIECE + 2, 3 * PIECE + 5][round % 4];
            let mut bytes = Vec::new();
            while bytes.len() < len {
                bytes.extend_from_slice(alphabet[next() % alphabet.len()]);
            }
            for max in [usize::MAX, 2, 7, len, len + 2, 2 * len, 6 * len] {
                let (text, cut) = JsonText::string_within(bytes.clone(), max);
                let (expected, expected_cut) = escaped_by_serde(&bytes, max);
                assert_eq!(
                    (text.as_str(), cut),
                    (expected.as_str(), expected_cut),
                    "round {round}, max {max}"
                );
                assert!(text.byte_len() <= max.max(2), "round {round}, max {max}");
                let back: String = serde_json::from_str(text.as_str()).unwrap();
                if !cut {
                    assert_eq!(back, String::from_utf8_lossy(&bytes), "round {round}");
                }
            }
        }
        let zeros = JsonText::string_within(vec![0; 1 << 20], 1 << 20);
        assert!(zeros.1);
        let len = zeros.0.byte_len();
        assert!(
            len <= 1 << 20 && len > (1 << 20) - 6 * PIECE - 2,
            "{len}: as many whole pieces as fit"
        );
        assert_eq!(JsonText::string("a \"page\"\n").as_str(), r#""a \"page\"\n""#);
    }

    #[test]
    fn rejects_invalid_json() {
        assert!(Json::parse(r#"{"a": }"#).is_err());
        assert!(Json::parse("").is_err());
    }
}
