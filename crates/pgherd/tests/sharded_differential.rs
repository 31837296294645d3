//! The differential test of sharding (issue 9): one generated dataset, loaded through a
//! sharded endpoint over two shards and over three, and directly into a single node; generated
//! queries (predicates on and off the key, aggregates, GROUP BY with HAVING, ORDER BY with
//! LIMIT/OFFSET, DISTINCT, reference tables and joins), each run through the endpoint as a
//! simple query and as a prepared statement with its values bound, must answer exactly the
//! rows the single node answers (in order where the order is total), or be refused with
//! `0A000` where the shape has no exact plan. Each case is generated from its own seed: a
//! failure prints it, and `PGHERD_DIFF_SEED=N` runs that case alone.

mod common;

use bytes::BytesMut;
use common::connect_as_superuser;
use common::shard_cluster;
use pgherd_testkit::raw::{errors, Message, RawClient};
use pgherd_testkit::{Pgherd, SUPERUSER, SUPERUSER_PASSWORD};
use pgherd_wire::backend::{self, tag as btag};
use pgherd_wire::frontend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio_postgres::{Client, SimpleQueryMessage};

/// Cases per endpoint; each runs as a simple query and as a prepared statement.
const CASES: u64 = 1_000;
const ACCOUNTS: i32 = 400;
const BRANCHES: i32 = 8;

/// What a case may answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// The single node's rows.
    Rows,
    /// `0A000`: no exact plan over the shards.
    Refused,
    /// Either (a shape whose support depends on what the merge can order, say).
    Either,
}

#[derive(Debug)]
struct Case {
    seed: u64,
    /// With the values written in.
    simple: String,
    /// With `$n` in their place, and the values in text.
    prepared: String,
    params: Vec<String>,
    /// The rows come in an order the statement fixes.
    ordered: bool,
    expect: Expect,
}

/// Builds a statement's text twice: values inline, and as parameters.
struct Text {
    simple: String,
    prepared: String,
    params: Vec<String>,
}

impl Text {
    fn new() -> Text {
        Text {
            simple: String::new(),
            prepared: String::new(),
            params: Vec::new(),
        }
    }

    fn sql(&mut self, text: &str) -> &mut Text {
        self.simple.push_str(text);
        self.prepared.push_str(text);
        self
    }

    /// A text value: quoted inline, as is when bound.
    fn text_value(&mut self, value: &str) -> &mut Text {
        self.params.push(value.to_owned());
        self.simple.push_str(&format!("'{value}'"));
        self.prepared.push_str(&format!("${}", self.params.len()));
        self
    }

    fn value(&mut self, value: impl ToString) -> &mut Text {
        let value = value.to_string();
        self.params.push(value.clone());
        self.simple.push_str(&value);
        self.prepared.push_str(&format!("${}", self.params.len()));
        self
    }
}

fn pick<'a, T>(rng: &mut StdRng, items: &'a [T]) -> &'a T {
    &items[rng.gen_range(0..items.len())]
}

/// A `WHERE` condition off the key (some of them on it as a range).
fn predicate(rng: &mut StdRng, t: &mut Text) {
    match rng.gen_range(0..7) {
        0 => {
            t.sql("abalance > ").value(rng.gen_range(-5_000..5_000));
        }
        1 => {
            let low = rng.gen_range(-5_000..4_000);
            t.sql("abalance BETWEEN ")
                .value(low)
                .sql(" AND ")
                .value(low + rng.gen_range(0..3_000));
        }
        2 => {
            t.sql("bid = ").value(rng.gen_range(0..BRANCHES));
        }
        3 => {
            t.sql("bid IS NULL");
        }
        4 => {
            t.sql("abalance IS NOT NULL AND bid < ")
                .value(rng.gen_range(0..BRANCHES));
        }
        5 => {
            t.sql("aid > ").value(rng.gen_range(0..ACCOUNTS));
        }
        _ => {
            let filler: &&str = pick(rng, FILLERS);
            t.sql("filler = ").text_value(filler);
        }
    }
}

