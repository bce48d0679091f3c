//! Secrets never leave the data path: header values and query parameters that carry credentials are replaced
//! before anything is captured. Forwarding is unaffected (the upstream needs the key); only the copy is redacted.
//!
//! One rule decides what a name (header, query parameter, JSON member) means: it is secret when, compared in
//! lowercase with everything but letters and digits skipped, it contains one of [`SECRET_FRAGMENTS`] or an entry
//! of `capture.redact_headers`. Skipping separators makes `x_api_key`, `x-api-key`, `X-Api-Key` and `xapikey`
//! one name, so a gateway's own spelling (`ocp-apim-subscription-key`, `x-functions-key`) needs no list entry.
//! The rule over-redacts on purpose (`monkey` contains `key`): a redacted harmless value costs a little
//! debugging, a stored key costs a rotation. The exceptions are names that are never credentials and that
//! users read: rate-limit counters (`x-ratelimit-remaining-tokens`, `anthropic-ratelimit-tokens-limit`).

use http::{HeaderMap, HeaderName};
use percent_encoding::percent_decode_str;
use smallvec::SmallVec;

use crate::capture::HeaderList;

pub const REDACTED: &str = "REDACTED";

/// Name fragments that mark a name as secret, in the normalized form (lowercase letters and digits only).
const SECRET_FRAGMENTS: &[&[u8]] = &[
    b"key",
    b"token",
    b"secret",
    b"auth",
    b"session",
    b"password",
    b"passwd",
    b"signature",
    b"credential",
    b"cookie",
];

/// Short query names that are credentials but too short to be fragments (`sig` would match `design`): Azure
/// SAS signatures, passwords.
const SECRET_QUERY_NAMES: &[&[u8]] = &[b"sig", b"pwd", b"pass"];

/// Names the rule would catch that only ever carry counters: kept, so rate limits stay visible in traces.
const ALLOWED_FRAGMENTS: &[&[u8]] = &[b"ratelimit"];

/// JSON members whose names match the rule but that hold provider-issued state, not credentials: the signed
/// reasoning blocks Anthropic (`signature`) and Gemini (`thoughtSignature`) require back verbatim. Redacting them
/// would make a stored request unreplayable.
const ALLOWED_JSON_MEMBERS: &[&[u8]] = &[b"signature", b"thoughtsignature"];

/// Key formats worth finding in a URL path segment (some gateways take the key in the path): OpenAI and
/// Anthropic (`sk-`, `sk-proj-`, `sk-ant-`), Google (`AIza`), Groq (`gsk_`), xAI (`xai-`). Prefix, minimum length.
const KEY_FORMATS: &[(&str, usize)] = &[("sk-", 20), ("AIza", 30), ("gsk_", 30), ("xai-", 30)];

/// Header names that most requests and responses carry, judged once when a [`Redactor`] is built: every
/// standard name the `http` crate knows and the ones provider APIs and their SDKs send. The rule runs on every
/// header of every captured exchange; for these names a lookup replaces it (hashing a standard name hashes a
/// one-byte tag), ~300 instructions per header fewer on the data path. Any other name is judged by the rule.
const COMMON_HEADERS: &[&str] = &[
    // HTTP (the `http` crate's standard names)
    "accept",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "access-control-allow-credentials",
    "access-control-allow-headers",
    "access-control-allow-methods",
    "access-control-allow-origin",
    "access-control-expose-headers",
    "access-control-max-age",
    "access-control-request-headers",
    "access-control-request-method",
    "age",
    "allow",
    "alt-svc",
    "authorization",
    "cache-control",
    "cache-status",
    "cdn-cache-control",
    "connection",
    "content-disposition",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-range",
    "content-security-policy",
    "content-security-policy-report-only",
    "content-type",
    "cookie",
    "dnt",
    "date",
    "etag",
    "expect",
    "expires",
    "forwarded",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "link",
    "location",
    "max-forwards",
    "origin",
    "pragma",
    "proxy-authenticate",
    "proxy-authorization",
    "public-key-pins",
    "public-key-pins-report-only",
    "range",
    "referer",
    "referrer-policy",
    "refresh",
    "retry-after",
    "sec-websocket-accept",
    "sec-websocket-extensions",
    "sec-websocket-key",
    "sec-websocket-protocol",
    "sec-websocket-version",
    "server",
    "set-cookie",
    "strict-transport-security",
    "te",
    "trailer",
    "transfer-encoding",
    "user-agent",
    "upgrade",
    "upgrade-insecure-requests",
    "vary",
    "via",
    "warning",
    "www-authenticate",
    "x-content-type-options",
    "x-dns-prefetch-control",
    "x-frame-options",
    "x-xss-protection",
    // Provider APIs and SDKs
    "x-api-key",
    "x-goog-api-key",
    "x-goog-api-client",
    "anthropic-version",
    "anthropic-beta",
    "anthropic-dangerous-direct-browser-access",
    "anthropic-organization-id",
    "request-id",
    "x-request-id",
    "openai-organization",
    "openai-project",
    "openai-version",
    "openai-processing-ms",
    "openai-beta",
    "x-stainless-lang",
    "x-stainless-package-version",
    "x-stainless-os",
    "x-stainless-arch",
    "x-stainless-runtime",
    "x-stainless-runtime-version",
    "x-stainless-retry-count",
    "x-stainless-timeout",
    "x-stainless-async",
    "x-stainless-helper-method",
    "x-app",
    "cf-ray",
    "cf-cache-status",
    "x-envoy-upstream-service-time",
    "x-ratelimit-limit-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-requests",
    "x-ratelimit-reset-tokens",
];

