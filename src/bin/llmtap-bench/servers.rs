//! The processes the proxy benchmark talks to: a fast upstream, and a bare hyper passthrough proxy (the physical
//! limit of one proxy hop on this machine). Each runs as a child process of the bench (`llmtap-bench upstream`,
//! `llmtap-bench passthrough PORT`) and prints `listening on ADDR` as its first line.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Either, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// A ~2 KB non-streamed chat completion, shaped like the real thing.
pub fn chat_completion_body() -> Bytes {
    let content = "The quick brown fox jumps over the lazy dog. ".repeat(36);
    Bytes::from(
        serde_json::json!({
            "id": "chatcmpl-bench", "object": "chat.completion", "created": 1754432618, "model": "gpt-4o-2024-08-06",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 120, "completion_tokens": 400, "total_tokens": 520}
        })
        .to_string(),
    )
}

pub fn chat_request_body() -> Bytes {
    Bytes::from(
        serde_json::json!({"model": "gpt-4o", "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write a paragraph about foxes. ".repeat(20)}]})
        .to_string(),
    )
}

/// One worker: the bench processes must not take more of the 2 cores than a real deployment would.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
}

type Body = Either<Full<Bytes>, StreamBody<tokio_stream_shim::Stream>>;

fn with_type(body: Body, content_type: &'static str) -> Response<Body> {
    let mut r = Response::new(body);
    r.headers_mut()
        .insert("content-type", http::HeaderValue::from_static(content_type));
    r
}

/// Serves `POST .../chat/completions`: JSON by default; SSE when the request has `x-bench-stream: EVENTS,DELAY_MS`.
pub fn upstream() -> std::io::Result<()> {
    serve_upstream(None)
}

/// [`upstream`] over TLS (HTTP/1.1) with the certificate chain and key in the PEM files `cert` and `key`: the
/// forward-mode benchmark's provider host (`llmtap-bench upstream-tls CERT KEY`).
pub fn upstream_tls(cert: &str, key: &str) -> std::io::Result<()> {
    use rustls_pki_types::pem::PemObject;
    let invalid = |e: &dyn std::fmt::Display| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string());
    let chain = rustls_pki_types::CertificateDer::pem_file_iter(cert)
        .map_err(|e| invalid(&e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(&e))?;
    let key = rustls_pki_types::PrivateKeyDer::from_pem_file(key).map_err(|e| invalid(&e))?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(&e))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| invalid(&e))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    serve_upstream(Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))))
}

fn serve_upstream(tls: Option<tokio_rustls::TlsAcceptor>) -> std::io::Result<()> {
    runtime()?.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        println!("listening on {}", listener.local_addr()?);
        let body = chat_completion_body();
        loop {
            let (stream, _) = listener.accept().await?;
            let _ = stream.set_nodelay(true);
            let body = body.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let body = body.clone();
                    async move {
                        let spec = req
                            .headers()
                            .get("x-bench-stream")
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_owned);
                        // Read the request body fully, as a real server does.
                        let _ = req.into_body().collect().await;
                        let resp: Response<Body> = match spec.and_then(|s| {
                            let (n, d) = s.split_once(',')?;
                            Some((n.parse::<usize>().ok()?, d.parse::<u64>().ok()?))
                        }) {
                            Some((events, delay_ms)) => with_type(
                                Either::Right(StreamBody::new(tokio_stream_shim::events(events, delay_ms))),
                                "text/event-stream",
                            ),
                            None => with_type(Either::Left(Full::new(body)), "application/json"),
                        };
                        Ok::<_, Infallible>(resp)
                    }
                });
                let http = hyper::server::conn::http1::Builder::new();
                match tls {
                    Some(tls) => {
                        if let Ok(stream) = tls.accept(stream).await {
                            let _ = http.serve_connection(TokioIo::new(stream), svc).await;
                        }
                    }
                    None => {
                        let _ = http.serve_connection(TokioIo::new(stream), svc).await;
                    }
                }
            });
        }
    })
}

