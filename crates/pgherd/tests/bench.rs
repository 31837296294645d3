//! `pgherd bench pooler --count-instructions` end to end: a real primary, pgherd under
//! valgrind's callgrind (`.ci/run` installs valgrind), pgbench through it, the dump read back.
//! Tiny on purpose (one cell, scale 1, a few dozen transactions): the figures themselves belong
//! in docs/benchmarks.md, this checks that the command produces them.

use std::process::Command;

#[test]
fn instructions_per_transaction_are_counted_under_callgrind() {
    let out = tempfile::Builder::new()
        .prefix("pgherd-bench-test-")
        .tempdir()
        .expect("a directory for the results");
    let run = Command::new(env!("CARGO_BIN_EXE_pgherd"))
        .args([
            "bench",
            "pooler",
            "--count-instructions",
            "40",
            "--rounds",
            "2",
            "--targets",
            "direct,pgherd",
            "--workloads",
            "select-simple",
            "--clients",
            "1",
            "--replicas",
            "0",
            "--scale",
            "1",
            "--idle-clients",
            "0",
            "--out",
        ])
        .arg(out.path())
        .output()
        .expect("run pgherd bench");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(run.status.success(), "the bench failed:\n{said}");
    assert!(
        said.contains("direct: not counted"),
        "direct PostgreSQL has no pooler process to count:\n{said}"
    );
    let csv_path = std::fs::read_dir(out.path())
        .expect("results")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "csv"))
        .expect("a CSV of the counts");
    let csv = std::fs::read_to_string(&csv_path).expect("read the CSV");
    let rows: Vec<Vec<&str>> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect())
        .collect();
    assert_eq!(rows.len(), 2, "one row per round:\n{csv}");
    for row in &rows {
        assert_eq!(&row[1..4], ["select-simple", "1", "pgherd"], "{csv}");
        let transactions: u64 = row[4].parse().expect("transactions");
        let per_txn: f64 = row[6].parse().expect("instructions per transaction");
        assert_eq!(transactions, 40, "{csv}");
        // Relaying a query and its answer takes thousands of instructions (about 12,000 in a
        // release build); a count of the wrong dump, or of nothing, would not.
        assert!(
            (1_000.0..10_000_000.0).contains(&per_txn),
            "instructions per transaction {per_txn}:\n{csv}"
        );
    }
    let report = std::fs::read_to_string(csv_path.with_extension("md")).expect("the report");
    assert!(
        report.contains("| select-simple | 1 |"),
        "the report has the cell:\n{report}"
    );
}