/// Calls `f` with `name`'s letters and digits, lowercased: the form names are compared in. A name is normalized
/// once, on the stack when it is at most 64 bytes (every header name in practice), and every fragment is looked
/// for in that copy. (A `SmallVec` filled by `push` cost ~300 instructions per header name, this ~60.)
fn with_normalized<R>(name: &[u8], f: impl FnOnce(&[u8]) -> R) -> R {
    let mut inline = [0u8; 64];
    if name.len() > inline.len() {
        return f(&letters(name).collect::<Vec<u8>>());
    }
    let mut len = 0;
    for b in letters(name) {
        inline[len] = b;
        len += 1;
    }
    f(&inline[..len])
}

/// `name`'s letters and digits, lowercased.
fn letters(name: &[u8]) -> impl Iterator<Item = u8> + '_ {
    name.iter()
        .filter(|b| b.is_ascii_alphanumeric())
        .map(|b| b.to_ascii_lowercase())
}

/// Whether normalized `name` contains normalized `fragment`.
fn contains(name: &[u8], fragment: &[u8]) -> bool {
    !fragment.is_empty() && name.windows(fragment.len()).any(|w| w == fragment)
}

/// The redaction rule with the configured extra names. Built once at startup; shared by every request.
#[derive(Debug, Clone)]
pub struct Redactor {
    /// `capture.redact_headers`, normalized. They win over the allow-list.
    extra: Vec<Box<[u8]>>,
    /// [`COMMON_HEADERS`], each judged by this redactor's rule.
    common: rustc_hash::FxHashMap<HeaderName, bool>,
}

/// The built-in rule alone.
impl Default for Redactor {
    fn default() -> Redactor {
        Redactor::new(&[])
    }
}

impl Redactor {
    /// `extra`: further name fragments (`capture.redact_headers`); entries with no letter or digit are ignored
    /// (config validation refuses them).
    pub fn new(extra: &[String]) -> Redactor {
        let mut redactor = Redactor {
            extra: extra
                .iter()
                .map(|e| with_normalized(e.as_bytes(), |e| Box::<[u8]>::from(e)))
                .filter(|e| !e.is_empty())
                .collect(),
            common: Default::default(),
        };
        redactor.common = COMMON_HEADERS
            .iter()
            .map(|name| (HeaderName::from_static(name), redactor.is_secret_name(name.as_bytes())))
            .collect();
        redactor
    }

    /// Whether a header or query parameter named `name` carries a secret.
    pub fn is_secret_name(&self, name: &[u8]) -> bool {
        with_normalized(name, |name| self.is_secret_normalized(name))
    }

    fn is_secret_normalized(&self, name: &[u8]) -> bool {
        self.extra.iter().any(|e| contains(name, e)) || is_secret_by_rule(name)
    }

    pub fn is_secret_header(&self, name: &HeaderName) -> bool {
        match self.common.get(name) {
            Some(&secret) => secret,
            None => self.is_secret_name(name.as_str().as_bytes()),
        }
    }

