//! The planner's rules as data: (SQL or messages, session, cluster view) → target or node, and
//! why. Decisions come from the real lexer and classifier over a small catalog.

use bytes::BytesMut;
use pgherd_wire::frontend::{
    encode_bind, encode_describe, encode_execute, encode_flush, encode_parse, encode_query,
    encode_sync, Target as Describe,
};

use super::balance::{Balance, Candidate, Lsn};
use super::catalog::{Persistence, RelationRow, Snapshot, SnapshotBuilder};
use super::parse::DEFAULT_MAX_PARSE_BYTES;
use super::plan::*;
use super::*;

fn catalog() -> Snapshot {
    let mut b = SnapshotBuilder::default();
    b.function("count", false, false);
    b.function("nextval", true, false);
    for (oid, name, persistence) in [
        (16384, "t", Persistence::Permanent),
        (16385, "staging", Persistence::Unlogged),
    ] {
        b.relation(RelationRow {
            oid,
            name: name.into(),
            persistence,
            runs_user_code: false,
            draws_sequences: false,
            cache_safe: persistence == Persistence::Permanent,
        });
    }
    b.build()
}

/// Statement texts through the real lexer and classifier; `prepared` holds statements the
/// client prepared before the request.
struct Classifier {
    catalog: Snapshot,
    prepared: Vec<(&'static [u8], &'static str)>,
}

impl Classifier {
    fn new() -> Self {
        Classifier {
            catalog: catalog(),
            prepared: Vec::new(),
        }
    }
}

impl Statements for Classifier {
    type Error = HintError;

    fn route(&self, sql: &[u8]) -> Result<Routed, HintError> {
        let mut key = Vec::new();
        let lexed = lex(sql, true, &mut key);
        let hint = lexed.hint.clone()?;
        let text = String::from_utf8_lossy(sql);
        let decision = classify(&text, &lexed, &self.catalog, DEFAULT_MAX_PARSE_BYTES);
        Ok(Routed {
            decision: std::sync::Arc::new(decision),
            hint,
            shard: lexed.shard.clone()?,
            cache: lexed.cache,
            may_change_session: lexed.may_change_session,
        })
    }

    fn prepared(&self, name: &[u8]) -> Option<Routed> {
        let (_, sql) = self.prepared.iter().find(|(n, _)| *n == name)?;
        self.route(sql.as_bytes()).ok()
    }
}

fn session() -> SessionRouting {
    SessionRouting {
        splitting: true,
        configured: Route::Auto,
        override_route: None,
        consistency: Consistency::ReadYourWrites,
        default_read_only: false,
    }
}

#[test]
fn a_statement_and_the_session_give_the_target() {
    use Target::*;
    let auto = session();
    let to_primary = SessionRouting {
        override_route: Some(Route::Primary),
        ..auto
    };
    let replica_route = SessionRouting {
        configured: Route::Replica,
        ..auto
    };
    let primary_consistency = SessionRouting {
        consistency: Consistency::Primary,
        ..auto
    };
    let read_only_default = SessionRouting {
        default_read_only: true,
        ..auto
    };
    let session_mode = SessionRouting {
        splitting: false,
        ..auto
    };
    let session_mode_replica = SessionRouting {
        splitting: false,
        configured: Route::Replica,
        ..auto
    };
    let cases: &[(&str, SessionRouting, Target, &str)] = &[
        (
            "SELECT count(*) FROM t",
            auto,
            Replica,
            "a read goes to a replica",
        ),
        ("INSERT INTO t VALUES (1)", auto, Primary, "a write"),
        ("SELECT nextval('s')", auto, Primary, "a volatile function"),
        (
            "SELECT count(*) FROM staging",
            auto,
            Primary,
            "unlogged: only the primary has it",
        ),
        (
            "CREATE TEMP TABLE tt (x int)",
            auto,
            Primary,
            "a pin runs on the primary",
        ),
        ("BEGIN", auto, Primary, "a transaction that may write"),
        (
            "BEGIN",
            read_only_default,
            Replica,
            "default_transaction_read_only makes it a read",
        ),
        (
            "BEGIN READ WRITE",
            read_only_default,
            Primary,
            "READ WRITE is not read-only",
        ),
        (
            "COMMIT",
            auto,
            Any,
            "transaction control runs where the transaction is",
        ),
        (
            "SELECT count(*) FROM t",
            to_primary,
            Primary,
            "SET pgherd.route = primary",
        ),
        (
            "SELECT count(*) FROM t",
            primary_consistency,
            Primary,
            "consistency = primary",
        ),
        (
            "/* pgherd:replica */ SELECT count(*) FROM t",
            primary_consistency,
            Replica,
            "a hint overrides the consistency",
        ),
        (
            "/* pgherd:primary */ SELECT count(*) FROM t",
            auto,
            Primary,
            "a primary hint",
        ),
        (
            "SHOW work_mem",
            replica_route,
            Any,
            "route = replica leaves SHOW anywhere",
        ),
        (
            "INSERT INTO t VALUES (1)",
            replica_route,
            Replica,
            "route = replica: as asked",
        ),
        (
            "SELECT count(*) FROM t",
            session_mode,
            Primary,
            "session mode, route auto",
        ),
        (
            "SELECT count(*) FROM t",
            session_mode_replica,
            Replica,
            "session mode, route replica",
        ),
    ];
    let classifier = Classifier::new();
    for (sql, session, expected, why) in cases {
        let routed = classifier.route(sql.as_bytes()).expect("valid hint");
        assert_eq!(
            session.target(Some(&routed)),
            *expected,
            "{sql} ({why}); decision: {}",
            routed.decision.reason
        );
    }
    assert_eq!(
        auto.target(None),
        Any,
        "no statement: wherever the session is"
    );
    assert_eq!(replica_route.target(None), Replica);
    assert_eq!(session_mode.target(None), Primary);
}

