//! Who may use the API router (the gRPC API and the viewer, `router`), as layers in front of every route:
//!
//! - **Security headers** on every answer: a strict Content-Security-Policy (no inline script, nothing from
//!   elsewhere), `Referrer-Policy: no-referrer`, `Cache-Control: no-store`, no framing, no sniffing.
//! - **Cross-site refusal**: a request a browser sent from another site's page (a link, a form, a script, an
//!   image there) is refused on every route but the page itself, so that a page the user visits can neither
//!   read the store through the JSON API, nor pull exports, nor post anything.
//! - **Credentials**: without `[api] token`, only requests whose Host is a loopback name are answered (a
//!   DNS-rebinding page cannot read the store; beyond loopback a token is required, checked by `app::run`).
//!   With a token, gRPC calls (`content-type: application/grpc*`) carry `authorization: Bearer <token>` (else UNAUTHENTICATED); the viewer takes the
//!   bearer header too, or a cookie derived from the token: the page is opened once as `/?token=`, answered with a
//!   redirect that drops the token from the URL and sets an HttpOnly same-site cookie that is an HMAC of the
//!   token, not the token (which also opens the gRPC API and `/metrics`). `?token=` anywhere else is ignored:
//!   it would sit in URLs the page loads, Referers and logs.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hmac::{KeyInit, Mac};
use http::{HeaderValue, StatusCode, header};
use subtle::ConstantTimeEq;

use crate::config::{ApiToken, TokenDigest};
use crate::telemetry::Metrics;

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";
/// The viewer's cookie name.
const COOKIE: &str = "llmtap_viewer";
/// How long the cookie lasts; then the page is opened with `?token=` again.
const COOKIE_MAX_AGE_SECS: u64 = 30 * 24 * 3600;
/// What the viewer's cookie is an HMAC of, keyed by the token. A new label (or a new token) ends every cookie.
const VIEWER_COOKIE_LABEL: &[u8] = b"llmtap viewer session cookie v1";

const UNAUTHORIZED: &str =
    "llmtap viewer: open it once as /?token=<[api] token> (or send Authorization: Bearer <token>)";
const GRPC_UNAUTHENTICATED: &str =
    "llmtap API: missing or wrong bearer token (metadata `authorization: Bearer <token>`, see [api] token)";

/// The router's credentials check (the `authorize` layer's state).
#[derive(Clone)]
pub struct Guard {
    token: Option<Arc<Credentials>>,
    metrics: Arc<Metrics>,
}

struct Credentials {
    token: TokenDigest,
    /// The viewer cookie's value ([`viewer_cookie`]).
    cookie: String,
}

impl Guard {
    pub fn new(token: Option<&ApiToken>, metrics: Arc<Metrics>) -> Guard {
        Guard {
            token: token.map(|t| {
                Arc::new(Credentials {
                    token: t.digest(),
                    cookie: viewer_cookie(t),
                })
            }),
            metrics,
        }
    }
}

/// Layer: every answer carries the security headers.
pub async fn security_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let h = response.headers_mut();
    for (k, v) in [
        ("content-security-policy", CSP),
        ("x-content-type-options", "nosniff"),
        ("referrer-policy", "no-referrer"),
        ("x-frame-options", "DENY"),
        ("cache-control", "no-store"),
    ] {
        h.insert(k, HeaderValue::from_static(v));
    }
    response
}

/// Layer: refuses what another site's page sent, on every route but the page and its assets (a link from
/// elsewhere may open the viewer; it only shows what the page's own same-origin requests fetch).
pub async fn refuse_cross_site(request: Request, next: Next) -> Response {
    let path = request.uri().path();
    let page = path == "/" || path.starts_with("/assets/");
    if !page && is_cross_site(&request) {
        return refusal(
            &request,
            StatusCode::FORBIDDEN,
            "llmtap viewer: requests from another site's page are refused",
        );
    }
    next.run(request).await
}

