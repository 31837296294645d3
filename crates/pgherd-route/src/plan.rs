//! The plan for one request: where it runs, from what its statements are ([`Routed`]), what the
//! session has asked for ([`SessionRouting`]) and the cluster as the data path sees it at that
//! moment ([`ClusterView`]). The proxy carries plans out; every rule of where a request goes
//! lives here, so the tests below drive the same functions the data path calls.
//!
//! Two steps, because the second is taken again when a node fails under a request:
//! [`route_request`] reads the request's messages up to its Sync and gives its [`Target`];
//! [`choose_node`] turns a target into a node (and, for read-your-writes, the WAL position the
//! chosen replica must reach first).

use std::sync::Arc;

use pgherd_wire::frame::{read_header, Header, HEADER_BYTES};
use pgherd_wire::frontend::{self, tag};

use crate::balance::{choose, Balance, Candidate, Lsn, NoChoice, Requirement};
use crate::{Consistency, Decision, Route, Target, TxEffect};

/// A node's role as its last health check saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Unknown,
    Primary,
    Replica,
}

impl Role {
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::Unknown => "unknown",
            Role::Primary => "primary",
            Role::Replica => "replica",
        }
    }

    /// For keeping a role in an atomic.
    pub fn to_u8(self) -> u8 {
        self as u8
    }

    pub fn from_u8(v: u8) -> Role {
        match v {
            1 => Role::Primary,
            2 => Role::Replica,
            _ => Role::Unknown,
        }
    }
}

/// A routing decision for one statement text, with the hint its comments carry.
#[derive(Debug, Clone)]
pub struct Routed {
    pub decision: Arc<Decision>,
    pub hint: Option<Route>,
    /// A `pgherd:shard=N` hint (a sharded endpoint's; others refuse it).
    pub shard: Option<u32>,
    /// A `pgherd:cache` (`Some(true)`) or `pgherd:nocache` (`Some(false)`) hint.
    pub cache: Option<bool>,
    /// The text may change session settings ([`crate::Lexed::may_change_session`]): only
    /// then does the proxy keep it to follow what it set.
    pub may_change_session: bool,
}

impl Routed {
    /// A request pgherd cannot inspect, which therefore runs on the primary. Whatever it
    /// is, it may change the session.
    pub fn primary(reason: &str) -> Routed {
        Routed {
            decision: Arc::new(Decision::unread(reason)),
            hint: None,
            shard: None,
            cache: None,
            may_change_session: true,
        }
    }
}

/// What the session has asked for, as far as where its requests run.
#[derive(Debug, Clone, Copy)]
pub struct SessionRouting {
    /// Statements are classified and may go to replicas. False in session mode, where the
    /// client keeps one server.
    pub splitting: bool,
    /// The database's or user's configured route.
    pub configured: Route,
    /// `SET pgherd.route`.
    pub override_route: Option<Route>,
    pub consistency: Consistency,
    /// `default_transaction_read_only` as the session has it.
    pub default_read_only: bool,
}

impl SessionRouting {
    pub fn route(&self) -> Route {
        self.override_route.unwrap_or(self.configured)
    }

    pub fn read_your_writes(&self) -> bool {
        self.splitting && self.consistency == Consistency::ReadYourWrites
    }

    /// Where a request runs, from its decision (`None`: it has no statement).
    pub fn target(&self, routed: Option<&Routed>) -> Target {
        let route = self.route();
        if !self.splitting {
            return match self.configured {
                Route::Replica => Target::Replica,
                _ => Target::Primary,
            };
        }
        let Some(routed) = routed else {
            return match route {
                Route::Replica => Target::Replica,
                _ => Target::Any,
            };
        };
        let automatic = routed.hint.is_none() && route == Route::Auto;
        let decision = &routed.decision;
        let target = match routed.hint.unwrap_or(route) {
            Route::Primary => Target::Primary,
            Route::Replica if decision.target == Target::Any => Target::Any,
            Route::Replica => Target::Replica,
            Route::Auto if decision.pin.is_some() => Target::Primary,
            Route::Auto => decision.target,
        };
        if automatic && target == Target::Replica && self.consistency == Consistency::Primary {
            return Target::Primary;
        }
        if automatic
            && self.default_read_only
            && decision.pin.is_none()
            && decision.tx == (TxEffect::Begin { read_only: None })
        {
            // default_transaction_read_only makes this BEGIN a read-only transaction.
            return Target::Replica;
        }
        target
    }
}

/// The stricter of two targets: the primary over a replica over anywhere.
pub fn strictest(a: Option<Target>, b: Target) -> Target {
    let rank = |t: Target| match t {
        Target::Any => 0,
        Target::Replica => 1,
        Target::Primary => 2,
    };
    match a {
        Some(a) if rank(a) >= rank(b) => a,
        _ => b,
    }
}

/// Where the data path finds the decisions for statements.
pub trait Statements {
    type Error;
    /// The decision for a statement text; an invalid routing hint is the client's error.
    fn route(&self, sql: &[u8]) -> Result<Routed, Self::Error>;
    /// The decision for a statement the client prepared before this request (`""`: the
    /// unnamed one); `None` if there is none.
    fn prepared(&self, name: &[u8]) -> Option<Routed>;
}

