//! Sending one OTLP export request, and classifying failures exactly as the OTLP spec says: what may be retried
//! (gRPC UNAVAILABLE & co., RESOURCE_EXHAUSTED only with RetryInfo; HTTP 429/502/503/504, connection failures),
//! with the server's requested delay, and what must not be (everything else, and any partial success). A refusal
//! of our credentials (HTTP 401/403, gRPC UNAUTHENTICATED/PERMISSION_DENIED) is told apart: the driver pauses
//! the sink instead of dropping data.

use std::io::Write;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_client::MetricsServiceClient;
use opentelemetry_proto::tonic::collector::metrics::v1::{ExportMetricsServiceRequest, ExportMetricsServiceResponse};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_client::TraceServiceClient;
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use prost::Message;
use tonic::transport::Channel;
use tonic_types::StatusExt;

use crate::config::{OtlpConfig, OtlpProtocol};
use crate::export::sink::{Accepted, SendError};

/// The destination cannot be set up from its configuration.
#[derive(Debug, thiserror::Error)]
#[error("bad exporter configuration: {0}")]
pub struct ConfigError(String);

pub enum Transport {
    Grpc(Box<(TraceServiceClient<Channel>, MetricsServiceClient<Channel>)>),
    Http(Box<HttpTransport>),
}

pub struct HttpTransport {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    uri: http::Uri,
    json: bool,
}

impl Transport {
    pub fn new(cfg: &OtlpConfig) -> Result<Transport, ConfigError> {
        match cfg.protocol {
            OtlpProtocol::Grpc => {
                let endpoint = tonic::transport::Endpoint::from_shared(cfg.endpoint.clone())
                    .map_err(|e| ConfigError(e.to_string()))?
                    .connect_timeout(cfg.timeout)
                    .timeout(cfg.timeout);
                // Lazy: a receiver that is down at startup is retried like any other outage.
                let channel = endpoint.connect_lazy();
                let mut traces = TraceServiceClient::new(channel.clone());
                let mut metrics = MetricsServiceClient::new(channel);
                if cfg.gzip {
                    traces = traces.send_compressed(tonic::codec::CompressionEncoding::Gzip);
                    metrics = metrics.send_compressed(tonic::codec::CompressionEncoding::Gzip);
                }
                Ok(Transport::Grpc(Box::new((traces, metrics))))
            }
            OtlpProtocol::HttpProtobuf | OtlpProtocol::HttpJson => {
                let mut roots = rustls::RootCertStore::empty();
                roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
                let tls = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .map_err(|e| ConfigError(e.to_string()))?
                .with_root_certificates(roots)
                .with_no_client_auth();
                let https = hyper_rustls::HttpsConnectorBuilder::new()
                    .with_tls_config(tls)
                    .https_or_http()
                    .enable_http1()
                    .build();
                let uri = cfg
                    .endpoint
                    .parse()
                    .map_err(|e: http::uri::InvalidUri| ConfigError(e.to_string()))?;
                Ok(Transport::Http(Box::new(HttpTransport {
                    client: Client::builder(TokioExecutor::new()).build(https),
                    uri,
                    json: cfg.protocol == OtlpProtocol::HttpJson,
                })))
            }
        }
    }

    pub async fn send(&self, cfg: &OtlpConfig, req: ExportTraceServiceRequest) -> Result<Accepted, SendError> {
        match self {
            // Clients are cheap handles on one shared channel: a clone per call keeps `send` shareable.
            Transport::Grpc(c) => match c.0.clone().export(grpc_request(cfg, req)).await {
                Ok(resp) => Ok(accepted(resp.into_inner())),
                Err(status) => Err(classify_grpc(&status)),
            },
            Transport::Http(h) => {
                let json = h.json;
                let body = encode(&req, json)?;
                let bytes = http_post_within_timeout(&h.client, cfg, h.uri.clone(), body, json).await?;
                let parsed = if json {
                    serde_json::from_slice::<ExportTraceServiceResponse>(&bytes).ok()
                } else {
                    ExportTraceServiceResponse::decode(bytes.as_ref()).ok()
                };
                Ok(parsed.map(accepted).unwrap_or(Accepted {
                    rejected: 0,
                    message: String::new(),
                }))
            }
        }
    }

    /// The GenAI client metrics for a batch, to the same destination (`/v1/metrics` for HTTP).
    pub async fn send_metrics(&self, cfg: &OtlpConfig, req: ExportMetricsServiceRequest) -> Result<(), SendError> {
        match self {
            Transport::Grpc(c) => match c.1.clone().export(grpc_request(cfg, req)).await {
                Ok(r) => {
                    let _: ExportMetricsServiceResponse = r.into_inner();
                    Ok(())
                }
                Err(status) => Err(classify_grpc(&status)),
            },
            Transport::Http(h) => {
                let text = h.uri.to_string();
                let metrics_uri: http::Uri = match text.strip_suffix("/v1/traces") {
                    Some(base) => format!("{base}/v1/metrics"),
                    None => format!("{}/v1/metrics", text.trim_end_matches('/')),
                }
                .parse()
                .map_err(|e: http::uri::InvalidUri| SendError::Rejected {
                    message: format!("no metrics URL: {e}"),
                })?;
                let body = encode(&req, h.json)?;
                http_post_within_timeout(&h.client, cfg, metrics_uri, body, h.json)
                    .await
                    .map(|_| ())
            }
        }
    }
}

