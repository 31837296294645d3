//! One pass over a statement's text that yields its *shape* (a hash of the text with every
//! literal blanked, so `... WHERE aid = 7` and `... WHERE aid = 8` share a cached routing
//! decision) and the routing hints in its comments (`/* pgherd:replica */`).

use std::hash::Hasher;

use crate::Route;

/// A hint that names no known route.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid pgherd hint \"pgherd:{value}\"; allowed values are primary and replica")]
pub struct HintError {
    pub value: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    /// Equal for statements that differ only in literal values.
    pub hash: u64,
    /// The last `pgherd:` hint in a comment, if any.
    pub hint: Result<Option<Route>, HintError>,
}

/// FNV-1a: tiny, fast, and good enough for a cache key (collisions cost a wrong cache hit on
/// statements with different structure, which the cache guards by also keeping the length).
struct Fnv(u64);

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

const LITERAL: u8 = 0xff;

pub fn shape(sql: &[u8]) -> Shape {
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    let mut hint: Result<Option<Route>, HintError> = Ok(None);
    let mut i = 0;
    let n = sql.len();
    while i < n {
        let c = sql[i];
        match c {
            b'\'' => {
                // Standard string, or E'' when the previous byte was E/e (escapes allowed).
                let escapes = i > 0 && (sql[i - 1] == b'e' || sql[i - 1] == b'E');
                i += 1;
                while i < n {
                    if escapes && sql[i] == b'\\' {
                        i += 2;
                        continue;
                    }
                    if sql[i] == b'\'' {
                        if i + 1 < n && sql[i + 1] == b'\'' {
                            i += 2;
                            continue;
                        }
                        break;
                    }
                    i += 1;
                }
                i += 1;
                h.write(&[LITERAL]);
            }
            b'"' => {
                // Quoted identifier: part of the shape.
                let start = i;
                i += 1;
                while i < n && !(sql[i] == b'"' && !(i + 1 < n && sql[i + 1] == b'"')) {
                    i += if sql[i] == b'"' { 2 } else { 1 };
                }
                i += 1;
                h.write(&sql[start..i.min(n)]);
            }
            b'-' if i + 1 < n && sql[i + 1] == b'-' => {
                let start = i + 2;
                while i < n && sql[i] != b'\n' {
                    i += 1;
                }
                note_hint(&sql[start..i], &mut hint);
                h.write(&sql[start - 2..i]);
            }
            b'/' if i + 1 < n && sql[i + 1] == b'*' => {
                let start = i;
                let mut depth = 0;
                while i < n {
                    if sql[i] == b'/' && i + 1 < n && sql[i + 1] == b'*' {
                        depth += 1;
                        i += 2;
                    } else if sql[i] == b'*' && i + 1 < n && sql[i + 1] == b'/' {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
                let end = i.min(n);
                let inner_end = end.saturating_sub(2).max(start + 2);
                note_hint(&sql[start + 2..inner_end.min(n)], &mut hint);
                h.write(&sql[start..end]);
            }
            b'$' if dollar_tag(&sql[i..]).is_some() => {
                let tag_len = dollar_tag(&sql[i..]).unwrap_or(1);
                let tag = &sql[i..i + tag_len];
                i += tag_len;
                while i < n && !sql[i..].starts_with(tag) {
                    i += 1;
                }
                i += tag_len;
                h.write(&[LITERAL]);
            }
            b'0'..=b'9' if i == 0 || !is_ident_byte(sql[i - 1]) => {
                while i < n && (sql[i].is_ascii_alphanumeric() || sql[i] == b'.' || sql[i] == b'_')
                {
                    i += 1;
                }
                h.write(&[LITERAL]);
            }
            _ => {
                h.write(&[c.to_ascii_lowercase()]);
                i += 1;
            }
        }
    }
    Shape {
        hash: h.finish(),
        hint,
    }
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80
}

/// The length of a dollar-quote opening tag (`$$` or `$tag$`) at the start of `s`.
fn dollar_tag(s: &[u8]) -> Option<usize> {
    let end = s[1..].iter().position(|&b| b == b'$')? + 2;
    let tag = &s[1..end - 1];
    let valid = tag.first().is_none_or(|b| !b.is_ascii_digit())
        && tag
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b == b'_' || b >= 0x80);
    valid.then_some(end)
}

fn note_hint(comment: &[u8], hint: &mut Result<Option<Route>, HintError>) {
    let text = String::from_utf8_lossy(comment);
    for word in text.split_whitespace() {
        let Some(value) = word.strip_prefix("pgherd:") else {
            continue;
        };
        *hint = match value {
            "primary" => Ok(Some(Route::Primary)),
            "replica" => Ok(Some(Route::Replica)),
            other => Err(HintError {
                value: other.to_owned(),
            }),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same(a: &str, b: &str) -> bool {
        shape(a.as_bytes()).hash == shape(b.as_bytes()).hash
    }

    #[test]
    fn literals_do_not_change_the_shape() {
        assert!(same(
            "SELECT abalance FROM pgbench_accounts WHERE aid = 7;",
            "select abalance from pgbench_accounts where aid = 123456;"
        ));
        assert!(same(
            "SELECT 'a''b', E'x\\'y', $$z$$, $f$q$f$, 1.5e3",
            "SELECT 'c', E'd', $$e$$, $f$g$f$, 2"
        ));
        assert!(!same("SELECT a FROM t", "SELECT b FROM t"));
        assert!(!same("SELECT \"a\" FROM t", "SELECT \"b\" FROM t"));
        assert!(!same("SELECT 1 FROM t", "SELECT 1 FROM t FOR UPDATE"));
        // A digit inside an identifier is not a literal.
        assert!(!same("SELECT * FROM t1", "SELECT * FROM t2"));
    }

    #[test]
    fn hints_come_from_comments_only() {
        let hint = |s: &str| shape(s.as_bytes()).hint;
        assert_eq!(
            hint("/* pgherd:replica */ SELECT 1"),
            Ok(Some(Route::Replica))
        );
        assert_eq!(hint("SELECT 1 -- pgherd:primary"), Ok(Some(Route::Primary)));
        assert_eq!(hint("SELECT '/* pgherd:replica */'"), Ok(None));
        assert_eq!(hint("SELECT 1"), Ok(None));
        assert_eq!(
            hint("/* pgherd:replca */ SELECT 1"),
            Err(HintError {
                value: "replca".into()
            })
        );
    }
}