/// How the client's messages are framed: the size limit, and whether a message not whole
/// yet is one the session streams (it will never be buffered whole).
#[derive(Clone, Copy)]
pub struct Framing {
    pub max_message_bytes: usize,
    pub streams: fn(&Header, usize) -> bool,
}

/// Where a request runs, and what the session keeps of the decision.
#[derive(Debug, Clone)]
pub struct RequestRoute {
    pub target: Target,
    /// The decision made from the first statement's own text (a Query or Parse), so it is
    /// not made again when the statement is relayed.
    pub front: Option<Routed>,
    /// The request runs on a replica because the client asked (a route or a hint): what the
    /// standby refuses is the client's error to see.
    pub replica_asked: bool,
}

/// Where the request at the front of `input` must run: the strictest target of every
/// statement it runs, up to its Sync (the statements of one extended-protocol batch are one
/// implicit transaction, so they run on one node). A batch whose end is not buffered yet runs
/// on the primary, unless it asks for answers first (Flush). An invalid hint in its first
/// statement is the client's error.
pub fn route_request<S: Statements>(
    input: &[u8],
    framing: Framing,
    session: &SessionRouting,
    statements: &S,
) -> Result<RequestRoute, S::Error> {
    let mut plan = RequestRoute {
        target: Target::Primary,
        front: None,
        replica_asked: session.route() == Route::Replica,
    };
    if !session.splitting {
        plan.target = session.target(None);
        return Ok(plan);
    }
    let mut target: Option<Target> = None;
    // Statements the batch itself prepares (named or not), for its Binds.
    let mut defined: smallvec::SmallVec<[(&[u8], Routed); 2]> = smallvec::SmallVec::new();
    let mut at = 0;
    plan.target = loop {
        let rest = &input[at..];
        let h = match read_header(rest, framing.max_message_bytes) {
            Ok(Some(h)) if rest.len() >= h.total_len() => h,
            // The batch goes on beyond what arrived (or its first message is too large to
            // read whole): only the primary can run whatever follows.
            Ok(Some(h)) if target.is_some() || (framing.streams)(&h, rest.len()) => {
                break Target::Primary
            }
            // Statements arrived, the Sync that ends their batch not yet.
            Ok(None) if target.is_some() => break Target::Primary,
            _ => break session.target(None),
        };
        let body = &rest[HEADER_BYTES..h.total_len()];
        let first = target.is_none();
        let routed = match h.tag {
            tag::QUERY if !first => break strictest(target, Target::Primary),
            tag::QUERY | tag::PARSE => {
                let parsed = if h.tag == tag::QUERY {
                    frontend::Query::parse(body).map(|q| (&b""[..], q.sql))
                } else {
                    frontend::Parse::parse(body).map(|p| (p.name, p.query))
                };
                // Malformed: relaying it reports the protocol error.
                let Ok((name, sql)) = parsed else {
                    break strictest(target, Target::Primary);
                };
                let routed = match statements.route(sql) {
                    Ok(routed) => routed,
                    Err(e) if first => return Err(e),
                    Err(_) => Routed::primary("its routing hint is invalid"),
                };
                if first {
                    plan.front = Some(routed.clone());
                }
                // The unnamed statement too: a Bind of "" later in the batch binds this one.
                // A simple query is a request of its own: nothing after it binds it.
                if h.tag == tag::PARSE {
                    defined.push((name, routed.clone()));
                }
                Some(routed)
            }
            tag::BIND => frontend::Bind::parse(body).ok().map(|b| {
                defined
                    .iter()
                    .rev()
                    .find(|(name, _)| *name == b.statement)
                    .map(|(_, r)| r.clone())
                    .or_else(|| statements.prepared(b.statement))
                    .unwrap_or_else(|| Routed::primary("binds an unknown statement"))
            }),
            tag::FUNCTION_CALL => Some(Routed::primary("a function call by OID may write")),
            tag::SYNC | tag::FLUSH | tag::TERMINATE => {
                break target.unwrap_or_else(|| session.target(None))
            }
            _ => None,
        };
        if let Some(routed) = routed {
            plan.replica_asked |= routed.hint == Some(Route::Replica);
            target = Some(strictest(target, session.target(Some(&routed))));
        }
        if h.tag == tag::QUERY {
            // A simple query is a request of its own.
            break target.unwrap_or(Target::Primary);
        }
        at += h.total_len();
    };
    Ok(plan)
}

/// What the planner reads of one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeStanding {
    pub role: Role,
    pub up: bool,
    /// Fenced or detached: no traffic either way.
    pub excluded: bool,
    pub in_read_set: bool,
}

impl NodeStanding {
    pub fn usable_as(&self, role: Role) -> bool {
        self.up && self.role == role && !self.excluded
    }
}

