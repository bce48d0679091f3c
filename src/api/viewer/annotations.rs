//! The viewer's annotation routes: `POST api/annotations` adds a note, a label and/or a score to a session, a
//! trajectory or a step; `DELETE api/annotations/<id>` removes one. Annotations come back inside the answers
//! that show their targets (`data`: the sessions list, a session, a trajectory's steps).
//!
//! These are the viewer's only writes, so they take more than the read routes' cross-site check (`mod.rs`,
//! every `/api/` route): a body must be `Content-Type: application/json`, which a plain HTML form cannot send
//! and a cross-origin script cannot send without a preflight the viewer never answers. Input is bounded and
//! checked here; the page renders it as text only, never as markup.

use serde::Deserialize;
use serde_json::{Value, json};

use crate::model::annotation::{Annotation, AnnotationTarget};
use crate::store::{Query, Store, StoreError};

/// Largest request body read.
pub const MAX_BODY: usize = 16 * 1024;
/// Limits on what one annotation holds, in characters.
pub const MAX_NOTE: usize = 4_000;
pub const MAX_LABEL: usize = 64;
const MAX_ID: usize = 512;

/// An annotation as the page sends it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Posted {
    target: String,
    id: String,
    #[serde(default)]
    note: Option<String>,
    #[serde(default)]
    label: Option<String>,
    #[serde(default)]
    score: Option<f64>,
}

/// A checked request to annotate.
#[derive(Debug, Clone, PartialEq)]
pub struct NewAnnotation {
    pub target: AnnotationTarget,
    pub id: String,
    pub note: Option<String>,
    pub label: Option<String>,
    pub score: Option<f64>,
}

