//! docs/operations.md lists every metric llmtap reports, generated from the instrument registry
//! (`telemetry::instruments`): this test fails when the two drift. `LLMTAP_WRITE_DOCS=1` rewrites the section.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

const DOC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md");
const END: &str = "<!-- metrics:end -->";

#[test]
fn the_metric_list_in_operations_md_is_the_instrument_registry() {
    let doc = std::fs::read_to_string(DOC).unwrap();
    let begin = doc
        .find("<!-- metrics:begin")
        .expect("docs/operations.md has a metrics:begin marker");
    let body_start = begin + doc[begin..].find("-->").unwrap() + "-->".len() + 1;
    let end = doc.find(END).expect("docs/operations.md has a metrics:end marker");
    let generated = llmtap::telemetry::instruments::markdown_table();
    if std::env::var_os("LLMTAP_WRITE_DOCS").is_some() {
        let rewritten = format!("{}{generated}{}", &doc[..body_start], &doc[end..]);
        std::fs::write(DOC, rewritten).unwrap();
        return;
    }
    assert_eq!(
        &doc[body_start..end],
        generated,
        "docs/operations.md's metric list differs from telemetry::instruments; rewrite it with \
         LLMTAP_WRITE_DOCS=1 cargo test --test metrics_doc"
    );
}

#[test]
fn every_instrument_is_documented_and_named_once() {
    let mut names = std::collections::BTreeSet::new();
    for i in llmtap::telemetry::instruments::INSTRUMENTS {
        assert!(names.insert(i.name), "{} is declared twice", i.name);
        assert!(i.name.starts_with("llmtap_"), "{}", i.name);
        assert!(!i.name.ends_with("_total"), "{}: the exposition adds _total", i.name);
        assert!(!i.help.is_empty() && !i.unit.is_empty(), "{}", i.name);
    }
}