    /// Headers as (name, value) pairs with secret values replaced. Our own `x-llmtap-*` headers are omitted
    /// (they become trace metadata instead), except `x-llmtap-replay-of`, which the pipeline reads from here.
    pub fn redact_headers(&self, headers: &HeaderMap) -> HeaderList {
        let bytes = headers.iter().map(|(k, v)| k.as_str().len() + v.len()).sum();
        let mut out = HeaderList::with_capacity(headers.len(), bytes);
        for (header, value) in headers {
            let name = header.as_str();
            if name.starts_with("x-llmtap-") && name != crate::model::exchange::REPLAY_OF_HEADER {
                continue;
            }
            // `push_wire`: a `HeaderMap`'s names and values never hold a newline (nor its names a colon).
            if self.is_secret_header(header) {
                out.push_wire(name, REDACTED);
            } else {
                // Almost every value is visible ASCII: no copy of its own; the lossy decode only for the rest.
                match value.to_str() {
                    Ok(v) => out.push_wire(name, v),
                    Err(_) => out.push_wire(name, &String::from_utf8_lossy(value.as_bytes())),
                }
            }
        }
        out
    }

    /// `path?query` with secret query values and path segments that look like keys replaced. Query names are
    /// judged percent-decoded (`%6Bey` is `key`).
    pub fn redact_path_and_query(&self, path: &str, query: Option<&str>) -> String {
        if query.is_none() && !path.split('/').any(looks_like_key) {
            return path.to_owned();
        }
        let mut out = String::with_capacity(path.len() + query.map_or(0, |q| q.len() + 1));
        for (i, segment) in path.split('/').enumerate() {
            if i > 0 {
                out.push('/');
            }
            out.push_str(if looks_like_key(segment) { REDACTED } else { segment });
        }
        let Some(query) = query else {
            return out;
        };
        out.push('?');
        for (i, pair) in query.split('&').enumerate() {
            if i > 0 {
                out.push('&');
            }
            let (k, _) = pair.split_once('=').unwrap_or((pair, ""));
            if self.is_secret_query_name(k) {
                out.push_str(k);
                out.push('=');
                out.push_str(REDACTED);
            } else {
                out.push_str(pair);
            }
        }
        out
    }

    fn is_secret_query_name(&self, raw: &str) -> bool {
        // Names are short: decoded on the stack.
        let decoded: SmallVec<[u8; 64]> = percent_decode_str(raw).collect();
        with_normalized(&decoded, |name| {
            self.is_secret_normalized(name) || SECRET_QUERY_NAMES.contains(&name)
        })
    }
}

/// The built-in rule for a normalized name.
fn is_secret_by_rule(name: &[u8]) -> bool {
    contains_any(name, SECRET_FRAGMENTS, &SECRET_FIRST_LETTERS) && !ALLOWED_FRAGMENTS.iter().any(|f| contains(name, f))
}

/// Which bytes start one of [`SECRET_FRAGMENTS`].
const SECRET_FIRST_LETTERS: [bool; 256] = first_letters(SECRET_FRAGMENTS);

const fn first_letters(fragments: &[&[u8]]) -> [bool; 256] {
    let mut table = [false; 256];
    let mut i = 0;
    while i < fragments.len() {
        if let Some(&first) = fragments[i].first() {
            table[first as usize] = true;
        }
        i += 1;
    }
    table
}

/// Whether normalized `name` contains one of `fragments`, in one pass over `name`: a position whose letter starts
/// no fragment (`first`) is passed over with one table lookup. The rule is applied to every header of every
/// captured exchange on the data path and to every member name of every captured body on the pipeline; a pass
/// per fragment made ten, and comparing through a normalizing iterator at every candidate position cost ~500
/// instructions per header (callgrind).
fn contains_any(name: &[u8], fragments: &[&[u8]], first: &[bool; 256]) -> bool {
    (0..name.len()).any(|i| {
        let c = name[i];
        first[c as usize]
            && fragments
                .iter()
                .any(|f| f.first() == Some(&c) && name[i..].starts_with(f))
    })
}

/// Whether a JSON object member named `name` (as written, unescaped) holds a credential: the built-in rule,
/// less the provider state in [`ALLOWED_JSON_MEMBERS`].
pub fn is_secret_json_member(name: &[u8]) -> bool {
    with_normalized(name, |name| {
        is_secret_by_rule(name) && !ALLOWED_JSON_MEMBERS.contains(&name)
    })
}