enum Msg {
    Query(&'static str),
    Parse(&'static str, &'static str),
    Bind(&'static str),
    DescribeStatement(&'static str),
    Execute,
    Flush,
    Sync,
}

fn encode(messages: &[Msg]) -> BytesMut {
    let mut buf = BytesMut::new();
    for m in messages {
        match m {
            Msg::Query(sql) => encode_query(&mut buf, sql.as_bytes()),
            Msg::Parse(name, sql) => {
                encode_parse(&mut buf, name.as_bytes(), sql.as_bytes(), &[0, 0])
            }
            Msg::Bind(name) => encode_bind(&mut buf, b"", name.as_bytes(), &[0, 0, 0, 0, 0, 0]),
            Msg::DescribeStatement(name) => {
                encode_describe(&mut buf, Describe::Statement, name.as_bytes())
            }
            Msg::Execute => encode_execute(&mut buf, b"", 0),
            Msg::Flush => {
                encode_flush(&mut buf);
                Ok(())
            }
            Msg::Sync => {
                encode_sync(&mut buf);
                Ok(())
            }
        }
        .expect("encode");
    }
    buf
}

fn never_streams(_: &pgherd_wire::frame::Header, _: usize) -> bool {
    false
}

const FRAMING: Framing = Framing {
    max_message_bytes: 1 << 20,
    streams: never_streams,
};

#[test]
fn a_request_runs_where_its_strictest_statement_must() {
    use Msg::*;
    use Target::*;
    let read = "SELECT count(*) FROM t WHERE 1 = $1";
    let write = "INSERT INTO t VALUES ($1)";
    let cases: &[(&[Msg], Target, &str)] = &[
        (&[Query("SELECT count(*) FROM t")], Replica, "a simple read"),
        (
            &[
                Query("SELECT count(*) FROM t"),
                Query("INSERT INTO t VALUES (1)"),
            ],
            Replica,
            "a simple query is a request of its own",
        ),
        (
            &[Parse("", read), Bind(""), Execute, Sync],
            Replica,
            "an extended read",
        ),
        (
            &[
                Parse("", read),
                Bind(""),
                Execute,
                Parse("", write),
                Bind(""),
                Execute,
                Sync,
            ],
            Primary,
            "a write later in the batch moves the whole batch",
        ),
        (
            &[
                Parse("r", read),
                Parse("w", write),
                Bind("r"),
                Execute,
                Sync,
            ],
            Primary,
            "a statement the batch prepares counts, bound or not",
        ),
        (
            &[
                Parse("", write),
                Bind(""),
                Execute,
                Sync,
                Parse("", read),
                Bind(""),
                Execute,
                Sync,
            ],
            Primary,
            "the first batch only",
        ),
        (
            &[
                Parse("", read),
                Bind(""),
                Execute,
                Parse("", read),
                Bind(""),
                Execute,
                Sync,
            ],
            Replica,
            "the unnamed statement, parsed again in the batch",
        ),
        (
            &[Bind(""), Execute, Sync],
            Replica,
            "binds the unnamed statement of an earlier request",
        ),
        (
            &[Bind("known_read"), Execute, Sync],
            Replica,
            "binds a statement prepared earlier",
        ),
        (
            &[Bind("known_write"), Execute, Sync],
            Primary,
            "binds an earlier write",
        ),
        (
            &[Bind("nosuch"), Execute, Sync],
            Primary,
            "binds an unknown statement",
        ),
        (
            &[Parse("", read), Bind(""), Execute],
            Primary,
            "the batch goes on beyond what arrived",
        ),
        (
            &[Parse("", read), Bind(""), Execute, Flush],
            Replica,
            "a Flush asks for answers first",
        ),
        (
            &[DescribeStatement("known_read"), Sync],
            Any,
            "no statement runs",
        ),
        (&[Sync], Any, "a bare Sync"),
    ];
    let mut classifier = Classifier::new();
    classifier.prepared = vec![
        (b"known_read", "SELECT count(*) FROM t"),
        (b"known_write", "DELETE FROM t"),
        (b"", "SELECT count(*) FROM t"),
    ];
    for (messages, expected, why) in cases {
        let input = encode(messages);
        let planned = route_request(&input, FRAMING, &session(), &classifier).expect("plan");
        let front = planned.front.map(|f| f.decision.reason.clone());
        assert_eq!(
            planned.target, *expected,
            "{why}; first statement: {front:?}"
        );
    }
    // Cut inside a message: only the primary can run whatever follows.
    let whole = encode(&[Parse("", read), Bind(""), Execute, Sync]);
    let cut = &whole[..whole.len() - 3];
    let planned = route_request(cut, FRAMING, &session(), &classifier).expect("plan");
    assert_eq!(planned.target, Target::Primary);
}

#[test]
fn the_first_statement_is_kept_and_its_bad_hint_is_the_clients_error() {
    let classifier = Classifier::new();
    let input = encode(&[Msg::Query("SELECT count(*) FROM t")]);
    let planned = route_request(&input, FRAMING, &session(), &classifier).expect("plan");
    let front = planned
        .front
        .expect("the first statement's decision is kept");
    assert_eq!(front.decision.target, Target::Replica);
    assert!(!planned.replica_asked);

    let bad = encode(&[Msg::Query("/* pgherd:sideways */ SELECT 1")]);
    assert!(route_request(&bad, FRAMING, &session(), &classifier).is_err());

    let asked = encode(&[Msg::Query("/* pgherd:replica */ SELECT count(*) FROM t")]);
    let planned = route_request(&asked, FRAMING, &session(), &classifier).expect("plan");
    assert!(
        planned.replica_asked,
        "a replica hint is the client's own choice"
    );
}

/// A cluster as a table: nodes by name with their standing and what the chooser sees.
struct View {
    nodes: Vec<(&'static str, NodeStanding, Candidate)>,
    primary: Option<&'static str>,
    writes_paused: bool,
    writes_refused: Option<&'static str>,
    ticket: u64,
}

impl ClusterView for View {
    type Node = &'static str;

    fn standing(&self, node: &&'static str) -> NodeStanding {
        self.nodes
            .iter()
            .find(|(n, ..)| n == node)
            .map(|(_, s, _)| *s)
            .expect("a node of the view")
    }

    fn primary(&self) -> Option<&'static str> {
        self.primary.filter(|_| !self.writes_paused)
    }

    fn writes_paused(&self) -> bool {
        self.writes_paused
    }

    fn writes_refused(&self) -> Option<String> {
        self.writes_refused.map(str::to_owned)
    }

    fn read_candidates(&self, reads: &ReadNeeds) -> (ReadSet<&&'static str>, ReadSet<Candidate>) {
        self.nodes
            .iter()
            .filter(|(_, s, _)| {
                s.role == Role::Replica || (reads.primary_reads && s.role == Role::Primary)
            })
            .map(|(n, _, c)| (n, *c))
            .unzip()
    }

    fn read_ticket(&self, _: Balance) -> u64 {
        self.ticket
    }
}

fn standing(role: Role) -> NodeStanding {
    NodeStanding {
        role,
        up: true,
        excluded: false,
        in_read_set: true,
    }
}

fn replica_at(replay_lsn: Lsn) -> Candidate {
    Candidate {
        weight: 1,
        outstanding: 0,
        replay_lsn: Some(replay_lsn),
        lag_bytes: 0,
        lag_ms: 0,
        healthy: true,
    }
}

fn three_nodes() -> View {
    View {
        nodes: vec![
            (
                "pg1",
                standing(Role::Primary),
                Candidate {
                    replay_lsn: None,
                    ..replica_at(0)
                },
            ),
            ("pg2", standing(Role::Replica), replica_at(100)),
            ("pg3", standing(Role::Replica), replica_at(200)),
        ],
        primary: Some("pg1"),
        writes_paused: false,
        writes_refused: None,
        ticket: 0,
    }
}

fn reads() -> ReadNeeds {
    ReadNeeds {
        balance: Balance::RoundRobin,
        primary_reads: false,
        max_lag_bytes: 0,
        max_lag_ms: 0,
        min_lsn: Some(0),
        write_unconfirmed: false,
        may_wait: true,
    }
}

#[test]
fn a_target_and_the_cluster_give_the_node() {
    let plan = |view: &View, target, last: Option<&'static str>, reads: &ReadNeeds| {
        choose_node(view, target, last.as_ref(), || *reads).map(|p| (p.node, p.wait_for_lsn))
    };
    let view = three_nodes();
    // Reads round robin over the replicas by ticket.
    assert_eq!(
        plan(&view, Target::Replica, None, &reads()),
        Ok(("pg2", None))
    );
    let next = View {
        ticket: 1,
        ..three_nodes()
    };
    assert_eq!(
        plan(&next, Target::Replica, None, &reads()),
        Ok(("pg3", None))
    );
    // Read-your-writes: only pg3 has replayed 150.
    let after_write = ReadNeeds {
        min_lsn: Some(150),
        ..reads()
    };
    assert_eq!(
        plan(&view, Target::Replica, None, &after_write),
        Ok(("pg3", None))
    );
    // Nobody has replayed 300: wait for the one furthest ahead, or take the primary.
    let far = ReadNeeds {
        min_lsn: Some(300),
        ..reads()
    };
    assert_eq!(
        plan(&view, Target::Replica, None, &far),
        Ok(("pg3", Some(300)))
    );
    let no_wait = ReadNeeds {
        may_wait: false,
        ..far
    };
    assert_eq!(
        plan(&view, Target::Replica, None, &no_wait),
        Ok(("pg1", None))
    );
    // Eventual consistency ignores the session's writes.
    let eventual = ReadNeeds {
        min_lsn: None,
        write_unconfirmed: true,
        ..far
    };
    assert_eq!(
        plan(&view, Target::Replica, None, &eventual),
        Ok(("pg2", None))
    );
    // A write whose end is not known yet: the primary.
    let unconfirmed = ReadNeeds {
        write_unconfirmed: true,
        ..reads()
    };
    assert_eq!(
        plan(&view, Target::Replica, None, &unconfirmed),
        Ok(("pg1", None))
    );
    // Writes go to the primary.
    assert_eq!(
        plan(&view, Target::Primary, Some("pg2"), &reads()),
        Ok(("pg1", None))
    );
    // Transaction control stays where the session was, while that node is usable.
    assert_eq!(
        plan(&view, Target::Any, Some("pg3"), &reads()),
        Ok(("pg3", None))
    );
    let mut out = three_nodes();
    out.nodes[2].1.in_read_set = false;
    out.nodes[2].2.healthy = false;
    assert_eq!(
        plan(&out, Target::Any, Some("pg3"), &reads()),
        Ok(("pg1", None))
    );
    assert_eq!(
        plan(&out, Target::Replica, None, &reads()),
        Ok(("pg2", None))
    );
    // A fenced node gets nothing, even as the session's last node.
    let mut fenced = three_nodes();
    fenced.nodes[1].1.excluded = true;
    assert_eq!(
        plan(&fenced, Target::Any, Some("pg2"), &reads()),
        Ok(("pg1", None))
    );
}

#[test]
fn no_node_is_an_answer_with_a_reason() {
    let refused = View {
        writes_refused: Some("no synchronous standby streams"),
        ..three_nodes()
    };
    assert_eq!(
        choose_node(&refused, Target::Primary, None, reads),
        Err(NoNode::WritesRefused(
            "no synchronous standby streams".into()
        ))
    );
    // Reads still run while writes are refused.
    assert!(choose_node(&refused, Target::Replica, None, reads).is_ok());
    // A switchover pauses writes: no primary, not even the session's last one.
    let paused = View {
        writes_paused: true,
        ..three_nodes()
    };
    assert_eq!(
        choose_node(&paused, Target::Primary, Some(&"pg1"), reads),
        Err(NoNode::Unavailable)
    );
    assert_eq!(
        choose_node(&paused, Target::Any, Some(&"pg1"), reads),
        Err(NoNode::Unavailable)
    );
    // The old primary, now a replica, is not taken for writes.
    let mut demoted = three_nodes();
    demoted.nodes[0].1.role = Role::Replica;
    demoted.primary = Some("pg2");
    demoted.nodes[1].1.role = Role::Primary;
    let plan = choose_node(&demoted, Target::Primary, Some(&"pg1"), reads).expect("a node");
    assert_eq!((plan.node, plan.why), ("pg2", "the primary"));
    let none = View {
        primary: None,
        ..three_nodes()
    };
    assert_eq!(
        choose_node(&none, Target::Primary, None, reads),
        Err(NoNode::Unavailable)
    );
}
