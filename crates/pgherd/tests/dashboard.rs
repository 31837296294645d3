//! The web dashboard end to end in headless Chromium (Debian's package, driven by Playwright
//! from tests/dashboard; `.ci/run` installs both): the page loads without console errors and
//! shows every node with its role, shows a stopped replica as down within a few seconds, and
//! a switchover started from the page (token, confirmation) completes; the result cache's
//! table shows the database its traffic asked the cache for, serving, with hits. Screenshots of the
//! healthy and the degraded cluster are kept in target/test-artifacts.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::*;

const TOKEN: &str = "dashboard-test-token-42";

fn phase(api: &str, name: &str, vars: &[(&str, &str)]) -> String {
    dashboard_phase(api, TOKEN, name, vars)
}

#[test]
fn dashboard_shows_the_cluster_and_switches_over() {
    let (env, api) = env_with_api(2, TOKEN);
    // Traffic for the charts, the pools and the result cache while the page watches.
    env.direct(
        "CREATE TABLE dash (k int); INSERT INTO dash VALUES (1); GRANT SELECT ON dash TO app",
    );
    // Removed when the test ends.
    let script_file = tempfile::Builder::new()
        .prefix("pgherd-dash-")
        .suffix(".sql")
        .tempfile()
        .expect("pgbench script");
    std::fs::write(
        script_file.path(),
        "SELECT 1;\n/* pgherd:cache */ SELECT count(*) FROM dash;\n",
    )
    .expect("pgbench script");
    let script = script_file.path().to_owned();
    let url = env.app_url();
    let traffic = std::thread::spawn(move || {
        pgbench(
            &url,
            &[
                "-n",
                "-c",
                "4",
                "-T",
                "12",
                "-f",
                script.to_str().unwrap_or_default(),
            ],
        )
    });
    wait_until(&env, "pgherd elected pg1", Duration::from_secs(10), || {
        env.pgherd
            .log()
            .contains("pg1 accepts writes: elected primary")
    });
    phase(
        &api,
        "healthy",
        &[(
            "EXPECT",
            r#"{"pg1": "primary", "pg2": "replica", "pg3": "replica"}"#,
        )],
    );
    let shots = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/test-artifacts");
    assert!(shots.join("dashboard-healthy.png").is_file());

    env.cluster
        .node("pg3")
        .stop(pgherd_cluster::StopMode::Immediate)
        .expect("stop pg3");
    phase(&api, "degraded", &[("STOPPED", "pg3")]);
    assert!(shots.join("dashboard-degraded.png").is_file());
    if let Err(e) = traffic.join().expect("traffic thread") {
        panic!("traffic through pgherd failed while the page watched: {e}");
    }

    let said = phase(&api, "switchover", &[("TARGET", "pg2")]);
    assert!(said.contains("switchover: ok"), "{said}");
    let log = env.pgherd.log();
    assert!(log.contains("switched"), "{log}");
}
