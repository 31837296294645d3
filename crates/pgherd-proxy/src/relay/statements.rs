//! Named prepared statements in transaction and statement mode.
//!
//! Drivers reuse statement names (`S_1`, `_pg3_0`, `__asyncpg_stmt_1__`), so a client's name
//! cannot be used on a shared server connection: two clients would collide, or one would run
//! the other's statement. pgherd therefore names every server-side statement after a hash of
//! its text and parameter types (`pgherd_<hex>`): identical statements from different clients
//! share one server-side statement, different ones can never meet. Each client keeps its own
//! name → statement map; each server connection remembers which statements it holds, bounded,
//! and least recently used ones are closed first.

use std::collections::HashMap;
use std::sync::Arc;

use crate::routing::Routed;
use pgherd_route::skip_blanks;

use sha2::{Digest, Sha256};

/// First 128 bits of SHA-256 over a statement's text and parameter types, and the
/// `search_path` it was prepared under when the client set one. A collision would need a
/// SHA-256 collision, so the hash alone identifies a statement.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct StatementHash(pub [u8; 16]);

impl StatementHash {
    /// `search_path`: the statement that set the client's, if it set one. PostgreSQL plans a
    /// prepared statement again under the path it was prepared with, so two clients whose
    /// paths differ (a schema per tenant) must not share one: the same text names other
    /// tables, and the shared plan would fail ("cached plan must not change result type")
    /// or read the other's.
    pub fn of(query: &[u8], param_types: &[u8], search_path: Option<&str>) -> Self {
        let mut h = Sha256::new();
        h.update((query.len() as u64).to_be_bytes());
        h.update(query);
        h.update(param_types);
        if let Some(path) = search_path {
            h.update(b"\0search_path\0");
            h.update(path.as_bytes());
        }
        let digest = h.finalize();
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest[..16]);
        StatementHash(out)
    }

    /// The statement's name on servers: `pgherd_` and 32 hex digits, within NAMEDATALEN.
    pub fn server_name(&self) -> Vec<u8> {
        let mut name = Vec::with_capacity(39);
        name.extend_from_slice(b"pgherd_");
        for b in self.0 {
            name.extend_from_slice(format!("{b:02x}").as_bytes());
        }
        name
    }
}

/// A statement as the client defined it.
#[derive(Debug)]
pub struct StatementDef {
    pub hash: StatementHash,
    pub server_name: Vec<u8>,
    pub query: Vec<u8>,
    /// The Parse message's parameter-type section, as sent.
    pub param_types: Vec<u8>,
    /// [`pgherd_route::may_change_session`] of `query`, found once: every Bind of an unnamed
    /// portal asks it.
    pub may_change_session: bool,
    /// The text names the result cache's hint (`super::cached::mentions_cache_hint`), found
    /// once: the cache asks it of every request that binds the statement.
    pub mentions_cache_hint: bool,
    /// Where it runs, decided at first use and again once the router learned something new
    /// (its catalog was read again, a standby refused a statement): the router's generation
    /// with the decision.
    pub routed: parking_lot::Mutex<Option<(u64, Routed)>>,
}

/// The hash covers the text and parameter types, so it alone decides equality.
impl PartialEq for StatementDef {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash
    }
}

impl Eq for StatementDef {}

impl StatementDef {
    /// `search_path` as for [`StatementHash::of`].
    pub fn new(query: &[u8], param_types: &[u8], search_path: Option<&str>) -> Arc<Self> {
        let hash = StatementHash::of(query, param_types, search_path);
        Arc::new(StatementDef {
            hash,
            server_name: hash.server_name(),
            query: query.to_vec(),
            param_types: param_types.to_vec(),
            may_change_session: pgherd_route::may_change_session(query),
            mentions_cache_hint: super::cached::mentions_cache_hint(query),
            routed: parking_lot::Mutex::new(None),
        })
    }
}

/// What an SQL statement does with a prepared statement named in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SqlUse {
    /// `DEALLOCATE [PREPARE] name`
    Deallocate,
    /// `EXECUTE name [(...)]`
    Execute,
}

