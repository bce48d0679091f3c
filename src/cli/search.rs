//! `llmtap search`: the viewer's search (`store::search`) on the command line, from the local or the shared
//! store. One hit per line (a JSON object with `--json`), then its snippet with the matches in «».

use std::io::Write;

use crate::store::search::SearchHit;

/// The hits as lines: time, agent, model, where it matched, the step (session, trajectory/index), then the
/// snippet indented.
pub fn write_hits(out: &mut impl Write, hits: &[SearchHit], json: bool) -> std::io::Result<()> {
    for h in hits {
        if json {
            writeln!(out, "{}", serde_json::to_string(h).map_err(std::io::Error::other)?)?;
            continue;
        }
        let field = serde_json::to_value(h.field)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        writeln!(
            out,
            "{}  {}  {}  {}{}  session {}  step {}",
            h.timestamp,
            h.agent.as_deref().unwrap_or("-"),
            h.model.as_deref().unwrap_or("-"),
            field,
            if h.error { " (error)" } else { "" },
            h.session_id,
            h.step_id,
        )?;
        let snippet: String = h
            .snippet
            .iter()
            .map(|p| {
                if p.hit {
                    format!("«{}»", p.text)
                } else {
                    p.text.clone()
                }
            })
            .collect();
        // One line: the snippet's own line breaks would read as further hits.
        writeln!(out, "    {}", snippet.split_whitespace().collect::<Vec<_>>().join(" "))?;
    }
    Ok(())
}
