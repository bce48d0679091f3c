//! Sending one OTLP export request, and classifying failures exactly as the OTLP spec says: what may be retried
//! (gRPC UNAVAILABLE & co., RESOURCE_EXHAUSTED only with RetryInfo; HTTP 429/502/503/504, connection failures),
//! with the server's requested delay, and what must not be (everything else, and any partial success).

use std::io::Write;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_client::TraceServiceClient;
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use prost::Message;
use tonic::transport::Channel;
use tonic_types::StatusExt;

use crate::config::{OtlpConfig, OtlpProtocol};

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("export failed, will retry: {message}")]
    Retryable {
        message: String,
        retry_after: Option<Duration>,
    },
    #[error("export rejected, batch dropped: {message}")]
    Permanent { message: String },
    #[error("bad exporter configuration: {0}")]
    Config(String),
}

/// Accepted, with how many spans the receiver rejected (a partial success, never retried).
pub struct Accepted {
    pub rejected: i64,
    pub message: String,
}

pub enum Transport {
    Grpc(TraceServiceClient<Channel>),
    Http(Box<HttpTransport>),
}

pub struct HttpTransport {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    uri: http::Uri,
    json: bool,
}

impl Transport {
    pub fn new(cfg: &OtlpConfig) -> Result<Transport, ExportError> {
        match cfg.protocol {
            OtlpProtocol::Grpc => {
                let endpoint = tonic::transport::Endpoint::from_shared(cfg.endpoint.clone())
                    .map_err(|e| ExportError::Config(e.to_string()))?
                    .connect_timeout(cfg.timeout)
                    .timeout(cfg.timeout);
                // Lazy: a receiver that is down at startup is retried like any other outage.
                let mut client = TraceServiceClient::new(endpoint.connect_lazy());
                if cfg.gzip {
                    client = client.send_compressed(tonic::codec::CompressionEncoding::Gzip);
                }
                Ok(Transport::Grpc(client))
            }
            OtlpProtocol::HttpProtobuf | OtlpProtocol::HttpJson => {
                let mut roots = rustls::RootCertStore::empty();
                roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
                let tls = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .map_err(|e| ExportError::Config(e.to_string()))?
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
                    .map_err(|e: http::uri::InvalidUri| ExportError::Config(e.to_string()))?;
                Ok(Transport::Http(Box::new(HttpTransport {
                    client: Client::builder(TokioExecutor::new()).build(https),
                    uri,
                    json: cfg.protocol == OtlpProtocol::HttpJson,
                })))
            }
        }
    }

    pub async fn send(&mut self, cfg: &OtlpConfig, req: ExportTraceServiceRequest) -> Result<Accepted, ExportError> {
        match self {
            Transport::Grpc(client) => {
                let mut request = tonic::Request::new(req);
                request.set_timeout(cfg.timeout);
                for (k, v) in &cfg.headers {
                    if let (Ok(k), Ok(v)) = (
                        tonic::metadata::MetadataKey::from_bytes(k.to_ascii_lowercase().as_bytes()),
                        v.parse(),
                    ) {
                        request.metadata_mut().insert(k, v);
                    }
                }
                match client.export(request).await {
                    Ok(resp) => Ok(accepted(resp.into_inner())),
                    Err(status) => Err(classify_grpc(&status)),
                }
            }
            Transport::Http(h) => {
                let HttpTransport { client, uri, json } = h.as_mut();
                let (body, content_type) = if *json {
                    (
                        serde_json::to_vec(&req).map_err(|e| ExportError::Permanent { message: e.to_string() })?,
                        "application/json",
                    )
                } else {
                    (req.encode_to_vec(), "application/x-protobuf")
                };
                let mut builder = http::Request::post(uri.clone()).header("content-type", content_type);
                let body = if cfg.gzip {
                    builder = builder.header("content-encoding", "gzip");
                    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                    let _ = enc.write_all(&body);
                    enc.finish().unwrap_or_default()
                } else {
                    body
                };
                for (k, v) in &cfg.headers {
                    builder = builder.header(k.as_str(), v.as_str());
                }
                let request = builder
                    .body(Full::new(Bytes::from(body)))
                    .map_err(|e| ExportError::Config(e.to_string()))?;
                let resp = match tokio::time::timeout(cfg.timeout, client.request(request)).await {
                    Err(_) => return Err(retry("timed out", None)),
                    Ok(Err(e)) => return Err(retry(&format!("connection failed: {e}"), None)),
                    Ok(Ok(r)) => r,
                };
                let status = resp.status().as_u16();
                let retry_after = resp
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(parse_retry_after);
                let bytes = resp
                    .into_body()
                    .collect()
                    .await
                    .map(|c| c.to_bytes())
                    .unwrap_or_default();
                match status {
                    200..=299 => {
                        let parsed = if *json {
                            serde_json::from_slice::<ExportTraceServiceResponse>(&bytes).ok()
                        } else {
                            ExportTraceServiceResponse::decode(bytes.as_ref()).ok()
                        };
                        Ok(parsed.map(accepted).unwrap_or(Accepted {
                            rejected: 0,
                            message: String::new(),
                        }))
                    }
                    429 | 502 | 503 | 504 => Err(retry(&format!("HTTP {status}"), retry_after)),
                    _ => Err(ExportError::Permanent {
                        message: format!(
                            "HTTP {status}: {}",
                            String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
                        ),
                    }),
                }
            }
        }
    }
}

fn retry(message: &str, retry_after: Option<Duration>) -> ExportError {
    ExportError::Retryable {
        message: message.to_owned(),
        retry_after,
    }
}

fn accepted(resp: ExportTraceServiceResponse) -> Accepted {
    match resp.partial_success {
        Some(p) => Accepted {
            rejected: p.rejected_spans,
            message: p.error_message,
        },
        None => Accepted {
            rejected: 0,
            message: String::new(),
        },
    }
}

fn classify_grpc(status: &tonic::Status) -> ExportError {
    use tonic::Code;
    let delay = status.get_details_retry_info().and_then(|r| r.retry_delay);
    let message = format!("{:?}: {}", status.code(), status.message());
    match status.code() {
        Code::Cancelled
        | Code::DeadlineExceeded
        | Code::Aborted
        | Code::OutOfRange
        | Code::Unavailable
        | Code::DataLoss => retry(&message, delay),
        Code::ResourceExhausted if delay.is_some() => retry(&message, delay),
        _ => ExportError::Permanent { message },
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