/// A query text that starts with `DEALLOCATE [PREPARE] name` or `EXECUTE name`: what it does,
/// the name as PostgreSQL reads it (folded to lower case unless quoted), and where the name
/// is in the text, so a client's protocol-level statement can be put in its server name's
/// place. `DEALLOCATE ALL` is not a name.
pub fn sql_statement_reference(sql: &[u8]) -> Option<(SqlUse, Vec<u8>, std::ops::Range<usize>)> {
    let mut at = skip_blanks(sql, 0);
    // Every simple query passes here: most start with neither keyword, which one byte tells;
    // the others are compared in place, nothing allocated.
    if !matches!(sql.get(at), Some(b'd' | b'D' | b'e' | b'E')) {
        return None;
    }
    let word = |at: usize| {
        let end = at
            + sql[at..]
                .iter()
                .take_while(|b| b.is_ascii_alphabetic())
                .count();
        (&sql[at..end], end)
    };
    let (first, end) = word(at);
    let kind = if first.eq_ignore_ascii_case(b"deallocate") {
        SqlUse::Deallocate
    } else if first.eq_ignore_ascii_case(b"execute") {
        SqlUse::Execute
    } else {
        return None;
    };
    at = skip_blanks(sql, end);
    if kind == SqlUse::Deallocate {
        let (next, end) = word(at);
        if next.eq_ignore_ascii_case(b"prepare") {
            at = skip_blanks(sql, end);
        } else if next.eq_ignore_ascii_case(b"all")
            && !sql.get(end).is_some_and(|b| is_name_byte(*b))
        {
            return None;
        }
    }
    let (name, end) = match sql.get(at)? {
        b'"' => {
            let mut name = Vec::new();
            let mut i = at + 1;
            loop {
                match sql.get(i)? {
                    b'"' if sql.get(i + 1) == Some(&b'"') => {
                        name.push(b'"');
                        i += 2;
                    }
                    b'"' => break (name, i + 1),
                    b => {
                        name.push(*b);
                        i += 1;
                    }
                }
            }
        }
        b if b.is_ascii_alphabetic() || *b == b'_' || *b >= 0x80 => {
            let end = at + sql[at..].iter().take_while(|b| is_name_byte(**b)).count();
            (sql[at..end].to_ascii_lowercase(), end)
        }
        _ => return None,
    };
    Some((kind, name, at..end))
}

fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80
}

/// Why a client's statement operation is refused, in PostgreSQL's words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StatementError {
    AlreadyExists(String),
    DoesNotExist(String),
    TooMany(usize),
}

/// One client's named statements. Looked up on every Bind and when a request is planned:
/// foldhash, seeded per process, rather than SipHash (about 290 instructions a lookup of a
/// three-byte name, 160 with foldhash); the map is one client's and bounded
/// (`MAX_PER_CLIENT`). A Bind's statement is looked up three times (to route the request,
/// to ask the result cache, to send it), so the last one found is kept by name beside the
/// map; every change to the map forgets it.
#[derive(Debug, Default)]
pub struct ClientStatements {
    named: HashMap<Vec<u8>, Arc<StatementDef>, foldhash::fast::RandomState>,
    /// A lock no other thread takes (the session's own), for `find` through `&self`.
    last_found: parking_lot::Mutex<Option<LastFound>>,
}

/// A name and its statement; names longer than the inline room are not kept (a lookup of
/// one then costs what it did).
type LastFound = (
    smallvec::SmallVec<[u8; LAST_FOUND_NAME_BYTES]>,
    Arc<StatementDef>,
);
const LAST_FOUND_NAME_BYTES: usize = 64;

impl ClientStatements {
    /// Upper bound per client, so one client cannot grow pgherd without limit.
    pub const MAX_PER_CLIENT: usize = 10_000;

    pub fn define(&mut self, name: &[u8], def: Arc<StatementDef>) -> Result<(), StatementError> {
        if self.named.contains_key(name) {
            return Err(StatementError::AlreadyExists(
                String::from_utf8_lossy(name).into_owned(),
            ));
        }
        if self.named.len() >= Self::MAX_PER_CLIENT {
            return Err(StatementError::TooMany(Self::MAX_PER_CLIENT));
        }
        self.forget_last_found();
        self.named.insert(name.to_vec(), def);
        Ok(())
    }