/// The cluster as the data path sees it at the moment of a plan.
pub trait ClusterView {
    /// How the view names a node (the proxy: its shared node state).
    type Node: Clone;
    fn standing(&self, node: &Self::Node) -> NodeStanding;
    /// The node that takes writes, unless writes wait (a switchover, a synchronous set not
    /// set yet).
    fn primary(&self) -> Option<Self::Node>;
    fn writes_paused(&self) -> bool;
    /// Why writes are refused outright (strict durability without a synchronous standby).
    fn writes_refused(&self) -> Option<String>;
    /// The nodes a read may go to, in config order, with what the chooser needs to know for
    /// `reads` (the primary among them with `primary_reads`). By reference: only the node
    /// chosen is cloned.
    fn read_candidates(&self, reads: &ReadNeeds) -> (ReadSet<&Self::Node>, ReadSet<Candidate>);
    /// A turn for round robin and weighted (shared by every session), a random number for
    /// random: the view supplies it, so a test can fix it.
    fn read_ticket(&self, balance: Balance) -> u64;
}

/// The readers of a cluster, held inline up to four: every read outside a transaction block
/// lists them, and a heap allocation per read costs more than the choice itself.
pub type ReadSet<T> = smallvec::SmallVec<[T; 4]>;

/// What a read asks of the node that serves it.
#[derive(Debug, Clone, Copy)]
pub struct ReadNeeds {
    pub balance: Balance,
    pub primary_reads: bool,
    pub max_lag_bytes: u64,
    pub max_lag_ms: u64,
    /// Read-your-writes: the session's last committed write, which the replica must have
    /// replayed; `None` under eventual consistency.
    pub min_lsn: Option<Lsn>,
    /// The session wrote and where that write ends is not known yet: no replica will do.
    pub write_unconfirmed: bool,
    /// A replica that has not replayed `min_lsn` yet may be waited for.
    pub may_wait: bool,
}

/// The node a request runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePlan<N> {
    pub node: N,
    /// The replica must replay this far before the request goes to it.
    pub wait_for_lsn: Option<Lsn>,
    pub why: &'static str,
}

/// Why no node can take a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoNode {
    WritesRefused(String),
    /// No node is usable for the target (the primary is down or being replaced).
    Unavailable,
}

/// The node for a request with `target`: where the session was last for transaction control
/// and settings, a replica for reads (under the balance policy, the lag limits and
/// read-your-writes), else the primary (the one the session used last while it still is).
/// `reads` is asked only for a read, so a write's plan costs the caller nothing to describe.
pub fn choose_node<V: ClusterView>(
    view: &V,
    target: Target,
    last: Option<&V::Node>,
    reads: impl FnOnce() -> ReadNeeds,
) -> Result<NodePlan<V::Node>, NoNode> {
    let plan = |node: &V::Node, why| NodePlan {
        node: node.clone(),
        wait_for_lsn: None,
        why,
    };
    match target {
        Target::Any => {
            if let Some(node) = last {
                let s = view.standing(node);
                let usable = match s.role {
                    Role::Primary => !view.writes_paused(),
                    _ => s.in_read_set,
                };
                if s.up && !s.excluded && usable {
                    return Ok(plan(node, "runs where the session was last"));
                }
            }
        }
        Target::Replica => {
            if let Some(read) = choose_reader(view, &reads()) {
                return Ok(read);
            }
        }
        Target::Primary => {
            if let Some(why) = view.writes_refused() {
                return Err(NoNode::WritesRefused(why));
            }
        }
    }
    // The primary rarely changes: reuse the last one while it still is the primary.
    if let Some(node) = last {
        if view.standing(node).usable_as(Role::Primary) && !view.writes_paused() {
            return Ok(plan(node, "the primary, as last time"));
        }
    }
    view.primary()
        .map(|node| plan(&node, "the primary"))
        .ok_or(NoNode::Unavailable)
}

/// A node for a read; `None` means the primary.
fn choose_reader<V: ClusterView>(view: &V, reads: &ReadNeeds) -> Option<NodePlan<V::Node>> {
    if reads.min_lsn.is_some() && reads.write_unconfirmed {
        // Where the session's last write ends is not known yet.
        return None;
    }
    let (nodes, candidates) = view.read_candidates(reads);
    if candidates.is_empty() {
        return None;
    }
    let req = Requirement {
        max_lag_bytes: reads.max_lag_bytes,
        max_lag_ms: reads.max_lag_ms,
        min_lsn: reads.min_lsn.unwrap_or(0),
    };
    match choose(
        reads.balance,
        &candidates,
        &req,
        view.read_ticket(reads.balance),
    ) {
        Ok(i) => Some(NodePlan {
            node: nodes[i].clone(),
            wait_for_lsn: None,
            why: "a read, on a node within the lag limits",
        }),
        Err(NoChoice::NotCaughtUp(i)) if reads.may_wait => Some(NodePlan {
            node: nodes[i].clone(),
            wait_for_lsn: Some(req.min_lsn),
            why: "a read, once the replica has replayed the session's last write",
        }),
        Err(_) => None,
    }
}
