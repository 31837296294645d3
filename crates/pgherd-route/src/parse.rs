//! PostgreSQL's parser (`pg_query`), bounded: no client text may take pgherd down or hold it
//! for long.
//!
//! The parser library recurses once per level of the tree (about 300 bytes of stack each,
//! measured) without a stack check of its own, and a left-nested chain costs two bytes of
//! text per level (`1+1+1...`), one for prefix operators: a 80 KB statement overflowed an
//! 8 MiB thread. Its memory is about a kilobyte per byte of text at worst. So a statement is
//! only parsed if it is at most `max_bytes` long and its nesting estimate (from the lexer)
//! is within what the library's decoder accepts anyway (it refuses trees deeper than about
//! 100 messages); the parse runs on a stack sized for the text's worst case, allocated only
//! when the thread's own is too small (`stacker`); and a panic inside the library is an
//! error, not a crash.

use crate::lexer::Lexed;

/// Texts longer than this are not parsed unless configured otherwise: worst case about 30 ms
/// and 30 MB for one parse.
pub const DEFAULT_MAX_PARSE_BYTES: usize = 32 << 10;

/// Beyond this many chained operators the decoder would refuse the tree anyway.
const MAX_NESTING_ESTIMATE: usize = 256;

/// Stack reserved per byte of text: one tree level per byte at worst, ~300 bytes per level.
const STACK_BYTES_PER_TEXT_BYTE: usize = 512;
/// Headroom for the library's own frames and the decode that follows.
const STACK_BASE_BYTES: usize = 256 << 10;

/// Why a text was not parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotParsed {
    #[error("is {len} bytes long, more than the {max} pgherd parses")]
    TooLarge { len: usize, max: usize },
    #[error("nests too deeply to parse")]
    TooDeep,
    #[error("cannot be parsed ({0})")]
    Syntax(String),
}

/// One text, parsed twice: the statement tree, and the library's summary (every function
/// called and relation touched, found by PostgreSQL's complete expression walker; the
/// tree's own walk skips some places, such as VALUES lists).
pub struct Parsed {
    pub tree: pg_query::ParseResult,
    pub summary: pg_query::SummaryResult,
}

/// Parses `sql` within the bounds above.
pub fn parse(sql: &str, lexed: &Lexed, max_bytes: usize) -> Result<Parsed, NotParsed> {
    within_bounds(sql, lexed, max_bytes, || {
        let tree = pg_query::parse(sql)?;
        let summary = pg_query::summary(sql, -1)?;
        Ok(Parsed { tree, summary })
    })
}

/// The statement tree alone, within the same bounds, for a reader that walks the tree's
/// serialized form itself and needs no summary.
pub fn parse_tree(
    sql: &str,
    lexed: &Lexed,
    max_bytes: usize,
) -> Result<pg_query::ParseResult, NotParsed> {
    within_bounds(sql, lexed, max_bytes, || pg_query::parse(sql))
}

/// The statements of a query string in order, each with the spaces and comments before it (a
/// hint in a comment stays with its statement); empty ones are left out. Within the bounds
/// above the parser splits it, as the server will; a longer text is split by the scanner
/// (each of its statements is then parsed on its own, within the bounds), which also cuts at
/// a `;` inside a `BEGIN ATOMIC` body.
pub fn split_statements<'a>(
    sql: &'a str,
    lexed: &Lexed,
    max_bytes: usize,
) -> Result<Vec<&'a str>, NotParsed> {
    match within_bounds(sql, lexed, max_bytes, || pg_query::split_with_parser(sql)) {
        Err(NotParsed::TooLarge { .. } | NotParsed::TooDeep) => {
            std::panic::catch_unwind(|| pg_query::split_with_scanner(sql))
                .map_err(|_| NotParsed::Syntax("the parser library failed".into()))?
                .map_err(|e| NotParsed::Syntax(e.to_string()))
        }
        split => split,
    }
}

/// [`split_statements`] of a client's query text with the default bounds, lexed here.
pub fn split_query(sql: &str) -> Result<Vec<&str>, NotParsed> {
    split_text(sql, DEFAULT_MAX_PARSE_BYTES)
}

/// [`split_statements`] of a text bounded by `max_bytes` (an operator's script may be longer
/// than a client's query), lexed here.
pub fn split_text(sql: &str, max_bytes: usize) -> Result<Vec<&str>, NotParsed> {
    split_statements(sql, &lexed(sql), max_bytes)
}

/// [`parse_tree`] of a text bounded by `max_bytes`, lexed here.
pub fn parse_text_tree(sql: &str, max_bytes: usize) -> Result<pg_query::ParseResult, NotParsed> {
    parse_tree(sql, &lexed(sql), max_bytes)
}

fn lexed(sql: &str) -> Lexed {
    let mut key = Vec::new();
    crate::lexer::lex(sql.as_bytes(), true, &mut key)
}

