//! Reads PostgreSQL's `test_decoding` output plugin (shipped with the server; it needs no
//! publication, so tables without a replica identity keep accepting updates) into the tables
//! each committed transaction changed.
//!
//! The plugin writes one text per change: `BEGIN`, `table public.t: INSERT: ...`, `table
//! public.a, public.b: TRUNCATE: ...`, `message: ...`, `COMMIT`. Names are written as
//! `quote_qualified_identifier` writes them. Tables are reported by their unqualified name,
//! since the cache keys its entries' tables that way (a change to `s1.t` drops entries that
//! read `s2.t` too: more than needed, never less). A change whose table cannot be read
//! invalidates everything at its commit.

use std::collections::BTreeSet;

/// The logical message prefix pgherd's event trigger emits, transactional, at the end of
/// every schema change (`pg_logical_emit_message(true, SCHEMA_CHANGE_PREFIX, '')`).
pub const SCHEMA_CHANGE_PREFIX: &str = "pgherd.schema_change";
/// How `test_decoding` writes that message.
const SCHEMA_CHANGE_MESSAGE: &str = "message: transactional: 1 prefix: pgherd.schema_change,";

/// What a decoded commit invalidates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invalidation {
    /// These tables (unqualified names).
    Tables(BTreeSet<String>),
    /// A change pgherd could not attribute to a table.
    All,
}

/// A decoded commit that changed tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    /// The transaction's id (`include-xids`), to learn when the commit is visible: the
    /// primary writes and flushes a commit, so it can be decoded, before other sessions see
    /// it (a synchronous commit waits for its standby in between).
    pub xid: Option<u32>,
    pub invalidates: Invalidation,
    /// When the primary committed it (`include-timestamp`), in microseconds since the Unix
    /// epoch: how long invalidation took is measured from there.
    pub committed_at_unix_us: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("a change outside a transaction: {0:?}")]
    OutsideTransaction(String),
    #[error("BEGIN inside a transaction")]
    NestedBegin,
}

/// One transaction's changes, gathered until its commit.
#[derive(Debug, Default)]
pub struct Decoder {
    open: Option<Changes>,
}

#[derive(Debug, Default)]
struct Changes {
    xid: Option<u32>,
    tables: BTreeSet<String>,
    unreadable: bool,
}

/// The commit time `test_decoding` writes (`COMMIT 734 (at 2026-11-25 10:00:00.12+00)`: ISO,
/// with the walsender's offset), in microseconds since the Unix epoch.
fn commit_time(text: &str) -> Option<i64> {
    let stamp = text.split_once("(at ")?.1.strip_suffix(')')?;
    chrono::DateTime::parse_from_str(stamp, "%Y-%m-%d %H:%M:%S%.f%#z")
        .ok()
        .map(|t| t.timestamp_micros())
}

impl Decoder {
    /// Feeds one message's text; a commit returns what it invalidates (`None` for a
    /// transaction that changed no table: a schema change shows as one unless its trigger ran).
    pub fn feed(&mut self, text: &str) -> Result<Option<Commit>, DecodeError> {
        let mut words = text.split([' ', ':']);
        let first_word = words.next().unwrap_or("");
        let xid = words.next().and_then(|w| w.parse().ok());
        match first_word {
            "BEGIN" => {
                if self.open.is_some() {
                    return Err(DecodeError::NestedBegin);
                }
                self.open = Some(Changes {
                    xid,
                    ..Changes::default()
                });
                Ok(None)
            }
            "COMMIT" => {
                let Some(changes) = self.open.take() else {
                    return Err(DecodeError::OutsideTransaction(text.to_owned()));
                };
                let invalidates = if changes.unreadable {
                    Invalidation::All
                } else if changes.tables.is_empty() {
                    return Ok(None);
                } else {
                    Invalidation::Tables(changes.tables)
                };
                Ok(Some(Commit {
                    xid: xid.or(changes.xid),
                    invalidates,
                    committed_at_unix_us: commit_time(text),
                }))
            }
            "table" => {
                let names = table_names(text);
                match self.open.as_mut() {
                    Some(changes) => {
                        match names {
                            Some(names) => changes.tables.extend(names),
                            None => changes.unreadable = true,
                        }
                        Ok(None)
                    }
                    // A non-transactional change cannot happen for tables; read it as one
                    // transaction of its own rather than lose it.
                    None => Ok(Some(Commit {
                        xid: None,
                        invalidates: match names {
                            Some(names) => Invalidation::Tables(names.into_iter().collect()),
                            None => Invalidation::All,
                        },
                        committed_at_unix_us: None,
                    })),
                }
            }
            // pgherd's event trigger announces a schema change inside its transaction: what it
            // changed is not a table's rows, so everything goes at its commit.
            "message" if text.starts_with(SCHEMA_CHANGE_MESSAGE) => match self.open.as_mut() {
                Some(changes) => {
                    changes.unreadable = true;
                    Ok(None)
                }
                // Its transaction was not shown (`skip-empty-xacts`): a commit without an id,
                // which the stream cannot hold until visible, so it starts over.
                None => Ok(Some(Commit {
                    xid: None,
                    invalidates: Invalidation::All,
                    committed_at_unix_us: None,
                })),
            },
            // Other logical messages (pg_logical_emit_message) and anything newer change no
            // table.
            _ => Ok(None),
        }
    }