/// Text that orders otherwise by bytes, by letters and by code points (the clusters' collation
/// is C.UTF-8, ordered by the C library).
const FILLERS: &[&str] = &["f0", "F1", "é2", "f 3", "Ω4", "f10", "e9", ""];

const AGGREGATES: &[&str] = &[
    "count(*)",
    "count(abalance)",
    "sum(abalance)",
    "min(abalance)",
    "max(abalance)",
    "avg(abalance)",
    "min(aid)",
    "max(bid)",
    "count(DISTINCT aid)",
];

fn aggregates(rng: &mut StdRng) -> String {
    let count = rng.gen_range(1..=4);
    (0..count)
        .map(|_| *pick(rng, AGGREGATES))
        .collect::<Vec<_>>()
        .join(", ")
}

fn key(rng: &mut StdRng) -> i32 {
    // Now and then a key no row has.
    rng.gen_range(1..=ACCOUNTS + 20)
}

fn generate(seed: u64) -> Case {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = Text::new();
    let mut ordered = false;
    let mut expect = Expect::Rows;
    match rng.gen_range(0..14) {
        // A key: one shard.
        0 => {
            let columns = *pick(&mut rng, &["*", "aid, abalance", "bid, filler"]);
            t.sql(&format!("SELECT {columns} FROM accounts WHERE aid = "))
                .value(key(&mut rng));
            if rng.gen_bool(0.5) {
                t.sql(" AND ");
                predicate(&mut rng, &mut t);
            }
        }
        // Several keys: the shards they live on.
        1 => {
            t.sql("SELECT aid, bid, abalance FROM accounts WHERE aid IN (")
                .value(key(&mut rng))
                .sql(", ")
                .value(key(&mut rng))
                .sql(", ")
                .value(key(&mut rng))
                .sql(")");
            if rng.gen_bool(0.5) {
                t.sql(" ORDER BY aid DESC");
                ordered = true;
            }
        }
        2 => {
            t.sql("SELECT aid, filler FROM accounts WHERE aid = ")
                .value(key(&mut rng))
                .sql(" OR (aid = ")
                .value(key(&mut rng))
                .sql(" AND abalance IS NOT NULL) ORDER BY aid");
            ordered = true;
        }
        // Rows in a total order, a page of them.
        3 | 4 => {
            t.sql("SELECT aid, abalance, bid FROM accounts WHERE ");
            predicate(&mut rng, &mut t);
            let column = *pick(&mut rng, &["abalance", "bid"]);
            let direction = *pick(&mut rng, &["", " DESC", " NULLS FIRST", " DESC NULLS LAST"]);
            let tiebreak = *pick(&mut rng, &["aid", "aid DESC"]);
            t.sql(&format!(" ORDER BY {column}{direction}, {tiebreak}"));
            if rng.gen_bool(0.7) {
                t.sql(&format!(" LIMIT {}", rng.gen_range(0..30)));
                if rng.gen_bool(0.5) {
                    t.sql(&format!(" OFFSET {}", rng.gen_range(0..60)));
                }
            }
            ordered = true;
        }
        // Aggregates over every shard.
        5 => {
            t.sql(&format!("SELECT {} FROM accounts", aggregates(&mut rng)));
            if rng.gen_bool(0.7) {
                t.sql(" WHERE ");
                predicate(&mut rng, &mut t);
            }
        }
        // Groups, some filtered, in the groups' order.
        6 | 7 => {
            t.sql(&format!(
                "SELECT bid, {} FROM accounts",
                aggregates(&mut rng)
            ));
            if rng.gen_bool(0.5) {
                t.sql(" WHERE ");
                predicate(&mut rng, &mut t);
            }
            t.sql(" GROUP BY bid");
            if rng.gen_bool(0.4) {
                let having = match rng.gen_range(0..4) {
                    0 => format!("count(*) > {}", rng.gen_range(0..60)),
                    1 => format!("sum(abalance) < {}", rng.gen_range(-20_000..20_000)),
                    2 => format!("avg(abalance) > {}.5", rng.gen_range(-500..500)),
                    _ => format!(
                        "max(abalance) >= {} OR min(aid) = 1",
                        rng.gen_range(3_000..5_000)
                    ),
                };
                t.sql(&format!(" HAVING {having}"));
            }
            if rng.gen_bool(0.5) {
                t.sql(" ORDER BY 2 DESC, bid");
            } else {
                t.sql(" ORDER BY bid");
                if rng.gen_bool(0.5) {
                    t.sql(" NULLS FIRST");
                }
            }
            if rng.gen_bool(0.3) {
                t.sql(&format!(" LIMIT {}", rng.gen_range(1..6)));
            }
            ordered = true;
        }
        8 => {
            t.sql("SELECT DISTINCT bid FROM accounts WHERE ");
            predicate(&mut rng, &mut t);
            if rng.gen_bool(0.7) {
                t.sql(" ORDER BY bid");
                ordered = true;
            }
        }
        // Rows in no particular order.
        9 => {
            t.sql("SELECT aid, bid FROM accounts WHERE ");
            predicate(&mut rng, &mut t);
        }
        // A table every shard holds, alone or joined to a key's row.
        10 => {
            if rng.gen_bool(0.5) {
                t.sql("SELECT bid, bname FROM branches WHERE bid >= ")
                    .value(rng.gen_range(0..BRANCHES))
                    .sql(" ORDER BY bid");
                ordered = true;
            } else {
                t.sql("SELECT a.aid, b.bname FROM accounts a JOIN branches b ON a.bid = b.bid WHERE a.aid = ")
                    .value(key(&mut rng));
                expect = Expect::Either;
            }
        }
        // Text in the database's collation, a page of it.
        11 => {
            t.sql("SELECT aid, filler FROM accounts WHERE ");
            predicate(&mut rng, &mut t);
            let direction = *pick(&mut rng, &["", " DESC", " NULLS FIRST", " DESC NULLS LAST"]);
            let collate = *pick(&mut rng, &["", "", " COLLATE \"C\""]);
            t.sql(&format!(" ORDER BY filler{collate}{direction}, aid"));
            if rng.gen_bool(0.5) {
                t.sql(&format!(" LIMIT {}", rng.gen_range(0..30)));
            }
            ordered = true;
        }
        // Text grouped, and its least and greatest.
        12 => {
            let sql = *pick(
                &mut rng,
                &[
                    "SELECT filler, count(*), min(aid) FROM accounts GROUP BY filler ORDER BY filler",
                    "SELECT min(filler), max(filler), count(filler) FROM accounts",
                    "SELECT bid, min(filler), max(filler) FROM accounts GROUP BY bid ORDER BY bid",
                    "SELECT DISTINCT filler FROM accounts ORDER BY filler DESC",
                ],
            );
            t.sql(sql);
            ordered = sql.contains("ORDER BY");
        }
        // Shapes with no exact merge.
        _ => {
            let sql = *pick(
                &mut rng,
                &[
                    "SELECT aid, rank() OVER (ORDER BY abalance) FROM accounts",
                    "SELECT string_agg(filler, ',') FROM accounts",
                    "SELECT a.aid FROM accounts a JOIN accounts b ON a.bid = b.bid",
                    "SELECT DISTINCT ON (bid) bid, aid FROM accounts ORDER BY bid, aid",
                    "SELECT filler FROM accounts ORDER BY filler COLLATE \"und-x-icu\"",
                ],
            );
            t.sql(sql);
            expect = Expect::Refused;
        }
    }
    Case {
        seed,
        simple: t.simple.clone(),
        prepared: t.prepared.clone(),
        params: t.params.clone(),
        ordered,
        expect,
    }
}