    pub fn get(&self, name: &[u8]) -> Result<Arc<StatementDef>, StatementError> {
        self.find(name)
            .ok_or_else(|| StatementError::DoesNotExist(String::from_utf8_lossy(name).into_owned()))
    }

    /// [`Self::get`] for a caller that has its own answer to a missing statement.
    pub fn find(&self, name: &[u8]) -> Option<Arc<StatementDef>> {
        let mut last = self.last_found.lock();
        if let Some((last_name, def)) = last.as_ref() {
            if last_name.as_slice() == name {
                return Some(def.clone());
            }
        }
        let def = self.named.get(name)?.clone();
        if name.len() <= LAST_FOUND_NAME_BYTES {
            *last = Some((smallvec::SmallVec::from_slice(name), def.clone()));
        }
        Some(def)
    }

    fn forget_last_found(&mut self) {
        *self.last_found.get_mut() = None;
    }

    pub fn close(&mut self, name: &[u8]) {
        self.forget_last_found();
        self.named.remove(name);
    }

    pub fn clear(&mut self) {
        self.forget_last_found();
        self.named.clear();
    }

    pub fn len(&self) -> usize {
        self.named.len()
    }

    /// Every statement, by the client's name.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &Arc<StatementDef>)> {
        self.named.iter().map(|(name, def)| (name.as_slice(), def))
    }

    pub fn is_empty(&self) -> bool {
        self.named.is_empty()
    }
}

/// Whether a server connection holds a statement, and whether it can still be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holding {
    /// Prepared since the last schema change pgherd knows of: use it.
    Fresh,
    /// Prepared before a schema change (a type it names may be gone): close it and prepare
    /// it again, as a client's own Parse would have done.
    Stale,
    Missing,
}

/// One statement a server connection holds.
#[derive(Debug, Clone, Copy)]
struct Held {
    last_used: u64,
    /// The schema generation it was prepared at (see [`Holding::Stale`]).
    generation: u64,
}

/// What one server connection holds, least recently used first out.
#[derive(Debug)]
pub struct ServerStatements {
    /// Keyed by a digest: foldhash (no attacker chooses these keys).
    last_used: HashMap<StatementHash, Held, foldhash::fast::RandomState>,
    tick: u64,
    /// Statements used at or after this tick belong to the batch being relayed and must not be
    /// closed under it.
    batch_start: u64,
    capacity: usize,
}

