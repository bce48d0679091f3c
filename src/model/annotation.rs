//! A person's annotation on a session, a trajectory or a step: a note, a label and a score, made in the viewer and
//! kept beside the captured records (never inside them: a capture is what the agent sent, an annotation is what
//! someone said about it afterwards).

use serde::{Deserialize, Serialize};

/// What an annotation is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnnotationTarget {
    Session,
    Trajectory,
    Step,
}

impl AnnotationTarget {
    pub fn as_str(self) -> &'static str {
        match self {
            AnnotationTarget::Session => "session",
            AnnotationTarget::Trajectory => "trajectory",
            AnnotationTarget::Step => "step",
        }
    }

    pub fn parse(s: &str) -> Option<AnnotationTarget> {
        match s {
            "session" => Some(AnnotationTarget::Session),
            "trajectory" => Some(AnnotationTarget::Trajectory),
            "step" => Some(AnnotationTarget::Step),
            _ => None,
        }
    }
}

/// One annotation. At least one of note, label and score is set (the viewer refuses an empty one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Annotation {
    pub id: String,
    pub target: AnnotationTarget,
    /// The session key, trajectory id or step id annotated.
    pub target_id: String,
    /// The session the target belonged to when it was annotated: what the sessions list filters by.
    pub session_id: String,
    /// The trajectory of a trajectory or step annotation (None for a session's).
    pub trajectory_id: Option<String>,
    pub note: Option<String>,
    pub label: Option<String>,
    /// Finite (the viewer refuses NaN and infinities).
    pub score: Option<f64>,
    /// Unix micros.
    pub created_us: i64,
}

impl Annotation {
    /// As the viewer's API and the exports show it.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "target": self.target.as_str(),
            "target_id": self.target_id,
            "session_id": self.session_id,
            "trajectory_id": self.trajectory_id,
            "note": self.note,
            "label": self.label,
            "score": self.score,
            "created_at": super::trace::rfc3339(self.created_us),
        })
    }
}