    /// The stream restarts (a new connection): a half-read transaction is sent again.
    pub fn reset(&mut self) {
        self.open = None;
    }
}

/// The unqualified names in `table <name>[, <name>...]: <ACTION>:`; `None` if the text does
/// not read so.
fn table_names(text: &str) -> Option<Vec<String>> {
    let mut rest = text.strip_prefix("table ")?;
    let mut names = Vec::new();
    loop {
        let (_schema, after) = identifier(rest)?;
        let after = after.strip_prefix('.')?;
        let (name, after) = identifier(after)?;
        names.push(name);
        if let Some(more) = after.strip_prefix(", ") {
            rest = more;
        } else if after.starts_with(':') {
            return Some(names);
        } else {
            return None;
        }
    }
}

/// One identifier as `quote_identifier` writes it: bare, or in double quotes with inner
/// quotes doubled.
fn identifier(text: &str) -> Option<(String, &str)> {
    if let Some(quoted) = text.strip_prefix('"') {
        let mut name = String::new();
        let mut chars = quoted.char_indices();
        while let Some((i, c)) = chars.next() {
            if c != '"' {
                name.push(c);
                continue;
            }
            if quoted[i + 1..].starts_with('"') {
                name.push('"');
                chars.next();
            } else {
                return Some((name, &quoted[i + 1..]));
            }
        }
        None
    } else {
        let end = text.find(['.', ',', ':', ' ']).unwrap_or(text.len());
        (end > 0).then(|| (text[..end].to_owned(), &text[end..]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tables(names: &[&str]) -> Option<Commit> {
        commit(None, names)
    }

    fn commit(xid: Option<u32>, names: &[&str]) -> Option<Commit> {
        Some(Commit {
            xid,
            invalidates: Invalidation::Tables(names.iter().map(|s| s.to_string()).collect()),
            committed_at_unix_us: None,
        })
    }

    #[test]
    fn a_commit_invalidates_the_tables_its_changes_named() {
        let mut d = Decoder::default();
        assert_eq!(d.feed("BEGIN"), Ok(None));
        assert_eq!(
            d.feed("table public.accounts: UPDATE: aid[integer]:1 abalance[integer]:5"),
            Ok(None)
        );
        assert_eq!(d.feed("table shop.orders: INSERT: id[integer]:7"), Ok(None));
        assert_eq!(
            d.feed("table public.accounts: DELETE: aid[integer]:2"),
            Ok(None)
        );
        assert_eq!(d.feed("COMMIT"), Ok(tables(&["accounts", "orders"])));
        // include-xids and include-timestamp forms.
        assert_eq!(d.feed("BEGIN 734"), Ok(None));
        assert_eq!(d.feed("COMMIT 734 (at 2026-11-25 10:00:00+00)"), Ok(None));
        d.feed("BEGIN 735").unwrap();
        d.feed("table public.t: INSERT: x[int]:1").unwrap();
        assert_eq!(d.feed("COMMIT 735"), Ok(commit(Some(735), &["t"])));
        // The commit time, whatever the walsender's zone.
        for (text, unix_us) in [
            (
                "COMMIT 736 (at 2026-11-25 10:00:00.25+00)",
                1_795_600_800_250_000,
            ),
            (
                "COMMIT 736 (at 2026-11-25 15:30:00.25+05:30)",
                1_795_600_800_250_000,
            ),
            (
                "COMMIT 736 (at 2026-11-25 05:00:00-05)",
                1_795_600_800_000_000,
            ),
        ] {
            d.feed("BEGIN 736").unwrap();
            d.feed("table public.t: INSERT: x[int]:1").unwrap();
            let decoded = d.feed(text).unwrap().expect("a commit");
            assert_eq!(decoded.committed_at_unix_us, Some(unix_us), "{text}");
        }
    }

    #[test]
    fn quoted_names_and_truncates_of_several_tables_are_read() {
        let mut d = Decoder::default();
        d.feed("BEGIN").unwrap();
        d.feed(r#"table "My Schema"."Odd ""name"", really": INSERT: x[text]:'a: b'"#)
            .unwrap();
        d.feed(r#"table public.a, "S".b, public."c.d": TRUNCATE: restart_seqs"#)
            .unwrap();
        assert_eq!(
            d.feed("COMMIT"),
            Ok(tables(&["Odd \"name\", really", "a", "b", "c.d"]))
        );
    }

    #[test]
    fn a_change_that_cannot_be_read_invalidates_everything() {
        let mut d = Decoder::default();
        d.feed("BEGIN").unwrap();
        d.feed("table public.ok: INSERT: x[int]:1").unwrap();
        d.feed(r#"table "unterminated: INSERT: x"#).unwrap();
        assert_eq!(
            d.feed("COMMIT").map(|c| c.map(|c| c.invalidates)),
            Ok(Some(Invalidation::All))
        );
        assert_eq!(
            d.feed("table public.alone: INSERT: x[int]:1"),
            Ok(tables(&["alone"]))
        );
    }

    #[test]
    fn messages_change_nothing_and_order_is_checked() {
        let mut d = Decoder::default();
        assert_eq!(
            d.feed("message: transactional: 0 prefix: p, sz: 1 content:x"),
            Ok(None)
        );
        assert!(matches!(
            d.feed("COMMIT"),
            Err(DecodeError::OutsideTransaction(_))
        ));
        d.feed("BEGIN").unwrap();
        assert_eq!(d.feed("BEGIN"), Err(DecodeError::NestedBegin));
        d.reset();
        d.feed("BEGIN").unwrap();
        assert_eq!(d.feed("COMMIT"), Ok(None));
    }

    #[test]
    fn a_schema_change_message_invalidates_everything_at_its_commit() {
        let mut d = Decoder::default();
        d.feed("BEGIN 9").unwrap();
        d.feed("table public.t: INSERT: x[int]:1").unwrap();
        assert!(SCHEMA_CHANGE_MESSAGE.contains(SCHEMA_CHANGE_PREFIX));
        d.feed(&format!("{SCHEMA_CHANGE_MESSAGE} sz: 0 content:"))
            .unwrap();
        assert_eq!(
            d.feed("COMMIT 9"),
            Ok(Some(Commit {
                xid: Some(9),
                invalidates: Invalidation::All,
                committed_at_unix_us: None,
            }))
        );
        // Another prefix, or a message outside a transaction, changes nothing.
        d.feed("BEGIN 10").unwrap();
        d.feed("message: transactional: 1 prefix: pgherd.schema_changes, sz: 0 content:")
            .unwrap();
        assert_eq!(d.feed("COMMIT 10"), Ok(None));
        // Without its transaction around it, the change cannot be held until visible.
        assert_eq!(
            d.feed(&format!("{SCHEMA_CHANGE_MESSAGE} sz: 0 content:")),
            Ok(Some(Commit {
                xid: None,
                invalidates: Invalidation::All,
                committed_at_unix_us: None,
            }))
        );
    }
}
