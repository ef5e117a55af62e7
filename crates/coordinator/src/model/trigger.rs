//! Who or what asked for a checkpoint epoch or a restart, as an epoch's and a restart's records
//! keep it.
use serde::{Deserialize, Serialize};

/// Who or what asked for a checkpoint epoch or a restart. Records store it as the words they
/// always did: "" for a user, then "periodic", "deadline", "drain", "recovery".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Trigger {
    /// A user: `ckptctl checkpoint`, `ckptctl restart` (and `run --resume`,
    /// `run --checkpoint-on`).
    #[default]
    #[serde(rename = "")]
    User,
    /// The job's policy (`--every`).
    Periodic,
    /// The job's deadline: its final checkpoint.
    Deadline,
    /// `ckptctl drain`.
    Drain,
    /// ckptd itself, restarting a failed job (`--on-failure restart`); never an epoch's.
    Recovery,
}

impl Trigger {
    /// Name shown to users and in logs: "user", "periodic", "deadline", "drain", "recovery".
    pub fn name(self) -> &'static str {
        match self {
            Trigger::User => "user",
            Trigger::Periodic => "periodic",
            Trigger::Deadline => "deadline",
            Trigger::Drain => "drain",
            Trigger::Recovery => "recovery",
        }
    }
}

impl std::fmt::Display for Trigger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_keep_the_words_they_had() {
        for (t, stored) in [
            (Trigger::User, ""),
            (Trigger::Periodic, "periodic"),
            (Trigger::Deadline, "deadline"),
            (Trigger::Drain, "drain"),
            (Trigger::Recovery, "recovery"),
        ] {
            let json = format!("\"{stored}\"");
            assert_eq!(serde_json::to_string(&t).unwrap(), json);
            assert_eq!(serde_json::from_str::<Trigger>(&json).unwrap(), t);
        }
    }
}
