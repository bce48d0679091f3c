//! The module graph follows the data flow: a module may use modules of its own layer or below, never above.
//! Reads `src/` (outside test code) for `crate::<module>` paths and fails on an upward import, naming it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::Path;

/// Lowest first. One line per layer; modules on a line may use each other.
const LAYERS: &[&[&str]] = &[
    &["model", "semconv", "allocator"],
    &["telemetry", "config", "cost"],
    &["background"],
    &["capture"],
    &["provider"],
    &["proxy"],
    &["derive"],
    &["store"],
    &["pipeline"],
    &["export"],
    &["api"],
    &["cli", "app"],
];

fn layer_of(module: &str) -> usize {
    LAYERS
        .iter()
        .position(|layer| layer.contains(&module))
        .unwrap_or_else(|| panic!("module `{module}` has no layer in tests/module_graph.rs: add it where it belongs"))
}

/// The file without its comments and test code: a `#[cfg(test)] mod name { ... }` runs to the end of the file (the
/// convention here), and a `#[cfg(test)]` item of one line (`mod testkit;`, a `use`) is dropped.
fn without_tests(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        // Comments may name any module (doc links describe the flow); only code imports.
        if line.trim_start().starts_with("//") {
            continue;
        }
        if line.trim() != "#[cfg(test)]" {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        match lines.next() {
            Some(item) if item.trim_end().ends_with('{') => break,
            _ => {}
        }
    }
    out
}

/// Modules declared test-only (`#[cfg(test)] mod name;`): their files are test code.
fn test_only_modules(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    lines
        .windows(2)
        .filter(|w| w[0] == "#[cfg(test)]")
        .filter_map(|w| w[1].strip_prefix("mod ").and_then(|m| m.strip_suffix(';')))
        .map(str::to_owned)
        .collect()
}

/// Top-level modules a file names through `crate::`, outside its test code.
fn imports(text: &str) -> BTreeSet<String> {
    let code = without_tests(text);
    let mut out = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.insert(name);
        }
    }
    out
}

fn visit(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            visit(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

#[test]
fn no_module_imports_a_module_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    visit(&src, &mut files);
    let test_only: BTreeSet<String> = files
        .iter()
        .flat_map(|f| test_only_modules(&std::fs::read_to_string(f).unwrap()))
        .collect();
    let mut upward = Vec::new();
    for file in &files {
        if file
            .file_stem()
            .is_some_and(|stem| test_only.contains(&*stem.to_string_lossy()))
        {
            continue;
        }
        let rel = file.strip_prefix(&src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .into_owned();
        let module = first.trim_end_matches(".rs");
        // The crate root and the binaries wire everything together.
        if matches!(module, "lib" | "main" | "bin") {
            continue;
        }
        let own = layer_of(module);
        for used in imports(&std::fs::read_to_string(file).unwrap()) {
            if used != module && layer_of(&used) > own {
                upward.push(format!("{} uses crate::{used}", rel.display()));
            }
        }
    }
    assert!(upward.is_empty(), "upward imports:\n{}", upward.join("\n"));
}

#[test]
fn the_check_sees_an_upward_import() {
    let found = imports(
        "#[cfg(test)]\nmod testkit;\nuse crate::store::Record;\nfn f() { crate::pipeline::run(); }\n#[cfg(test)]\nmod tests {\n    use crate::api;\n}\n",
    );
    assert_eq!(found, BTreeSet::from(["pipeline".to_owned(), "store".to_owned()]));
    assert_eq!(test_only_modules("#[cfg(test)]\nmod testkit;\nmod real;"), ["testkit"]);
    assert!(layer_of("store") > layer_of("derive"));
}
