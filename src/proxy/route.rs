//! Path routing: `/<upstream>/<rest>` → a configured upstream. Anything else is refused (not an open proxy).
//!
//! Agents that can only set a base URL pass session metadata in the path:
//! `/s/<session>/a/<agent>/<upstream>/<rest>` (each of `s/` and `a/` optional, in either order).

use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::config::UpstreamConfig;

#[derive(Debug)]
pub struct Route<'a> {
    pub upstream: &'a Arc<UpstreamConfig>,
    /// The path to send upstream, starting with `/` (the upstream's own path prefix not yet applied).
    pub rest: &'a str,
    pub session: Option<String>,
    pub agent: Option<String>,
}

pub struct Router {
    /// FxHash: the keys are the operator's upstream names, and SipHash's flood resistance buys nothing for them
    /// while costing a visible share of a proxied request's CPU.
    upstreams: FxHashMap<String, Arc<UpstreamConfig>>,
}

impl Router {
    pub fn new(upstreams: impl IntoIterator<Item = UpstreamConfig>) -> Router {
        Router {
            upstreams: upstreams
                .into_iter()
                .map(|u| (u.name.to_string(), Arc::new(u)))
                .collect(),
        }
    }

    pub fn route<'a>(&'a self, path: &'a str) -> Option<Route<'a>> {
        let mut rest = path;
        let mut session = None;
        let mut agent = None;
        loop {
            let (first, after) = split_first_segment(rest)?;
            match first {
                "s" | "a" => {
                    let (value, after_value) = split_first_segment(after)?;
                    let value = percent_decode(value);
                    if first == "s" {
                        session = Some(value);
                    } else {
                        agent = Some(value);
                    }
                    rest = after_value;
                }
                name => {
                    let upstream = self.upstreams.get(name)?;
                    let rest = if after.is_empty() { "/" } else { after };
                    return Some(Route {
                        upstream,
                        rest,
                        session,
                        agent,
                    });
                }
            }
        }
    }
}

/// A `.` or `..` segment, also percent-encoded (`%2e%2E`). Upstreams (and anything in front of them) would
/// resolve `/openai/../x` to a path outside the route's prefix, so such paths are refused rather than
/// normalized: no API client sends them.
pub fn has_dot_segment(path: &str) -> bool {
    path.split('/').any(is_dot_segment)
}

/// One or two dots, each written `.`, `%2e` or `%2E`. Scanned in place: every forwarded request passes here.
fn is_dot_segment(segment: &str) -> bool {
    let mut rest = segment.as_bytes();
    let mut dots = 0;
    while !rest.is_empty() {
        rest = match rest {
            [b'.', tail @ ..] => tail,
            [b'%', b'2', b'e' | b'E', tail @ ..] => tail,
            _ => return false,
        };
        dots += 1;
        if dots > 2 {
            return false;
        }
    }
    dots > 0
}

/// "/abc/def" → ("abc", "/def"); "/abc" → ("abc", "").
fn split_first_segment(path: &str) -> Option<(&str, &str)> {
    let path = path.strip_prefix('/')?;
    let (seg, rest) = match path.find('/') {
        Some(i) => (&path[..i], &path[i..]),
        None => (path, ""),
    };
    if seg.is_empty() { None } else { Some((seg, rest)) }
}

fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn router() -> Router {
        Router::new(Config::default().validate().unwrap().upstreams.into_values())
    }

    #[test]
    fn routes_by_prefix_and_refuses_the_rest() {
        let r = router();
        let route = r.route("/anthropic/v1/messages").unwrap();
        assert_eq!(&*route.upstream.name, "anthropic");
        assert_eq!(route.rest, "/v1/messages");
        assert!(r.route("/evil.com/v1/messages").is_none());
        assert!(r.route("/").is_none());
        assert!(r.route("/s/abc").is_none());
    }

    #[test]
    fn dot_segments_are_found_plain_and_encoded() {
        for path in ["/openai/../x", "/openai/v1/./chat", "/a/%2e%2E/b", "/openai/%2E", "/.."] {
            assert!(has_dot_segment(path), "{path}");
        }
        for path in [
            "/openai/v1/chat/completions",
            "/gemini/v1beta/models/gemini-2.5.flash:generateContent",
            "/a/...b",
            "/a/.hidden",
            "/a/%2e%2e%2e",
            "/a/%2f",
            "/a/%2",
            "/a/.%2",
            "/a//b/",
        ] {
            assert!(!has_dot_segment(path), "{path}");
        }
    }

    #[test]
    fn path_form_carries_session_and_agent() {
        let r = router();
        let route = r.route("/s/run%2042/a/planner/openai/v1/chat/completions").unwrap();
        assert_eq!(route.session.as_deref(), Some("run 42"));
        assert_eq!(route.agent.as_deref(), Some("planner"));
        assert_eq!(&*route.upstream.name, "openai");
        assert_eq!(route.rest, "/v1/chat/completions");
    }
}