/// Rows as text (`None`: NULL), or the SQLSTATE of the error.
type Answer = Result<Vec<Vec<Option<String>>>, String>;

async fn simple(client: &Client, sql: &str) -> Answer {
    match client.simple_query(sql).await {
        Ok(messages) => Ok(messages
            .into_iter()
            .filter_map(|m| match m {
                SimpleQueryMessage::Row(row) => Some(
                    (0..row.len())
                        .map(|i| row.get(i).map(str::to_owned))
                        .collect(),
                ),
                _ => None,
            })
            .collect()),
        Err(e) => Err(e
            .code()
            .map_or_else(|| e.to_string(), |c| c.code().to_owned())),
    }
}

/// Parse, Bind (the values in text, their types left to the server, rows in text), Execute
/// and Sync.
fn prepared(raw: &mut RawClient, sql: &str, params: &[String]) -> Answer {
    let mut out = BytesMut::new();
    frontend::encode_parse(&mut out, b"", sql.as_bytes(), &[0, 0]).expect("parse");
    let values: Vec<Option<&str>> = params.iter().map(|p| Some(p.as_str())).collect();
    common::bind_text(&mut out, b"", &values);
    frontend::encode_execute(&mut out, b"", 0).expect("execute");
    frontend::encode_sync(&mut out);
    raw.send(&out);
    let answer: Vec<Message> = raw.recv_until_ready();
    if let Some(error) = errors(&answer).first() {
        return Err(error.code.to_string());
    }
    Ok(answer
        .iter()
        .filter(|m| m.0 == btag::DATA_ROW)
        .map(|m| {
            backend::parse_data_row(&m.1)
                .expect("a data row")
                .into_iter()
                .map(|v| v.map(|v| String::from_utf8_lossy(v).into_owned()))
                .collect()
        })
        .collect())
}