/// Whether `content_type` is JSON (`application/json`, parameters such as `charset` allowed).
pub fn is_json(content_type: Option<&str>) -> bool {
    content_type
        .and_then(|c| c.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
}

/// The request body checked; Err: what is wrong with it, for a 400.
pub fn parse(body: &[u8]) -> Result<NewAnnotation, String> {
    let p: Posted = serde_json::from_slice(body).map_err(|e| format!("not an annotation: {e}"))?;
    let target = AnnotationTarget::parse(&p.target)
        .ok_or_else(|| format!("target must be session, trajectory or step, not {:?}", p.target))?;
    if p.id.is_empty() || p.id.chars().count() > MAX_ID || p.id.chars().any(char::is_control) {
        return Err(format!(
            "id must be 1 to {MAX_ID} characters without control characters"
        ));
    }
    let note = p.note.map(|n| n.trim().to_owned()).filter(|n| !n.is_empty());
    if note.as_ref().is_some_and(|n| n.chars().count() > MAX_NOTE) {
        return Err(format!("a note is at most {MAX_NOTE} characters"));
    }
    let label = p.label.map(|l| l.trim().to_owned()).filter(|l| !l.is_empty());
    if let Some(l) = &label
        && (l.chars().count() > MAX_LABEL || l.chars().any(char::is_control))
    {
        return Err(format!(
            "a label is at most {MAX_LABEL} characters, without control characters"
        ));
    }
    if p.score.is_some_and(|s| !s.is_finite()) {
        return Err("score must be a finite number".into());
    }
    if note.is_none() && label.is_none() && p.score.is_none() {
        return Err("an annotation needs a note, a label or a score".into());
    }
    Ok(NewAnnotation {
        target,
        id: p.id,
        note,
        label,
        score: p.score,
    })
}

/// The annotation as the API shows it.
pub fn annotation_json(a: &Annotation) -> Value {
    a.to_json()
}

/// Where the target is: (session key, trajectory id, the target's id as stored); None when it does not exist.
fn locate(reader: &dyn Query, new: &NewAnnotation) -> Result<Option<(String, Option<String>, String)>, StoreError> {
    match new.target {
        // A trajectory id stands for its session, as in `api/sessions/<id>`.
        AnnotationTarget::Session => Ok(reader.session_of(&new.id)?.map(|s| (s.clone(), None, s))),
        AnnotationTarget::Trajectory => {
            if reader.trajectory(&new.id)?.is_none() {
                return Ok(None);
            }
            Ok(reader
                .session_of(&new.id)?
                .map(|s| (s, Some(new.id.clone()), new.id.clone())))
        }
        AnnotationTarget::Step => {
            // A step id is its trajectory's id, `/`, its index and an optional `#attempt` (`derive::steps`).
            let Some((trajectory, rest)) = new.id.rsplit_once('/') else {
                return Ok(None);
            };
            let Ok(index) = rest.split('#').next().unwrap_or("").parse::<u32>() else {
                return Ok(None);
            };
            let found = reader
                .steps_page(trajectory, index.checked_sub(1), 16)?
                .iter()
                .any(|s| s.step_id == new.id);
            if !found {
                return Ok(None);
            }
            Ok(reader
                .session_of(trajectory)?
                .map(|s| (s, Some(trajectory.to_owned()), new.id.clone())))
        }
    }
}

/// Keep `new` (blocking). None: its target does not exist.
pub fn add(store: &Store, new: &NewAnnotation) -> Result<Option<Value>, StoreError> {
    let Some((session, trajectory, target_id)) = store.read(|r| locate(r, new))? else {
        return Ok(None);
    };
    let now = chrono::Utc::now().timestamp_micros();
    let a = Annotation {
        id: format!("an_{}", uuid::Uuid::now_v7().simple()),
        target: new.target,
        target_id,
        session_id: session,
        trajectory_id: trajectory,
        note: new.note.clone(),
        label: new.label.clone(),
        score: new.score,
        created_us: now,
    };
    store.add_annotation(&a)?;
    Ok(Some(annotation_json(&a)))
}

/// Remove annotation `id` (blocking). None: there was none.
pub fn delete(store: &Store, id: &str) -> Result<Option<Value>, StoreError> {
    Ok(store.delete_annotation(id)?.then(|| json!({ "deleted": id })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_checked_before_anything_is_stored() {
        let ok = parse(br#"{"target":"step","id":"tr_1/2","note":" looks wrong ","label":"bug","score":-1.5}"#)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ok.note.as_deref(), Some("looks wrong"));
        assert_eq!(ok.score, Some(-1.5));
        let long_label = format!(
            r#"{{"target":"step","id":"a/1","label":"{}"}}"#,
            "x".repeat(MAX_LABEL + 1)
        );
        let long_note = format!(
            r#"{{"target":"step","id":"a/1","note":"{}"}}"#,
            "é".repeat(MAX_NOTE + 1)
        );
        for bad in [
            r#"{"target":"call","id":"x","note":"n"}"#,
            r#"{"target":"step","id":"","note":"n"}"#,
            r#"{"target":"step","id":"a/1"}"#,
            r#"{"target":"step","id":"a/1","note":"   "}"#,
            r#"{"target":"step","id":"a/1","score":"NaN"}"#,
            r#"{"target":"step","id":"a/1","score":1e999}"#,
            r#"{"target":"step","id":"a/1","label":"a\nb"}"#,
            r#"{"target":"step","id":"a/1","note":"n","html":"<b>"}"#,
            "not json",
            long_label.as_str(),
            long_note.as_str(),
        ] {
            assert!(parse(bad.as_bytes()).is_err(), "{bad}");
        }
        // The longest note and label pass (characters, not bytes).
        let at_limit = format!(
            r#"{{"target":"session","id":"s","note":"{}","label":"{}"}}"#,
            "é".repeat(MAX_NOTE),
            "ü".repeat(MAX_LABEL)
        );
        assert!(parse(at_limit.as_bytes()).is_ok());
        assert!(is_json(Some("application/json; charset=utf-8")));
        assert!(!is_json(Some("text/plain")));
        assert!(!is_json(Some("application/x-www-form-urlencoded")));
        assert!(!is_json(None));
    }
}
