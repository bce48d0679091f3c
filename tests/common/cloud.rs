//! The cloud-route fixtures (`tests/fixtures/cloud`, written by scripts/gen-cloud-fixtures.py from the providers'
//! documentation; provenance in its SOURCES.md) and an upstream that answers each fixture's path with its bytes,
//! one event-stream message or SSE event per frame.

use super::*;

/// One documented interaction on a cloud route.
#[derive(Debug, Clone)]
pub struct CloudFixture {
    /// `bedrock/invoke_tool_use`.
    pub name: String,
    /// The `api` of its route in llmtap's config (`bedrock`, `bedrock-mantle`, `vertex`, `azure-openai`).
    pub family: &'static str,
    /// Path and query as the provider receives it.
    pub path: String,
    pub status: u16,
    pub content_type: String,
    pub request: Vec<u8>,
    /// The response body exactly as the provider sends it.
    pub body: Vec<u8>,
}

/// The provider's host → the route's API family.
fn family_for(host: &str) -> Option<&'static str> {
    Some(if host.starts_with("bedrock-runtime.") {
        "bedrock"
    } else if host.starts_with("bedrock-mantle.") {
        "bedrock-mantle"
    } else if host.ends_with("aiplatform.googleapis.com") {
        "vertex"
    } else if host.ends_with(".openai.azure.com") {
        "azure-openai"
    } else {
        return None;
    })
}

pub fn cloud_fixtures() -> Vec<CloudFixture> {
    let root = fixtures_root().join("cloud");
    let mut dirs = Vec::new();
    for shape in std::fs::read_dir(&root).unwrap().flatten() {
        for d in std::fs::read_dir(shape.path()).into_iter().flatten().flatten() {
            if d.path().join("meta.json").exists() {
                dirs.push(d.path());
            }
        }
    }
    let mut out: Vec<CloudFixture> = dirs
        .iter()
        .map(|d| {
            let meta: Value = serde_json::from_slice(&std::fs::read(d.join("meta.json")).unwrap()).unwrap();
            let url = meta["url"].as_str().unwrap();
            let rest = url.strip_prefix("https://").unwrap();
            let (host, path) = rest.split_at(rest.find('/').unwrap());
            let body = ["response.eventstream", "response.sse", "response.json"]
                .iter()
                .find_map(|f| std::fs::read(d.join(f)).ok())
                .unwrap_or_default();
            CloudFixture {
                name: d.strip_prefix(&root).unwrap().to_string_lossy().into_owned(),
                family: family_for(host).unwrap_or_else(|| panic!("no route family for {host}")),
                path: path.to_owned(),
                status: meta["status"]["code"].as_u64().unwrap_or(200) as u16,
                content_type: meta["response_headers"]["content-type"][0].as_str().unwrap().to_owned(),
                request: std::fs::read(d.join("request.json")).unwrap(),
                body,
            }
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

pub fn cloud_fixture(name: &str) -> CloudFixture {
    cloud_fixtures()
        .into_iter()
        .find(|f| f.name == name)
        .unwrap_or_else(|| panic!("no cloud fixture {name}"))
}

impl CloudFixture {
    /// The route name the tests give this fixture's family.
    pub fn route(&self) -> &'static str {
        match self.family {
            "bedrock" => "bedrock",
            "bedrock-mantle" => "bedrock-mantle",
            "vertex" => "vertex",
            _ => "azure",
        }
    }

    /// The body cut into the frames a provider sends: one event-stream message or SSE event each.
    pub fn frames(&self, body: &[u8]) -> Vec<Bytes> {
        if self.content_type.contains("eventstream") {
            let mut frames = Vec::new();
            let mut rest = body;
            while rest.len() >= 4 {
                let total = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
                let take = total.clamp(1, rest.len());
                frames.push(Bytes::copy_from_slice(&rest[..take]));
                rest = &rest[take..];
            }
            if !rest.is_empty() {
                frames.push(Bytes::copy_from_slice(rest));
            }
            frames
        } else if self.content_type.contains("event-stream") {
            let text = String::from_utf8_lossy(body);
            text.split_inclusive("\n\n")
                .map(|e| Bytes::from(e.to_owned()))
                .collect()
        } else {
            vec![Bytes::copy_from_slice(body)]
        }
    }
}

/// Config routes for the four cloud families, to `up` (`ca_file` when it serves TLS).
pub fn cloud_routes(up: &Upstream) -> String {
    let tls = up.ca_pem_path.exists();
    let base = format!("{}://127.0.0.1:{}", if tls { "https" } else { "http" }, up.addr.port());
    let mut s = String::new();
    for (name, api) in [
        ("bedrock", "bedrock"),
        ("bedrock-mantle", "bedrock-mantle"),
        ("vertex", "vertex"),
        ("azure", "azure-openai"),
    ] {
        s.push_str(&format!("[upstreams.{name}]\nurl = \"{base}\"\napi = \"{api}\"\n"));
        if tls {
            s.push_str(&format!("ca_file = \"{}\"\n", up.ca_pem_path.display()));
        }
    }
    s.push_str("[api]\nlisten = \"127.0.0.1:0\"\n[viewer]\nlisten = \"off\"\n");
    s
}

/// An upstream answering each fixture's path (query removed) with its status, content type and frames;
/// `bodies` replaces a fixture's body (by name) to serve damaged streams.
pub async fn serve_cloud(fixtures: Vec<CloudFixture>, bodies: HashMap<String, Vec<u8>>) -> Upstream {
    let received = Arc::new(Mutex::new(Vec::new()));
    let fixtures = Arc::new((fixtures, bodies));
    let rec = received.clone();
    serve_tls(
        "127.0.0.1:0".parse().unwrap(),
        received,
        move |req: Request<Incoming>| {
            let fixtures = fixtures.clone();
            let rec = rec.clone();
            async move {
                let (parts, body) = req.into_parts();
                let body = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
                let path = parts
                    .uri
                    .path_and_query()
                    .map(|p| p.as_str().to_owned())
                    .unwrap_or_default();
                let (list, bodies) = &*fixtures;
                let fixture = list
                    .iter()
                    .find(|f| f.path.split('?').next() == path.split('?').next() && f.request.as_slice() == &body[..])
                    .or_else(|| list.iter().find(|f| f.path.split('?').next() == path.split('?').next()));
                rec.lock().unwrap().push(Received {
                    authority: authority_of(&parts),
                    fixture: fixture.map(|f| f.name.clone()),
                    method: parts.method.to_string(),
                    path: path.clone(),
                    headers: parts.headers.clone(),
                    body: body.clone(),
                    body_matched: fixture.is_some_and(|f| f.request.as_slice() == &body[..]),
                    cancelled: Arc::new(AtomicBool::new(false)),
                });
                let (status, content_type, frames) = match fixture {
                    Some(f) => {
                        let bytes = bodies.get(&f.name).cloned().unwrap_or_else(|| f.body.clone());
                        (f.status, f.content_type.clone(), f.frames(&bytes))
                    }
                    None => (
                        404,
                        "application/json".to_owned(),
                        vec![Bytes::from_static(b"{\"message\":\"no fixture\"}")],
                    ),
                };
                let (tx, rx) = mpsc::channel(frames.len().max(1));
                for f in frames {
                    let _ = tx.try_send(Ok(Frame::data(f)));
                }
                let mut resp = Response::new(ChannelBody(rx));
                *resp.status_mut() = StatusCode::from_u16(status).unwrap();
                resp.headers_mut().insert("content-type", content_type.parse().unwrap());
                Ok(resp)
            }
        },
    )
    .await
}