/// The simplest correct proxy hop: hyper server → hyper-util pooled client, bodies streamed, no capture.
pub fn passthrough(upstream_port: u16) -> std::io::Result<()> {
    runtime()?.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        println!("listening on {}", listener.local_addr()?);
        let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
        http.set_nodelay(true);
        let client: Client<_, Incoming> = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(256)
            .build(http);
        loop {
            let (stream, _) = listener.accept().await?;
            let _ = stream.set_nodelay(true);
            let client = client.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let client = client.clone();
                    async move {
                        let (mut parts, body) = req.into_parts();
                        let pq = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/").to_owned();
                        parts.uri = format!("http://127.0.0.1:{upstream_port}{pq}")
                            .parse()
                            .unwrap_or_default();
                        parts.headers.remove("host");
                        match client.request(Request::from_parts(parts, body)).await {
                            Ok(resp) => Ok::<_, Infallible>(resp.map(Either::Left)),
                            Err(_) => {
                                let mut r = Response::new(Either::Right(Full::new(Bytes::new())));
                                *r.status_mut() = http::StatusCode::BAD_GATEWAY;
                                Ok(r)
                            }
                        }
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    })
}

/// A paced SSE body without pulling in a stream crate: an mpsc receiver fed by a task.
pub mod tokio_stream_shim {
    use super::*;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    pub struct Stream(tokio::sync::mpsc::Receiver<Bytes>);

    impl futures_core::Stream for Stream {
        type Item = Result<Frame<Bytes>, Infallible>;
        fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
        }
    }

    pub fn events(n: usize, delay_ms: u64) -> Stream {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            for i in 0..n {
                let ev = format!(
                    "data: {{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"token{i} \"}}}}]}}\n\n"
                );
                if tx.send(Bytes::from(ev)).await.is_err() {
                    return;
                }
                if delay_ms > 0 && i + 1 < n {
                    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                }
            }
            let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
        });
        Stream(rx)
    }
}

/// A local OTLP/gRPC receiver (traces and metrics) on its own thread and runtime that counts the spans it is
/// sent. Returns its address and the running count.
pub fn otlp_receiver() -> std::io::Result<(std::net::SocketAddr, std::sync::Arc<std::sync::atomic::AtomicU64>)> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
        MetricsService, MetricsServiceServer,
    };
    use opentelemetry_proto::tonic::collector::metrics::v1::{
        ExportMetricsServiceRequest, ExportMetricsServiceResponse,
    };
    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
    use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};

    #[derive(Clone, Default)]
    struct Counts(Arc<AtomicU64>);

    #[tonic::async_trait]
    impl TraceService for Counts {
        async fn export(
            &self,
            request: tonic::Request<ExportTraceServiceRequest>,
        ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
            let spans: usize = request
                .get_ref()
                .resource_spans
                .iter()
                .flat_map(|r| &r.scope_spans)
                .map(|s| s.spans.len())
                .sum();
            self.0.fetch_add(spans as u64, Ordering::Relaxed);
            Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
        }
    }

    #[tonic::async_trait]
    impl MetricsService for Counts {
        async fn export(
            &self,
            _request: tonic::Request<ExportMetricsServiceRequest>,
        ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
            Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
        }
    }

    let rt = runtime()?;
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    let counts = Counts::default();
    let spans = counts.0.clone();
    std::thread::spawn(move || {
        let gzip = tonic::codec::CompressionEncoding::Gzip;
        let served = rt.block_on(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(counts.clone()).accept_compressed(gzip))
                .add_service(MetricsServiceServer::new(counts).accept_compressed(gzip))
                .serve_with_incoming(llmtap::api::incoming(listener)),
        );
        if let Err(e) = served {
            eprintln!("otlp receiver: {e}");
        }
    });
    Ok((addr, spans))
}
