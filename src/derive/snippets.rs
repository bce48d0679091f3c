//! Code snippets: fenced blocks in agent text, and the output of file-reading tools (path from the arguments).

use serde_json::Value;

use crate::model::step::Snippet;

/// Tool names that read files, compared case-insensitively after removing `_`/`-`.
const READ_TOOLS: &[&str] = &[
    "read",
    "readfile",
    "view",
    "viewfile",
    "cat",
    "openfile",
    "getfilecontents",
    "fileread",
];
const PATH_ARGS: &[&str] = &["file_path", "path", "filepath", "filename", "file", "target_file"];
const MAX_SNIPPET_BYTES: usize = 8 * 1024;

pub fn fenced_blocks(text: &str, source_step: u32) -> Vec<Snippet> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("```") {
        let after = &rest[start + 3..];
        let Some(nl) = after.find('\n') else { break };
        let lang = after[..nl].trim();
        let body = &after[nl + 1..];
        let Some(end) = body.find("```") else { break };
        let code = body[..end].trim_end_matches('\n');
        if !code.trim().is_empty() {
            out.push(Snippet {
                file_path: None,
                start_line: None,
                end_line: None,
                language: (!lang.is_empty()).then(|| lang.split_whitespace().next().unwrap_or(lang).to_owned()),
                text: truncate(code),
                source_step: Some(source_step),
            });
        }
        rest = &body[end + 3..];
    }
    out
}

pub fn is_read_tool(name: &str) -> bool {
    let norm: String = name
        .chars()
        .filter(|c| *c != '_' && *c != '-')
        .collect::<String>()
        .to_ascii_lowercase();
    READ_TOOLS.contains(&norm.as_str())
}

/// A snippet for a file-reading tool's result, if the call names a path.
pub fn from_read_tool(args: &Value, content: &str, source_step: u32) -> Option<Snippet> {
    let path = PATH_ARGS.iter().find_map(|k| args.get(*k).and_then(Value::as_str))?;
    if content.trim().is_empty() {
        return None;
    }
    let start = ["offset", "start_line", "line", "from"]
        .iter()
        .find_map(|k| args.get(*k).and_then(Value::as_u64));
    let start_line = start.unwrap_or(1).max(1);
    let lines = content.lines().count() as u64;
    Some(Snippet {
        file_path: Some(path.to_owned()),
        start_line: Some(start_line),
        end_line: Some(start_line + lines.saturating_sub(1)),
        language: language_of(path),
        text: truncate(content),
        source_step: Some(source_step),
    })
}

fn truncate(s: &str) -> String {
    if s.len() <= MAX_SNIPPET_BYTES {
        return s.to_owned();
    }
    let mut end = MAX_SNIPPET_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

fn language_of(path: &str) -> Option<String> {
    let ext = path.rsplit_once('.')?.1.to_ascii_lowercase();
    let lang = match ext.as_str() {
        "rs" => "rust",
        "py" => "python",
        "ts" | "tsx" => "typescript",
        "js" | "jsx" | "mjs" => "javascript",
        "go" => "go",
        "java" => "java",
        "rb" => "ruby",
        "c" | "h" => "c",
        "cc" | "cpp" | "hpp" => "cpp",
        "md" => "markdown",
        "json" => "json",
        "toml" => "toml",
        "yaml" | "yml" => "yaml",
        "sh" => "bash",
        "sql" => "sql",
        "html" => "html",
        "css" => "css",
        _ => return None,
    };
    Some(lang.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fenced_and_read_tool() {
        let s = fenced_blocks("Here:\n```rust\nfn main() {}\n```\nand ```\nx\n```", 3);
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].language.as_deref(), Some("rust"));
        assert_eq!(s[0].text, "fn main() {}");
        assert!(is_read_tool("Read") && is_read_tool("read_file") && !is_read_tool("bash"));
        let sn = from_read_tool(&json!({"file_path": "src/a.py", "offset": 10}), "a\nb\nc", 2).unwrap();
        assert_eq!((sn.start_line, sn.end_line), (Some(10), Some(12)));
        assert_eq!(sn.language.as_deref(), Some("python"));
    }
}
