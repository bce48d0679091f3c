//! The intercept list: which CONNECT targets llmtap decrypts and captures, and which wire protocol to expect
//! there. Everything not on it is tunnelled blind.

use crate::capture::Api;
use crate::config::{ApiFamily, Config};
use crate::provider::detect_api;

/// A host pattern: labels compared one by one, `*` matching any run of characters within its label
/// (`bedrock-runtime.*.amazonaws.com`, `*-aiplatform.googleapis.com`).
#[derive(Debug, Clone)]
struct Pattern {
    text: String,
    /// The port it applies to; None: any.
    port: Option<u16>,
    family: Option<ApiFamily>,
    /// Only paths under this prefix are captured (chatgpt.com serves far more than Codex); the rest pass
    /// through the decrypted connection uncaptured.
    capture_prefix: Option<&'static str>,
}

/// The known LLM API hosts (HTTPS, port 443).
const BUILTIN: &[(&str, Option<ApiFamily>, Option<&str>)] = &[
    ("api.openai.com", Some(ApiFamily::Openai), None),
    ("api.anthropic.com", Some(ApiFamily::Anthropic), None),
    ("generativelanguage.googleapis.com", Some(ApiFamily::Gemini), None),
    ("aiplatform.googleapis.com", Some(ApiFamily::Gemini), None),
    ("*-aiplatform.googleapis.com", Some(ApiFamily::Gemini), None),
    ("cloudcode-pa.googleapis.com", Some(ApiFamily::Gemini), None),
    ("bedrock-runtime.*.amazonaws.com", None, None),
    ("bedrock-mantle.*.api.aws", Some(ApiFamily::Openai), None),
    ("*.openai.azure.com", Some(ApiFamily::Openai), None),
    ("*.services.ai.azure.com", None, None),
    ("chatgpt.com", Some(ApiFamily::Openai), Some("/backend-api/codex/")),
    ("openrouter.ai", Some(ApiFamily::Openai), None),
    ("api.groq.com", Some(ApiFamily::Openai), None),
    ("api.mistral.ai", Some(ApiFamily::Openai), None),
    ("api.x.ai", Some(ApiFamily::Openai), None),
    ("api.deepseek.com", Some(ApiFamily::Openai), None),
    ("api.together.xyz", Some(ApiFamily::Openai), None),
    ("api.fireworks.ai", Some(ApiFamily::Openai), None),
    ("api.cerebras.ai", Some(ApiFamily::Openai), None),
    ("api.moonshot.ai", Some(ApiFamily::Openai), None),
];

/// What the list says about one CONNECT target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Intercepted {
    pub family: Option<ApiFamily>,
    pub capture_prefix: Option<&'static str>,
}

impl Intercepted {
    /// The API a request path on this host speaks (`Api::Other` keeps it as a raw trace); None: not captured.
    pub fn api_for(&self, path: &str) -> Option<Api> {
        if let Some(prefix) = self.capture_prefix
            && !path.starts_with(prefix)
        {
            return None;
        }
        Some(match self.family {
            Some(family) => detect_api(family, path),
            None => [ApiFamily::Anthropic, ApiFamily::Openai, ApiFamily::Gemini]
                .into_iter()
                .map(|f| detect_api(f, path))
                .find(|a| *a != Api::Other)
                .unwrap_or(Api::Other),
        })
    }
}

#[derive(Debug, Clone)]
pub struct InterceptList {
    intercept: Vec<Pattern>,
    passthrough: Vec<String>,
}

impl InterceptList {
    /// The built-in hosts, every configured upstream's host (on its port), `[forward] intercept`, minus
    /// `[forward] passthrough`.
    pub fn new(config: &Config) -> InterceptList {
        let mut intercept = Vec::new();
        // Configured upstreams first: their API family is the operator's word for that host.
        for u in config.upstreams.values() {
            if let Some(host) = u.url.host() {
                let default = if u.url.scheme_str() == Some("http") { 80 } else { 443 };
                intercept.push(Pattern {
                    text: host.trim_matches(['[', ']']).to_ascii_lowercase(),
                    port: Some(u.url.port_u16().unwrap_or(default)),
                    family: Some(u.api()),
                    capture_prefix: None,
                });
            }
        }
        for (text, family, capture_prefix) in BUILTIN {
            intercept.push(Pattern {
                text: (*text).to_owned(),
                port: Some(443),
                family: *family,
                capture_prefix: *capture_prefix,
            });
        }
        for text in &config.forward.intercept {
            intercept.push(Pattern {
                text: text.clone(),
                port: None,
                family: None,
                capture_prefix: None,
            });
        }
        InterceptList {
            intercept,
            passthrough: config.forward.passthrough.clone(),
        }
    }

