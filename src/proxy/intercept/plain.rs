//! Plain HTTP through llmtap as a forward proxy (`HTTP_PROXY=http://127.0.0.1:8787`): the client sends the
//! request line in absolute form (`POST http://host:port/v1/chat/completions HTTP/1.1`). A host on the intercept
//! list is forwarded and captured as inside a CONNECT tunnel ([`super::relay`]); any other host is forwarded
//! without capture (relayed blind, counted). The access rule is CONNECT's: beyond loopback only with the
//! `[api] token` as the proxy password, and never without one.

use std::sync::Arc;

use http::uri::Scheme;
use http::{Request, Response};
use hyper::body::Incoming;

use super::super::limits::ClientBody;
use super::super::{Proxy, ProxyBody};
use super::relay::Tunnel;
use super::{Refusal, Target, refused};

/// A request line naming its scheme and host: a client speaking to a proxy. HTTP/2 requests always carry both
/// (`:scheme`, `:authority`) and are base-URL requests; only an HTTP/1 request line is in absolute form.
pub(in crate::proxy) fn is_absolute_form<B>(req: &Request<B>) -> bool {
    req.version() <= http::Version::HTTP_11 && req.uri().scheme().is_some()
}

/// Forwards one absolute-form request to the host it names, unchanged, captured if the host is intercepted.
pub(in crate::proxy) async fn plain_request(
    proxy: &Arc<Proxy>,
    req: Request<ClientBody<Incoming>>,
) -> Response<ProxyBody> {
    let interceptor = &proxy.intercept;
    let session = match interceptor.authorize(req.headers()) {
        Ok(session) => session,
        Err(refusal) => return refused(proxy, &refusal),
    };
    let uri = req.uri();
    let host = uri
        .authority()
        .map(|a| a.host().trim_matches(['[', ']']).to_ascii_lowercase())
        .filter(|h| !h.is_empty());
    // An https:// URI in a request line would have llmtap make the TLS connection the client asked not to see;
    // clients send CONNECT for those.
    let host = match host {
        Some(host) if uri.scheme() == Some(&Scheme::HTTP) => host,
        _ => return refused(proxy, &Refusal::BadUri(uri.to_string())),
    };
    let port = uri.port_u16().unwrap_or(80);
    let intercepted = interceptor.list.lookup(&host, port);
    if intercepted.is_some() {
        proxy.metrics.forward_intercepted.inc();
    } else {
        proxy.metrics.forward_blind.inc();
    }
    let target = Target { host, port, session };
    Tunnel::new(proxy.clone(), target, intercepted, Scheme::HTTP)
        .handle(req)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_http1_request_line_with_a_scheme_is_absolute_form() {
        let req = |uri: &str, version| Request::builder().uri(uri).version(version).body(()).unwrap();
        assert!(is_absolute_form(&req(
            "http://llm.internal/v1/chat",
            http::Version::HTTP_11
        )));
        assert!(is_absolute_form(&req("http://llm.internal/", http::Version::HTTP_10)));
        assert!(!is_absolute_form(&req("/openai/v1/chat", http::Version::HTTP_11)));
        // HTTP/2 always names scheme and authority: a base-URL request.
        assert!(!is_absolute_form(&req(
            "https://127.0.0.1:8787/openai/v1",
            http::Version::HTTP_2
        )));
    }
}
