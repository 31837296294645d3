//! What a transaction block over the shards did that a shard it reaches later must do too, in
//! order: the settings it made (`SET`, `SET LOCAL`, `SET TRANSACTION`) and the savepoints it
//! set. A shard joins a block with its `BEGIN` and then this log, so a later `ROLLBACK TO
//! SAVEPOINT` means the same on every shard: what each did since that savepoint is undone,
//! and nothing before it.
//!
//! Savepoints follow PostgreSQL: a name may be set again (the latest one counts); `RELEASE`
//! forgets the savepoint and every one set after it, keeping their work and settings;
//! `ROLLBACK TO` keeps the savepoint and forgets those after it, with the settings made since.
//! Pure: the executor runs the statements and keeps the [`Mark`]s' meaning.

/// What the executor restores at a `ROLLBACK TO` of a savepoint: its own state as it was
/// when the savepoint was set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Mark {
    /// The block was READ ONLY.
    pub read_only: bool,
    /// How many of the session's setting changes the block had made.
    pub settings_made: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Setting(String),
    Savepoint {
        name: String,
        sql: String,
        mark: Mark,
    },
}

/// A savepoint the block does not have (SQLSTATE `3B001`, as PostgreSQL's).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("savepoint \"{0}\" does not exist")]
pub struct NoSuchSavepoint(pub String);

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TxLog {
    steps: Vec<Step>,
}

impl TxLog {
    /// A setting the block made, as its statement's text.
    pub fn setting(&mut self, sql: &str) {
        self.steps.push(Step::Setting(sql.to_owned()));
    }

    /// A savepoint set by `sql`, with the executor's state at that moment.
    pub fn savepoint(&mut self, name: &str, sql: &str, mark: Mark) {
        self.steps.push(Step::Savepoint {
            name: name.to_owned(),
            sql: sql.to_owned(),
            mark,
        });
    }

    /// `RELEASE name`: the savepoint and those set after it are forgotten; the settings made
    /// since stay.
    pub fn release(&mut self, name: &str) -> Result<(), NoSuchSavepoint> {
        let at = self.find(name)?;
        let mut i = 0;
        self.steps.retain(|step| {
            let keep = i < at || matches!(step, Step::Setting(_));
            i += 1;
            keep
        });
        Ok(())
    }

    /// `ROLLBACK TO name`: what came after the savepoint is forgotten (it stays set); the
    /// executor's state as it was then.
    pub fn rollback_to(&mut self, name: &str) -> Result<Mark, NoSuchSavepoint> {
        let at = self.find(name)?;
        self.steps.truncate(at + 1);
        match &self.steps[at] {
            Step::Savepoint { mark, .. } => Ok(*mark),
            Step::Setting(_) => Err(NoSuchSavepoint(name.to_owned())),
        }
    }

    /// What a shard joining the block runs after its `BEGIN`, in order.
    pub fn replay(&self) -> impl Iterator<Item = &str> {
        self.steps.iter().map(|step| match step {
            Step::Setting(sql) | Step::Savepoint { sql, .. } => sql.as_str(),
        })
    }

    /// The block made a setting that is still in force: a connection that ran it carries
    /// it past the block (a `SET` commits with the block).
    pub fn has_settings(&self) -> bool {
        self.steps
            .iter()
            .any(|step| matches!(step, Step::Setting(_)))
    }

    /// The latest savepoint of that name.
    fn find(&self, name: &str) -> Result<usize, NoSuchSavepoint> {
        self.steps
            .iter()
            .rposition(|step| matches!(step, Step::Savepoint { name: n, .. } if n == name))
            .ok_or_else(|| NoSuchSavepoint(name.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(settings_made: usize) -> Mark {
        Mark {
            read_only: false,
            settings_made,
        }
    }

    fn replayed(log: &TxLog) -> Vec<&str> {
        log.replay().collect()
    }

    #[test]
    fn a_joining_shard_replays_settings_and_savepoints_in_order() {
        let mut log = TxLog::default();
        log.setting("SET work_mem = '8MB'");
        log.savepoint("a", "SAVEPOINT a", mark(1));
        log.setting("SET LOCAL lock_timeout = 100");
        assert_eq!(
            replayed(&log),
            [
                "SET work_mem = '8MB'",
                "SAVEPOINT a",
                "SET LOCAL lock_timeout = 100"
            ]
        );
        assert!(log.has_settings());
    }

    #[test]
    fn rollback_to_forgets_what_came_after_and_keeps_the_savepoint() {
        let mut log = TxLog::default();
        log.savepoint("a", "SAVEPOINT a", mark(0));
        log.setting("SET work_mem = '8MB'");
        log.savepoint("b", "SAVEPOINT b", mark(1));
        assert_eq!(log.rollback_to("a"), Ok(mark(0)));
        assert_eq!(replayed(&log), ["SAVEPOINT a"]);
        assert!(!log.has_settings());
        // It stays: a second ROLLBACK TO finds it again; b is gone.
        assert_eq!(log.rollback_to("a"), Ok(mark(0)));
        assert_eq!(log.rollback_to("b"), Err(NoSuchSavepoint("b".into())));
    }

    #[test]
    fn release_forgets_the_savepoint_and_later_ones_but_keeps_settings() {
        let mut log = TxLog::default();
        log.savepoint("a", "SAVEPOINT a", mark(0));
        log.savepoint("b", "SAVEPOINT b", mark(0));
        log.setting("SET work_mem = '8MB'");
        log.savepoint("c", "SAVEPOINT c", mark(1));
        log.release("b").unwrap();
        assert_eq!(replayed(&log), ["SAVEPOINT a", "SET work_mem = '8MB'"]);
        assert_eq!(log.release("c"), Err(NoSuchSavepoint("c".into())));
        assert_eq!(log.rollback_to("a"), Ok(mark(0)));
    }

    #[test]
    fn a_name_set_again_refers_to_the_latest() {
        let mut log = TxLog::default();
        log.savepoint("a", "SAVEPOINT a", mark(0));
        log.setting("SET work_mem = '8MB'");
        log.savepoint("a", "SAVEPOINT a", mark(1));
        assert_eq!(log.rollback_to("a"), Ok(mark(1)));
        log.release("a").unwrap();
        // The first one is still there.
        assert_eq!(replayed(&log), ["SAVEPOINT a", "SET work_mem = '8MB'"]);
        assert_eq!(log.rollback_to("a"), Ok(mark(0)));
        assert_eq!(replayed(&log), ["SAVEPOINT a"]);
    }

    #[test]
    fn an_unknown_savepoint_changes_nothing() {
        let mut log = TxLog::default();
        log.setting("SET work_mem = '8MB'");
        assert_eq!(log.release("x"), Err(NoSuchSavepoint("x".into())));
        assert_eq!(log.rollback_to("x"), Err(NoSuchSavepoint("x".into())));
        assert_eq!(replayed(&log), ["SET work_mem = '8MB'"]);
    }
}