impl ServerStatements {
    pub fn new(capacity: usize) -> Self {
        ServerStatements {
            last_used: HashMap::default(),
            tick: 0,
            batch_start: 0,
            capacity: capacity.max(1),
        }
    }

    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
    }

    /// Marks the start of a client's batch of messages.
    pub fn begin_batch(&mut self) {
        self.tick += 1;
        self.batch_start = self.tick;
    }

    /// Whether the server holds the statement usable at schema `generation`; a fresh one
    /// counts as a use.
    pub fn touch(&mut self, hash: &StatementHash, generation: u64) -> Holding {
        match self.last_used.get_mut(hash) {
            Some(held) if held.generation >= generation => {
                held.last_used = self.tick;
                Holding::Fresh
            }
            Some(_) => Holding::Stale,
            None => Holding::Missing,
        }
    }

    /// Records that a Parse for `hash` is being sent at schema `generation`. Returns a
    /// statement to close first when the cache is full (at most one, and never one used in
    /// the current batch).
    pub fn insert(&mut self, hash: StatementHash, generation: u64) -> Option<StatementHash> {
        let victim = if self.last_used.len() >= self.capacity && !self.last_used.contains_key(&hash)
        {
            self.last_used
                .iter()
                .filter(|(_, held)| held.last_used < self.batch_start)
                .min_by_key(|(_, held)| held.last_used)
                .map(|(h, _)| *h)
        } else {
            None
        };
        if let Some(v) = victim {
            self.last_used.remove(&v);
        }
        self.last_used.insert(
            hash,
            Held {
                last_used: self.tick,
                generation,
            },
        );
        victim
    }

    pub fn forget(&mut self, hash: &StatementHash) {
        self.last_used.remove(hash);
    }

    /// What it holds, for a server connection moving to a new pgherd process: each
    /// statement's hash, and whether it is usable at schema `generation`.
    pub fn carried(&self, generation: u64) -> Vec<([u8; 16], bool)> {
        self.last_used
            .iter()
            .map(|(hash, held)| (hash.0, held.generation >= generation))
            .collect()
    }

    /// Takes up what [`Self::carried`] gave, in a process now at schema `generation`: a
    /// statement that was not usable is held at generation 0, older than any (the counter
    /// starts at 1), so it is closed before its next use.
    pub fn adopt(&mut self, carried: &[([u8; 16], bool)], generation: u64) {
        for (hash, usable) in carried {
            let generation = if *usable { generation } else { 0 };
            self.last_used.insert(
                StatementHash(*hash),
                Held {
                    last_used: self.tick,
                    generation,
                },
            );
        }
    }

    /// After DISCARD ALL or DEALLOCATE ALL the server holds nothing.
    pub fn clear(&mut self) {
        self.last_used.clear();
    }

    pub fn len(&self) -> usize {
        self.last_used.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last_used.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The statement kept from the last lookup never outlives a change of the map: a name
    /// closed is gone, one defined again is the new statement, a long name is found too.
    #[test]
    fn the_last_statement_found_follows_every_change() {
        let first = StatementDef::new(b"select 1", &[0, 0], None);
        let second = StatementDef::new(b"select 2", &[0, 0], None);
        let mut statements = ClientStatements::default();
        statements.define(b"S_1", first.clone()).unwrap();
        assert_eq!(statements.find(b"S_1"), Some(first.clone()));
        assert_eq!(statements.find(b"S_1"), Some(first.clone()), "kept");
        assert_eq!(statements.find(b"S_2"), None);
        statements.close(b"S_1");
        assert_eq!(statements.find(b"S_1"), None, "closed");
        statements.define(b"S_1", second.clone()).unwrap();
        assert_eq!(
            statements.find(b"S_1"),
            Some(second.clone()),
            "defined again"
        );
        statements.clear();
        assert_eq!(statements.find(b"S_1"), None, "cleared");
        let long = [b'n'; LAST_FOUND_NAME_BYTES + 1];
        statements.define(&long, first.clone()).unwrap();
        statements.define(b"S_1", second.clone()).unwrap();
        assert_eq!(statements.find(b"S_1"), Some(second.clone()));
        assert_eq!(statements.find(&long), Some(first.clone()));
        assert_eq!(
            statements.find(b"S_1"),
            Some(second),
            "a long name is not kept"
        );
        assert_eq!(statements.find(&long[..LAST_FOUND_NAME_BYTES]), None);
    }

    #[test]
    fn names_depend_on_text_and_types_only() {
        let a = StatementDef::new(b"select $1", &[0, 1, 0, 0, 0, 23], None);
        let b = StatementDef::new(b"select $1", &[0, 1, 0, 0, 0, 23], None);
        let c = StatementDef::new(b"select $1", &[0, 0], None);
        let tenant = Some("SET search_path = tenant_a");
        let d = StatementDef::new(b"select $1", &[0, 1, 0, 0, 0, 23], tenant);
        let e = StatementDef::new(b"select $1", &[0, 1, 0, 0, 0, 23], tenant);
        assert_ne!(a.server_name, d.server_name, "another search_path");
        assert_eq!(d.server_name, e.server_name, "the same one");
        assert_eq!(a.server_name, b.server_name);
        assert_ne!(a.server_name, c.server_name);
        assert_eq!(a.server_name.len(), 39);
        assert!(a.server_name.starts_with(b"pgherd_"));
    }

    #[test]
    fn sql_references_to_statements() {
        fn r(sql: &str) -> Option<(SqlUse, String, &str)> {
            sql_statement_reference(sql.as_bytes())
                .map(|(kind, name, range)| (kind, String::from_utf8(name).unwrap(), &sql[range]))
        }
        assert_eq!(
            r("DEALLOCATE _pg3_0"),
            Some((SqlUse::Deallocate, "_pg3_0".into(), "_pg3_0"))
        );
        assert_eq!(
            r("  /* c */ deallocate prepare \"S_1\";"),
            Some((SqlUse::Deallocate, "S_1".into(), "\"S_1\""))
        );
        assert_eq!(r("DEALLOCATE ALL"), None);
        assert_eq!(
            r("DEALLOCATE allx"),
            Some((SqlUse::Deallocate, "allx".into(), "allx"))
        );
        assert_eq!(
            r("EXECUTE Foo(1, 'x')"),
            Some((SqlUse::Execute, "foo".into(), "Foo"))
        );
        assert_eq!(
            r("-- hi\nexecute \"a\"\"b\""),
            Some((SqlUse::Execute, "a\"b".into(), "\"a\"\"b\""))
        );
        assert_eq!(
            r("/* a /* b */ */ EXECUTE\x0bfoo"),
            Some((SqlUse::Execute, "foo".into(), "foo"))
        );
        assert_eq!(
            r("-- hi\rDEALLOCATE foo"),
            Some((SqlUse::Deallocate, "foo".into(), "foo"))
        );
        assert_eq!(r("SELECT 1"), None);
        assert_eq!(r("EXECUTE"), None);
        assert_eq!(r("EXECUTE \"unterminated"), None);
        assert_eq!(r("/* unterminated"), None);
    }

    #[test]
    fn clients_cannot_see_each_others_names() {
        let mut one = ClientStatements::default();
        let mut two = ClientStatements::default();
        one.define(b"S_1", StatementDef::new(b"select 1", &[0, 0], None))
            .unwrap();
        two.define(b"S_1", StatementDef::new(b"select 2", &[0, 0], None))
            .unwrap();
        assert_ne!(one.get(b"S_1").unwrap().hash, two.get(b"S_1").unwrap().hash);
        assert_eq!(
            one.define(b"S_1", StatementDef::new(b"select 3", &[0, 0], None)),
            Err(StatementError::AlreadyExists("S_1".into()))
        );
        one.close(b"S_1");
        assert!(one.get(b"S_1").is_err());
    }

    #[test]
    fn eviction_spares_the_current_batch() {
        let h = |i: u8| StatementHash([i; 16]);
        let mut s = ServerStatements::new(2);
        s.begin_batch();
        assert_eq!(s.insert(h(1), 1), None);
        s.begin_batch();
        assert_eq!(s.insert(h(2), 1), None);
        s.begin_batch();
        assert_eq!(s.touch(&h(1), 1), Holding::Fresh);
        // h(2) is the least recently used and not in this batch.
        assert_eq!(s.insert(h(3), 1), Some(h(2)));
        // Everything left was used in this batch: grow instead of closing a statement in use.
        assert_eq!(s.insert(h(4), 1), None);
        assert_eq!(s.len(), 3);
        assert_eq!(s.touch(&h(2), 1), Holding::Missing);
    }

    #[test]
    fn schema_changes_make_statements_stale() {
        let h = |i: u8| StatementHash([i; 16]);
        let mut s = ServerStatements::new(10);
        s.insert(h(1), 1);
        s.insert(h(2), 3);
        assert_eq!(s.touch(&h(1), 2), Holding::Stale);
        assert_eq!(s.touch(&h(2), 2), Holding::Fresh);
        // Prepared again: fresh, and no victim for re-inserting what is held.
        assert_eq!(s.insert(h(1), 2), None);
        assert_eq!(s.touch(&h(1), 2), Holding::Fresh);
        // A later generation (a stale plan reported by any server) makes both stale.
        assert_eq!(s.touch(&h(1), 4), Holding::Stale);
        assert_eq!(s.touch(&h(2), 4), Holding::Stale);
    }

    #[test]
    fn a_moved_server_keeps_its_statements_and_what_was_stale_stays_stale() {
        let h = |i: u8| StatementHash([i; 16]);
        let mut old = ServerStatements::new(10);
        old.insert(h(1), 5);
        old.insert(h(2), 3);
        let mut carried = old.carried(5);
        carried.sort();
        assert_eq!(carried, vec![([1; 16], true), ([2; 16], false)]);
        // The new process counts its own schema changes from 1.
        let mut new = ServerStatements::new(10);
        new.adopt(&carried, 1);
        assert_eq!(new.touch(&h(1), 1), Holding::Fresh);
        assert_eq!(new.touch(&h(2), 1), Holding::Stale);
        assert_eq!(new.touch(&h(3), 1), Holding::Missing);
    }
}
