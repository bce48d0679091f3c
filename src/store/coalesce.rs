//! Which records of a batch the writer writes: each step and each trajectory once per transaction.
//!
//! Within one batch the same step is often sent several times (an agent step is sent again when its tool results
//! arrive with the next request) and the same trajectory more (its summary is sent again on every call and when
//! it closes). Only the rows as the last version leaves them are visible once the transaction commits, so the
//! writer writes each step and trajectory once, at its first occurrence (where a row written one record at a
//! time would have got its `seq`), with the columns the versions would have left: a step's insert-only columns
//! from its first version and its body and trace id from its last; a trajectory's start from its first version,
//! the rest from its last, and its `system_prompts`/`tool_definitions` from the last version that carried them
//! (an update without them keeps the old ones). The export log still gets one entry per version, at that
//! version's place in the batch, exactly as when each record is written on its own (`write.rs` decides the
//! entries; the test `a_coalesced_batch_leaves_the_rows_and_export_log_of_one_record_at_a_time` compares).

use rustc_hash::FxHashMap;

use super::Record;

/// What the writer does for one record of the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// A trace: written as it is.
    Trace,
    /// A step's first version in the batch: written with the body and trace id of version `last` (an index
    /// into the batch; this record's own index when it is the only one).
    StepFirst { last: usize },
    /// A later version of a step: its row is written; only its export-log entry remains.
    StepAgain,
    /// A trajectory's first version in the batch: written with the columns of version `last`, and the system
    /// prompts and tool definitions of the last versions that carry them (`None`: no version does).
    TrajectoryFirst {
        last: usize,
        prompts: Option<usize>,
        tools: Option<usize>,
    },
    /// A later version of a trajectory: only its export-log entry remains.
    TrajectoryAgain,
}

/// One slot per record of `batch`, in order.
pub fn plan(batch: &[Record]) -> Vec<Slot> {
    let mut slots = Vec::with_capacity(batch.len());
    // Id → index of its first version's slot.
    let mut steps: FxHashMap<&str, usize> = FxHashMap::default();
    let mut trajectories: FxHashMap<&str, usize> = FxHashMap::default();
    for (i, record) in batch.iter().enumerate() {
        let slot = match record {
            Record::Trace(_) => Slot::Trace,
            Record::Step(s) => match steps.get(s.step_id.as_str()) {
                Some(&first) => {
                    slots[first] = Slot::StepFirst { last: i };
                    Slot::StepAgain
                }
                None => {
                    steps.insert(&s.step_id, i);
                    Slot::StepFirst { last: i }
                }
            },
            Record::Trajectory(t) => {
                let carries = |yes: bool| yes.then_some(i);
                let prompts = carries(!t.system_prompts.is_empty());
                let tools = carries(!t.tool_definitions.is_empty());
                match trajectories.get(t.trajectory_id.as_str()) {
                    Some(&first) => {
                        if let Slot::TrajectoryFirst {
                            last,
                            prompts: p,
                            tools: d,
                        } = &mut slots[first]
                        {
                            *last = i;
                            *p = prompts.or(*p);
                            *d = tools.or(*d);
                        }
                        Slot::TrajectoryAgain
                    }
                    None => {
                        trajectories.insert(&t.trajectory_id, i);
                        Slot::TrajectoryFirst {
                            last: i,
                            prompts,
                            tools,
                        }
                    }
                }
            }
        };
        slots.push(slot);
    }
    slots
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::step::{Step, TrajectorySummary};

    fn step(id: &str) -> Record {
        use crate::derive::testkit::{Harness, call, text_out, user};
        let mut h = Harness::new(crate::model::exchange::Api::OpenAiChat);
        let mut s: Step = h.send(call("sys", vec![user("hi")], text_out("hello"))).agent().clone();
        s.step_id = id.into();
        Record::Step(Box::new(s))
    }

    fn trajectory(id: &str, prompts: bool, tools: bool) -> Record {
        let mut t = TrajectorySummary {
            trajectory_id: id.into(),
            ..TrajectorySummary::default()
        };
        if prompts {
            t.system_prompts.insert("h".into(), "p".into());
        }
        if tools {
            t.tool_definitions.push(serde_json::json!({"name": "x"}));
        }
        Record::Trajectory(Box::new(t))
    }

    #[test]
    fn each_step_and_trajectory_is_written_once_at_its_first_version() {
        let batch = [
            step("a"),
            trajectory("t", true, false),
            step("b"),
            step("a"),
            trajectory("t", false, true),
            trajectory("u", false, false),
            step("a"),
            trajectory("t", false, false),
        ];
        assert_eq!(
            plan(&batch),
            [
                Slot::StepFirst { last: 6 },
                Slot::TrajectoryFirst {
                    last: 7,
                    prompts: Some(1),
                    tools: Some(4)
                },
                Slot::StepFirst { last: 2 },
                Slot::StepAgain,
                Slot::TrajectoryAgain,
                Slot::TrajectoryFirst {
                    last: 5,
                    prompts: None,
                    tools: None
                },
                Slot::StepAgain,
                Slot::TrajectoryAgain,
            ]
        );
    }
}