fn within_bounds<T>(
    sql: &str,
    lexed: &Lexed,
    max_bytes: usize,
    parse: impl FnOnce() -> Result<T, pg_query::Error> + std::panic::UnwindSafe,
) -> Result<T, NotParsed> {
    if sql.len() > max_bytes {
        return Err(NotParsed::TooLarge {
            len: sql.len(),
            max: max_bytes,
        });
    }
    if lexed.nesting_estimate > MAX_NESTING_ESTIMATE {
        return Err(NotParsed::TooDeep);
    }
    let stack = STACK_BASE_BYTES + sql.len() * STACK_BYTES_PER_TEXT_BYTE;
    stacker::maybe_grow(stack, stack, || {
        std::panic::catch_unwind(parse)
            .map_err(|_| NotParsed::Syntax("the parser library failed".into()))?
            .map_err(|e: pg_query::Error| {
                NotParsed::Syntax(match e {
                    // The server's own words, as it would say them.
                    pg_query::Error::Parse(message) => message,
                    other => other.to_string(),
                })
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lexer::lex;

    fn parse_text(sql: &str) -> Result<usize, NotParsed> {
        let mut key = Vec::new();
        let lexed = lex(sql.as_bytes(), true, &mut key);
        parse(sql, &lexed, DEFAULT_MAX_PARSE_BYTES).map(|p| p.tree.protobuf.stmts.len())
    }

    fn split(sql: &str, max_bytes: usize) -> Result<Vec<&str>, NotParsed> {
        let mut key = Vec::new();
        let lexed = lex(sql.as_bytes(), true, &mut key);
        split_statements(sql, &lexed, max_bytes)
    }

    #[test]
    fn query_strings_split_where_the_server_splits_them() {
        let n = DEFAULT_MAX_PARSE_BYTES;
        assert_eq!(split("SELECT 1", n).unwrap(), ["SELECT 1"]);
        assert_eq!(split(" SELECT 1 ;; ", n).unwrap(), [" SELECT 1 "]);
        assert_eq!(split("", n).unwrap(), Vec::<&str>::new());
        assert_eq!(
            split(
                "/* pgherd:shard=1 */ SELECT ';'; /* pgherd:primary */ SELECT $$;$$;",
                n
            )
            .unwrap(),
            [
                "/* pgherd:shard=1 */ SELECT ';'",
                " /* pgherd:primary */ SELECT $$;$$"
            ]
        );
        let atomic =
            "CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; END; SELECT f()";
        assert_eq!(split(atomic, n).unwrap().len(), 2);
        // A syntax error anywhere: nothing is split (the server would run none of them).
        assert!(matches!(
            split("SELECT 1; SELEC 2; SELECT 3", n),
            Err(NotParsed::Syntax(_))
        ));
        // Beyond the bounds the scanner splits, statement by statement.
        let long = format!("SELECT '{}'; SELECT 2", "x".repeat(64));
        assert_eq!(split(&long, 32).unwrap().len(), 2);
        let deep = format!(
            "SET a.b = 1; SELECT {}1{}",
            "(".repeat(5000),
            ")".repeat(5000)
        );
        assert_eq!(split(&deep, n).unwrap()[0], "SET a.b = 1");
    }

    /// Each shape at the largest size parsed, on a thread with a small stack: none may crash.
    #[test]
    fn deep_and_large_texts_are_refused_or_parsed_without_crashing() {
        let n = DEFAULT_MAX_PARSE_BYTES;
        let shapes: Vec<(&str, String)> = vec![
            ("plus", format!("SELECT {}", vec!["1"; n / 2 - 8].join("+"))),
            ("prefix", format!("SELECT {}1", "-+".repeat(n / 2 - 8))),
            ("cast", format!("SELECT 1{}", "::int".repeat(n / 5 - 2))),
            (
                "parens",
                format!("SELECT {}1{}", "(".repeat(n / 2 - 8), ")".repeat(n / 2 - 8)),
            ),
            ("not", format!("SELECT {}true", "NOT ".repeat(n / 4 - 4))),
            (
                "subquery",
                format!(
                    "SELECT {}1{}",
                    "(SELECT ".repeat(n / 9 - 2),
                    ")".repeat(n / 9 - 2)
                ),
            ),
            (
                "calls",
                format!(
                    "SELECT {}1{}",
                    "f(".repeat(n / 3 - 4),
                    ")".repeat(n / 3 - 4)
                ),
            ),
            (
                "arrays",
                format!(
                    "SELECT {}1{}",
                    "ARRAY[".repeat(n / 7 - 2),
                    "]".repeat(n / 7 - 2)
                ),
            ),
            (
                "case",
                format!(
                    "SELECT {}1{}",
                    "CASE WHEN true THEN ".repeat(n / 25),
                    " END".repeat(n / 25)
                ),
            ),
            ("union", "SELECT 1 UNION ".repeat(n / 16) + "SELECT 1"),
            ("many", "SELECT 1;".repeat(n / 9)),
            (
                "and",
                format!("SELECT 1 WHERE {}", vec!["a=1"; n / 8 - 4].join(" AND ")),
            ),
        ];
        let handle = std::thread::Builder::new()
            .stack_size(1 << 20)
            .spawn(move || {
                for (name, sql) in shapes {
                    assert!(
                        sql.len() <= DEFAULT_MAX_PARSE_BYTES,
                        "{name}: {}",
                        sql.len()
                    );
                    let outcome = parse_text(&sql);
                    eprintln!("{name}: {} bytes: {outcome:?}", sql.len());
                }
            })
            .unwrap();
        handle.join().expect("no shape may crash the parse");
    }

    #[test]
    fn bounds() {
        assert_eq!(parse_text("SELECT 1; SELECT 2"), Ok(2));
        let long = format!("SELECT '{}'", "x".repeat(DEFAULT_MAX_PARSE_BYTES));
        assert!(matches!(parse_text(&long), Err(NotParsed::TooLarge { .. })));
        let deep = format!("SELECT {}", vec!["1"; 1000].join("+"));
        assert_eq!(parse_text(&deep), Err(NotParsed::TooDeep));
        assert!(matches!(parse_text("SELEC 1"), Err(NotParsed::Syntax(_))));
    }
}