/// Layer: the credentials rules of the module's documentation.
pub async fn authorize(State(guard): State<Guard>, request: Request, next: Next) -> Response {
    let Some(expected) = &guard.token else {
        if is_loopback_host(request_host(&request)) {
            return next.run(request).await;
        }
        return refusal(
            &request,
            StatusCode::FORBIDDEN,
            "llmtap viewer: only loopback host names are served",
        );
    };
    let grpc = is_grpc(&request);
    if !grpc
        && request.uri().path() == "/"
        && let Some(t) = super::viewer::query_params(request.uri().query()).get("token")
    {
        if expected.token.matches(t) {
            // Back to the page without the token in its URL (history, logs); relative, so a viewer behind a
            // path prefix stays under it. The fragment (the page's route) is kept by the browser.
            let cookie = format!(
                "{COOKIE}={}; HttpOnly; SameSite=Strict; Path=/; Max-Age={COOKIE_MAX_AGE_SECS}",
                expected.cookie
            );
            return (
                StatusCode::SEE_OTHER,
                [(header::LOCATION, "./".to_owned()), (header::SET_COOKIE, cookie)],
            )
                .into_response();
        }
        guard.metrics.api_unauthenticated.inc();
        return refusal(&request, StatusCode::UNAUTHORIZED, UNAUTHORIZED);
    }
    let bearer = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| expected.token.matches_bearer(v));
    // The cookie opens the viewer only, never the gRPC API.
    let cookie = !grpc
        && request
            .headers()
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|c| c.trim().split_once('='))
            .any(|(k, v)| k == COOKIE && cookie_matches(&expected.cookie, v));
    if bearer || cookie {
        return next.run(request).await;
    }
    guard.metrics.api_unauthenticated.inc();
    refusal(&request, StatusCode::UNAUTHORIZED, UNAUTHORIZED)
}

/// A refusal in the caller's protocol: a gRPC status for gRPC clients, plain text for the rest.
fn refusal(request: &Request, status: StatusCode, message: &'static str) -> Response {
    if is_grpc(request) {
        let status = match status {
            StatusCode::UNAUTHORIZED => tonic::Status::unauthenticated(GRPC_UNAUTHENTICATED),
            _ => tonic::Status::permission_denied(message),
        };
        return status.into_http::<Body>();
    }
    (status, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], message).into_response()
}

fn is_grpc(request: &Request) -> bool {
    request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("application/grpc"))
}

/// Whether a browser sent this request from another site's page. Browsers say so in `Sec-Fetch-Site`: only
/// `same-origin` (the viewer's own page) and `none` (typed, a bookmark) are this viewer's; `same-site` is
/// refused too, since another port of the same host is another program. Browsers without it send `Origin` on
/// cross-origin fetches: it must name the Host. A client that sends neither (curl, scripts, gRPC clients) is
/// not a browser page and is judged by the token and Host rules alone.
fn is_cross_site(request: &Request) -> bool {
    let header = |name: &str| request.headers().get(name).map(|v| v.to_str().unwrap_or(""));
    if let Some(site) = header("sec-fetch-site") {
        return !(site.eq_ignore_ascii_case("same-origin") || site.eq_ignore_ascii_case("none"));
    }
    let Some(origin) = header("origin") else {
        return false;
    };
    // The viewer speaks plain HTTP; behind a TLS-terminating proxy the page's origin is https.
    let authority = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    !authority.is_some_and(|a| a.eq_ignore_ascii_case(request_host(request)))
}

/// The request's Host (HTTP/1.1) or authority (HTTP/2); empty when it names none.
fn request_host(request: &Request) -> &str {
    request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| request.uri().authority().map(|a| a.as_str()))
        .unwrap_or("")
}

fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The viewer's cookie value: HMAC-SHA256 of a fixed label keyed by the token, in hex. A cookie that leaks
/// (a browser profile, a debugging proxy) opens the viewer until the token changes but is not the token.
pub fn viewer_cookie(token: &ApiToken) -> String {
    hmac_sha256_hex(token.expose().as_bytes(), VIEWER_COOKIE_LABEL)
}

fn hmac_sha256_hex(key: &[u8], message: &[u8]) -> String {
    // HMAC takes a key of any length; the error is for other MACs behind the same trait. An empty value never
    // matches (`cookie_matches`).
    let Ok(mut mac) = hmac::Hmac::<sha2::Sha256>::new_from_slice(key) else {
        return String::new();
    };
    mac.update(message);
    mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether a presented cookie value is `expected`, in constant time.
fn cookie_matches(expected: &str, presented: &str) -> bool {
    !expected.is_empty() && bool::from(expected.as_bytes().ct_eq(presented.trim().as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_is_rfc_4231s_and_cookies_compare_exactly() {
        // RFC 4231, test case 2.
        assert_eq!(
            hmac_sha256_hex(b"Jefe", b"what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let cookie = hmac_sha256_hex(b"s3cret", VIEWER_COOKIE_LABEL);
        assert_ne!(cookie, hmac_sha256_hex(b"s3cret2", VIEWER_COOKIE_LABEL));
        assert!(cookie_matches(&cookie, &cookie));
        assert!(!cookie_matches(&cookie, &cookie[..63]));
        assert!(!cookie_matches(&cookie, "s3cret"));
        assert!(!cookie_matches("", ""));
    }

    #[test]
    fn loopback_host_names() {
        for host in ["127.0.0.1:8789", "localhost", "LOCALHOST:1", "[::1]:80", "127.9.9.9"] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:8789",
            "10.0.0.1:1",
            "",
            "[::2]:1",
            "localhost.evil.example",
        ] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }
}