/// A path segment in one of [`KEY_FORMATS`]: the prefix, then at least the minimum length of key characters.
fn looks_like_key(segment: &str) -> bool {
    KEY_FORMATS.iter().any(|(prefix, min)| {
        segment.len() >= *min
            && segment.starts_with(prefix)
            && segment
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule() -> Redactor {
        Redactor::default()
    }

    /// The rule's meaning, written the slow and obvious way: from every position of the raw name where the
    /// fragment's first letter is, the following letters and digits (lowercased) start with the fragment.
    fn contains_skipping_separators(name: &[u8], fragment: &[u8]) -> bool {
        (0..name.len()).any(|i| {
            name[i].to_ascii_lowercase() == fragment[0]
                && letters(&name[i..]).take(fragment.len()).eq(fragment.iter().copied())
        })
    }

    #[test]
    fn secret_headers_are_redacted_and_llmtap_headers_dropped() {
        let mut h = HeaderMap::new();
        h.insert("authorization", "Bearer sk-live".parse().unwrap());
        h.insert("x-api-key", "sk-ant".parse().unwrap());
        h.insert("x-goog-api-key", "AIza".parse().unwrap());
        h.insert("x-custom-auth-token", "t".parse().unwrap());
        h.insert("content-type", "application/json".parse().unwrap());
        h.insert("x-llmtap-session", "s1".parse().unwrap());
        h.insert("x-utf8", http::HeaderValue::from_bytes("café".as_bytes()).unwrap());
        h.insert("x-latin1", http::HeaderValue::from_bytes(b"caf\xe9").unwrap());
        let out = rule().redact_headers(&h);
        assert_eq!(out.get("x-utf8"), Some("café"));
        assert_eq!(out.get("x-latin1"), Some("caf\u{fffd}"));
        assert!(out.iter().all(|(_, v)| !v.contains("sk-") && v != "AIza" && v != "t"));
        assert_eq!(out.get("content-type"), Some("application/json"));
        assert_eq!(out.get("authorization"), Some(REDACTED));
        assert!(!out.iter().any(|(k, _)| k.starts_with("x-llmtap")));
        assert_eq!(out.len(), 7);
    }

    #[test]
    fn the_one_pass_rule_matches_a_pass_per_fragment() {
        let names: &[&[u8]] = &[
            b"content-type",
            b"user-agent",
            b"x-api-key",
            b"X_API_KEY",
            b"monkey",
            b"x-stainless-os",
            b"accept",
            b"anthropic-version",
            b"openai-organization",
            b"x-ratelimit-remaining-tokens",
            b"set-cookie",
            b"proxy-authorization",
            b"k",
            b"t-o-k-e-n",
            b"",
            b"sessionid",
            b"pass-word",
            b"passwd",
            b"tool_call_id",
            b"thoughtSignature",
            b"client_secret",
            b"x-goog-api-client",
            b"credentials",
            b"\xff\xfekey",
        ];
        for name in names {
            let per_fragment = SECRET_FRAGMENTS.iter().any(|f| contains_skipping_separators(name, f));
            assert_eq!(
                with_normalized(name, |n| contains_any(n, SECRET_FRAGMENTS, &SECRET_FIRST_LETTERS)),
                per_fragment,
                "{}",
                String::from_utf8_lossy(name)
            );
        }
    }

    #[test]
    fn names_longer_than_the_stack_copy_are_judged_whole() {
        let padding = "x-".repeat(40);
        assert!(rule().is_secret_name(format!("{padding}Api-Key").as_bytes()));
        assert!(!rule().is_secret_name(format!("{padding}content-type").as_bytes()));
        assert!(is_secret_json_member(format!("{padding}password").as_bytes()));
    }

    #[test]
    fn secret_names_are_found_anywhere_in_any_case_and_separator_style() {
        for name in [
            "authorization",
            "Proxy-Authorization",
            "x-portkey-api-key",
            "X-Goog-Api-Key",
            "x-apikey",
            "x_api_key",
            "xapikey",
            "ocp-apim-subscription-key",
            "x-functions-key",
            "x-access-key",
            "x-upstream-session-key",
            "x-session-token",
            "x-client-secret",
            "db-password",
            "x-amz-signature",
            "x-credentials",
            "cookie",
            "set-cookie",
            "x-custom-auth",
            "api-key",
            "x-api-key",
        ] {
            // Names arrive as `HeaderName`s, which lowercase whatever the client sent.
            let header = HeaderName::from_bytes(name.as_bytes()).unwrap();
            assert!(rule().is_secret_header(&header), "{name} should be secret");
        }
        for name in [
            "content-type",
            "accept",
            "user-agent",
            "anthropic-version",
            "x-stainless-os",
            "x-stainless-retry-count",
            "accept-encoding",
            "keep-alive",
            "x-ratelimit-remaining-tokens",
            "anthropic-ratelimit-tokens-limit",
            "anthropic-ratelimit-input-tokens-reset",
            "a",
            "t",
        ] {
            let header = HeaderName::from_bytes(name.as_bytes()).unwrap();
            assert!(!rule().is_secret_header(&header), "{name} should not be secret");
        }
    }

    #[test]
    fn configured_names_are_redacted_too_and_win_over_the_allow_list() {
        let r = Redactor::new(&["X-Tenant".into(), "ratelimit".into(), "--".into()]);
        assert!(r.is_secret_name(b"x_tenant_id"));
        assert!(r.is_secret_name(b"x-ratelimit-remaining-tokens"));
        assert!(
            !r.is_secret_name(b"content-type"),
            "an entry without letters matches nothing"
        );
    }

    /// The common names are looked up, not judged again: the lookup must give the rule's verdict, with the
    /// configured names too.
    #[test]
    fn common_header_names_get_the_rules_verdict() {
        let configured = Redactor::new(&["organization".into(), "ratelimit".into()]);
        for r in [rule(), configured.clone()] {
            for name in COMMON_HEADERS {
                // As hyper makes it from the wire.
                let header = HeaderName::from_bytes(name.as_bytes()).expect("a valid name");
                assert!(r.common.contains_key(&header), "{name} is looked up");
                assert_eq!(r.is_secret_header(&header), r.is_secret_name(name.as_bytes()), "{name}");
            }
        }
        let header = |n: &'static str| HeaderName::from_static(n);
        assert!(rule().is_secret_header(&header("authorization")));
        assert!(rule().is_secret_header(&header("x-goog-api-key")));
        assert!(!rule().is_secret_header(&header("openai-organization")));
        assert!(configured.is_secret_header(&header("openai-organization")));
        assert!(!rule().is_secret_header(&header("x-ratelimit-remaining-tokens")));
        assert!(configured.is_secret_header(&header("x-ratelimit-remaining-tokens")));
        assert!(
            rule().is_secret_header(&header("x-custom-auth-token")),
            "not a common name: the rule"
        );
    }

    #[test]
    fn query_names_are_judged_decoded_and_by_the_same_rule() {
        assert_eq!(
            rule().redact_path_and_query("/v1beta/models/g:streamGenerateContent", Some("alt=sse&key=AIzaSECRET")),
            "/v1beta/models/g:streamGenerateContent?alt=sse&key=REDACTED"
        );
        assert_eq!(
            rule().redact_path_and_query("/v1/messages", Some("beta=true")),
            "/v1/messages?beta=true"
        );
        assert_eq!(
            rule().redact_path_and_query(
                "/p",
                Some("api-key=a&client_secret=b&password=c&x-goog-api-key=d&%6Bey=e&sig=f&api-version=2024&flag")
            ),
            "/p?api-key=REDACTED&client_secret=REDACTED&password=REDACTED&x-goog-api-key=REDACTED&%6Bey=REDACTED\
             &sig=REDACTED&api-version=2024&flag"
        );
    }

    #[test]
    fn path_segments_in_key_formats_are_redacted() {
        let key = "sk-proj-abcdefghijklmnopqrstuvwxyz0123";
        assert_eq!(
            rule().redact_path_and_query(&format!("/keys/{key}/v1/chat/completions"), None),
            "/keys/REDACTED/v1/chat/completions"
        );
        let google = "AIzaSyA-abcdefghijklmnopqrstuvwxyz12345";
        assert_eq!(
            rule().redact_path_and_query(&format!("/{google}/models"), None),
            "/REDACTED/models"
        );
        for plain in [
            "/v1/chat/completions",
            "/v1beta/models/gemini-2.0-flash:generateContent",
            "/sk-short",
        ] {
            assert_eq!(rule().redact_path_and_query(plain, None), plain);
        }
    }

    #[test]
    fn json_members_follow_the_rule_but_keep_reasoning_signatures() {
        for name in [
            "api_key",
            "apiKey",
            "client_secret",
            "password",
            "access_token",
            "session_id",
        ] {
            assert!(is_secret_json_member(name.as_bytes()), "{name}");
        }
        // `max_tokens` matches the rule, but only string values are ever redacted (see `pipeline::secrets`).
        for name in ["signature", "thoughtSignature", "model", "content"] {
            assert!(!is_secret_json_member(name.as_bytes()), "{name}");
        }
    }
}