fn encode<T: prost::Message + serde::Serialize>(req: &T, json: bool) -> Result<Vec<u8>, SendError> {
    if json {
        serde_json::to_vec(req).map_err(|e| SendError::Rejected { message: e.to_string() })
    } else {
        Ok(req.encode_to_vec())
    }
}

fn grpc_request<T>(cfg: &OtlpConfig, body: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(body);
    request.set_timeout(cfg.timeout);
    for (k, v) in &cfg.headers {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(k.to_ascii_lowercase().as_bytes()),
            v.parse(),
        ) {
            request.metadata_mut().insert(k, v);
        }
    }
    request
}

/// POST one OTLP/HTTP body; the response body on 2xx, a classified error otherwise. `timeout` covers the whole
/// exchange, response body included: a receiver that sent its headers and never finished the body would
/// otherwise hold the sink (and its cursor) forever.
async fn http_post_within_timeout(
    client: &Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    cfg: &OtlpConfig,
    uri: http::Uri,
    body: Vec<u8>,
    json: bool,
) -> Result<Bytes, SendError> {
    let request = http_request(cfg, uri, body, json)?;
    tokio::time::timeout(cfg.timeout, http_exchange(client, request))
        .await
        .unwrap_or_else(|_| Err(retry("timed out", None)))
}

fn http_request(
    cfg: &OtlpConfig,
    uri: http::Uri,
    body: Vec<u8>,
    json: bool,
) -> Result<http::Request<Full<Bytes>>, SendError> {
    let content_type = if json {
        "application/json"
    } else {
        "application/x-protobuf"
    };
    let mut builder = http::Request::post(uri).header("content-type", content_type);
    let body = if cfg.gzip {
        builder = builder.header("content-encoding", "gzip");
        gzip(&body).map_err(|e| SendError::Rejected {
            message: format!("cannot gzip the request: {e}"),
        })?
    } else {
        body
    };
    for (k, v) in &cfg.headers {
        builder = builder.header(k.as_str(), v.as_str());
    }
    builder
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| SendError::Rejected {
            message: format!("cannot build the request: {e}"),
        })
}

fn gzip(body: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(body)?;
    enc.finish()
}

async fn http_exchange(
    client: &Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    request: http::Request<Full<Bytes>>,
) -> Result<Bytes, SendError> {
    let resp = client
        .request(request)
        .await
        .map_err(|e| retry(&format!("connection failed: {e}"), None))?;
    let status = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_retry_after);
    if matches!(status, 401 | 403) {
        // The body is not read: it may echo the credentials we sent.
        return Err(SendError::Unauthorized {
            message: format!("HTTP {status}"),
        });
    }
    let bytes = match resp.into_body().collect().await {
        Ok(c) => c.to_bytes(),
        // A body cut off mid-way: whether the receiver took the batch is unknown, so it is sent again.
        Err(e) if (200..=299).contains(&status) => {
            return Err(retry(&format!("HTTP {status}, response body failed: {e}"), None));
        }
        Err(_) => Bytes::new(),
    };
    match status {
        200..=299 => Ok(bytes),
        429 | 502 | 503 | 504 => Err(retry(&format!("HTTP {status}"), retry_after)),
        _ => Err(SendError::Rejected {
            message: format!(
                "HTTP {status}: {}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
            ),
        }),
    }
}

fn retry(message: &str, retry_after: Option<Duration>) -> SendError {
    SendError::Retryable {
        message: message.to_owned(),
        retry_after,
    }
}

fn accepted(resp: ExportTraceServiceResponse) -> Accepted {
    match resp.partial_success {
        Some(p) => Accepted {
            rejected: p.rejected_spans.max(0) as u64,
            message: p.error_message,
        },
        None => Accepted {
            rejected: 0,
            message: String::new(),
        },
    }
}

fn classify_grpc(status: &tonic::Status) -> SendError {
    use tonic::Code;
    let delay = status.get_details_retry_info().and_then(|r| r.retry_delay);
    let message = format!("{:?}: {}", status.code(), status.message());
    // A status that tonic made up from a local transport failure (no response from the server) is a dropped or
    // refused connection, which the spec says to retry, whatever code tonic gave it.
    // tonic reports a channel that could not connect as `Unknown: "Service was not ready: transport error"`,
    // with no source attached: match that too.
    let local_transport = std::error::Error::source(status).is_some() && status.metadata().get("grpc-status").is_none();
    let not_ready = status.code() == Code::Unknown
        && (status.message().starts_with("Service was not ready") || status.message().contains("transport error"));
    if local_transport || not_ready {
        return retry(&message, delay);
    }
    match status.code() {
        Code::Cancelled
        | Code::DeadlineExceeded
        | Code::Aborted
        | Code::OutOfRange
        | Code::Unavailable
        | Code::DataLoss => retry(&message, delay),
        Code::ResourceExhausted if delay.is_some() => retry(&message, delay),
        // The status message is the server's: it may echo what we sent.
        Code::Unauthenticated | Code::PermissionDenied => SendError::Unauthorized {
            message: format!("{:?}", status.code()),
        },
        _ => SendError::Rejected { message },
    }
}

/// `Retry-After`: delay-seconds or an HTTP-date.
fn parse_retry_after(v: &str) -> Option<Duration> {
    if let Ok(secs) = v.trim().parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = chrono::DateTime::parse_from_rfc2822(v.trim()).ok()?;
    let ms = at.timestamp_millis() - chrono::Utc::now().timestamp_millis();
    Some(Duration::from_millis(ms.max(0) as u64))
}