/// The rows compared as the case orders them.
fn comparable(answer: Answer, ordered: bool) -> Answer {
    answer.map(|mut rows| {
        if !ordered {
            rows.sort();
        }
        rows
    })
}

/// Runs `cases` through the endpoint on `port` (both protocols) and directly on `whole`;
/// failures, each with its seed; and how many cases answered rows.
async fn differ(cases: &[Case], port: u16, database: &str, whole: &Client) -> (Vec<String>, usize) {
    let through = connect_as_superuser(port, database).await;
    let database_owned = database.to_owned();
    let mut raw = tokio::task::spawn_blocking(move || {
        RawClient::login(port, SUPERUSER, &database_owned, SUPERUSER_PASSWORD).expect("login")
    })
    .await
    .unwrap();
    let mut failures = Vec::new();
    let mut answered = 0;
    for case in cases {
        let expected = comparable(simple(whole, &case.simple).await, case.ordered);
        let expected = match expected {
            Ok(rows) => rows,
            Err(code) => {
                failures.push(format!(
                    "seed {}: the single node refused it ({code}): {}",
                    case.seed, case.simple
                ));
                continue;
            }
        };
        let by_simple = comparable(simple(&through, &case.simple).await, case.ordered);
        let (sql, params) = (case.prepared.clone(), case.params.clone());
        let (back, by_prepared) = tokio::task::spawn_blocking(move || {
            let answer = prepared(&mut raw, &sql, &params);
            (raw, answer)
        })
        .await
        .unwrap();
        raw = back;
        let by_prepared = comparable(by_prepared, case.ordered);
        for (protocol, got) in [("simple", by_simple), ("prepared", by_prepared)] {
            let fine = match (&got, case.expect) {
                (Ok(rows), Expect::Rows | Expect::Either) => *rows == expected,
                (Err(code), Expect::Refused | Expect::Either) => code == "0A000",
                _ => false,
            };
            if got.is_ok() && protocol == "simple" {
                answered += 1;
            }
            if !fine {
                failures.push(format!(
                    "seed {} ({protocol}, {database}): {}\n  params {:?}\n  expected {:?} {:?}\n  got {:?}\n  replay: PGHERD_DIFF_SEED={} cargo test -p pgherd --test sharded_differential",
                    case.seed, if protocol == "simple" { &case.simple } else { &case.prepared },
                    case.params, case.expect, expected, got, case.seed
                ));
            }
        }
    }
    (failures, answered)
}