    /// Whether `host:port` is decrypted, and how. `host` is lowercase.
    pub fn lookup(&self, host: &str, port: u16) -> Option<Intercepted> {
        if self.passthrough.iter().any(|p| host_matches(p, host)) {
            return None;
        }
        self.intercept
            .iter()
            .find(|p| p.port.is_none_or(|want| want == port) && host_matches(&p.text, host))
            .map(|p| Intercepted {
                family: p.family,
                capture_prefix: p.capture_prefix,
            })
    }

    /// The DNS names llmtap's CA may vouch for (its name constraints): each pattern's part after its last
    /// wildcard label, or the host itself; IP addresses are left out (no DNS constraint applies to them).
    pub fn ca_names(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for p in &self.intercept {
            if p.text.parse::<std::net::IpAddr>().is_ok() {
                continue;
            }
            let labels: Vec<&str> = p.text.split('.').collect();
            let fixed = match labels.iter().rposition(|l| l.contains('*')) {
                Some(i) => labels[i + 1..].join("."),
                None => p.text.clone(),
            };
            // A wildcard in the last labels (`*.ai`) would need a constraint too wide to be worth having.
            if fixed.split('.').count() >= 2 && !names.contains(&fixed) {
                names.push(fixed);
            }
        }
        let all = names.clone();
        names.retain(|n| !all.iter().any(|other| other != n && n.ends_with(&format!(".{other}"))));
        names.sort();
        names
    }
}

/// `pattern` (labels, `*` within a label) against `host`, both lowercase.
pub fn host_matches(pattern: &str, host: &str) -> bool {
    let (mut p, mut h) = (pattern.split('.'), host.split('.'));
    loop {
        match (p.next(), h.next()) {
            (None, None) => return true,
            (Some(pl), Some(hl)) if label_matches(pl.as_bytes(), hl.as_bytes()) => {}
            _ => return false,
        }
    }
}

fn label_matches(pattern: &[u8], label: &[u8]) -> bool {
    match pattern.iter().position(|&b| b == b'*') {
        None => pattern == label,
        Some(i) => {
            let (prefix, rest) = (&pattern[..i], &pattern[i + 1..]);
            if !label.starts_with(prefix) || label.len() < prefix.len() {
                return false;
            }
            let label = &label[prefix.len()..];
            // `*` takes at least one character, then the rest (which may hold more stars) matches a suffix.
            (1..=label.len()).any(|taken| label_matches(rest, &label[taken..]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn list(extra: &str) -> InterceptList {
        let raw = Config::from_toml(extra).unwrap();
        InterceptList::new(&raw.validate().unwrap())
    }

    #[test]
    fn built_in_hosts_wildcards_and_configuration() {
        let l = list("[forward]\nintercept = [\"llm.corp.example\"]\npassthrough = [\"api.groq.com\"]\n");
        assert!(l.lookup("api.anthropic.com", 443).is_some());
        assert!(
            l.lookup("api.anthropic.com", 8443).is_none(),
            "built-in hosts on 443 only"
        );
        assert!(l.lookup("us-east5-aiplatform.googleapis.com", 443).is_some());
        assert!(l.lookup("storage.googleapis.com", 443).is_none());
        assert!(l.lookup("bedrock-runtime.us-east-1.amazonaws.com", 443).is_some());
        assert!(l.lookup("bedrock-runtime.amazonaws.com", 443).is_none());
        assert!(l.lookup("myres.openai.azure.com", 443).is_some());
        assert!(l.lookup("llm.corp.example", 9000).is_some());
        assert!(l.lookup("api.groq.com", 443).is_none(), "passthrough wins");
        assert!(l.lookup("github.com", 443).is_none());
        let chatgpt = l.lookup("chatgpt.com", 443).unwrap();
        assert_eq!(
            chatgpt.api_for("/backend-api/codex/responses"),
            Some(Api::OpenAiResponses)
        );
        assert_eq!(chatgpt.api_for("/backend-api/conversation"), None);
        let anthropic = l.lookup("api.anthropic.com", 443).unwrap();
        assert_eq!(anthropic.api_for("/v1/messages"), Some(Api::AnthropicMessages));
        assert_eq!(
            anthropic.api_for("/v1/unknown"),
            Some(Api::Other),
            "kept as a raw trace"
        );
        let names = l.ca_names();
        assert!(names.contains(&"googleapis.com".to_owned()), "{names:?}");
        assert!(names.contains(&"amazonaws.com".to_owned()));
        assert!(!names.contains(&"api.openai.com".to_owned()) || !names.contains(&"openai.com".to_owned()));
        assert!(
            !names.contains(&"generativelanguage.googleapis.com".to_owned()),
            "covered by googleapis.com"
        );
    }
}
