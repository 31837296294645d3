//! What the replication-set tests share: `pgherd set` run against a test environment's
//! config, its output, and the checks of a refusal.

use std::process::{Command, Output};

use pgherd_testkit::TestCluster;

use super::{Env, APP, BIN};

/// `pgherd set ARGS --database app` against the environment's config.
pub fn set(env: &Env, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("set")
        .args(args)
        .args(["--database", APP, "--config"])
        .arg(&env.pgherd.config_path)
        .output()
        .expect("run pgherd set")
}

pub fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A refused subscribe made nothing: no subscription on the subscriber, no slot on the origin.
pub fn no_subscription_on(env: &Env, subscriber: &TestCluster) {
    assert_eq!(
        subscriber
            .sql_on("pg1", APP, "SELECT count(*) FROM pg_subscription")
            .trim(),
        "0"
    );
    assert_eq!(
        env.direct("SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'logical'")
            .trim(),
        "0"
    );
}

pub fn refused(out: &Output, says: &str) {
    let said = text(out);
    assert!(!out.status.success(), "refused: {said}");
    assert!(said.contains(says), "says {says:?}: {said}");
}