/// The dataset, as the statements that load it (through an endpoint or directly).
fn dataset() -> Vec<String> {
    let mut rng = StdRng::seed_from_u64(9);
    let mut statements = vec![
        "CREATE TABLE accounts (aid int PRIMARY KEY, bid int, abalance int, filler text)"
            .to_owned(),
        "CREATE TABLE branches (bid int PRIMARY KEY, bname text NOT NULL)".to_owned(),
    ];
    let branches: Vec<String> = (0..BRANCHES)
        .map(|b| format!("({b}, 'branch {b}')"))
        .collect();
    statements.push(format!(
        "INSERT INTO branches (bid, bname) VALUES {}",
        branches.join(", ")
    ));
    let rows: Vec<String> = (1..=ACCOUNTS)
        .map(|aid| {
            let bid = if rng.gen_bool(0.05) {
                "NULL".to_owned()
            } else {
                rng.gen_range(0..BRANCHES).to_string()
            };
            let balance = if rng.gen_bool(0.05) {
                "NULL".to_owned()
            } else {
                rng.gen_range(-5_000..5_000).to_string()
            };
            let filler = match rng.gen_bool(0.05) {
                true => "NULL".to_owned(),
                false => format!("'{}'", pick(&mut rng, FILLERS)),
            };
            format!("({aid}, {bid}, {balance}, {filler})")
        })
        .collect();
    for chunk in rows.chunks(100) {
        statements.push(format!(
            "INSERT INTO accounts (aid, bid, abalance, filler) VALUES {}",
            chunk.join(", ")
        ));
    }
    statements
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_endpoint_answers_generated_queries_as_one_node() {
    let replay: Option<u64> = std::env::var("PGHERD_DIFF_SEED")
        .ok()
        .and_then(|s| s.parse().ok());
    let cases: Vec<Case> = match replay {
        Some(seed) => vec![generate(seed)],
        None => (0..CASES).map(generate).collect(),
    };
    let clusters = [shard_cluster(), shard_cluster(), shard_cluster()];
    let load = dataset();
    clusters[0].sql("CREATE DATABASE whole");
    let whole = connect_as_superuser(clusters[0].node("pg1").port, "whole").await;
    for sql in &load {
        whole
            .batch_execute(sql)
            .await
            .expect("load the single node");
    }
    let mut failures = Vec::new();
    for shards in [2usize, 3] {
        let database = format!("shards{shards}");
        for cluster in &clusters[..shards] {
            cluster.sql(&format!("CREATE DATABASE {database}"));
        }
        let config = common::sharded_config(&clusters[..shards], &[("accounts", "aid")]);
        let pgherd = Pgherd::start(common::BIN, &clusters[0], &config);
        let loader = connect_as_superuser(pgherd.port, &database).await;
        for sql in &load {
            loader
                .batch_execute(sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
        }
        let (failed, answered) = differ(&cases, pgherd.port, &database, &whole).await;
        println!(
            "{shards} shards: {} cases, {answered} answered rows, {} failed",
            cases.len(),
            failed.len()
        );
        // Most shapes run: the test is not passed by refusing.
        assert!(
            replay.is_some() || answered * 10 >= cases.len() * 8,
            "only {answered} of {} cases answered rows; the first failures:\n{}",
            cases.len(),
            failed
                .iter()
                .take(5)
                .cloned()
                .collect::<Vec<_>>()
                .join("\n")
        );
        failures.extend(failed);
        drop(pgherd);
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
