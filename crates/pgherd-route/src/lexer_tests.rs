//! The lexer against the statements it must tell apart, and against the parser library's own
//! scanner: for every text the lexer calls cacheable, its literals must be exactly the
//! scanner's.

use super::lexer::{lex, HintError, Lexed};
use super::Route;

fn key(sql: &str) -> Option<Vec<u8>> {
    let mut key = Vec::new();
    let lexed = lex(sql.as_bytes(), true, &mut key);
    lexed.cacheable.then_some(key)
}

fn lexed(sql: &str) -> Lexed {
    lex(sql.as_bytes(), true, &mut Vec::new())
}

fn same(a: &str, b: &str) -> bool {
    let (ka, kb) = (key(a), key(b));
    ka.is_some() && ka == kb
}

#[test]
fn literals_do_not_change_the_key() {
    assert!(same(
        "SELECT abalance FROM pgbench_accounts WHERE aid = 7;",
        "SELECT abalance FROM pgbench_accounts WHERE aid = 123456;"
    ));
    // Keys keep the case as written: each spelling gets a decision of its own.
    assert!(!same("SELECT a FROM t", "select a from t"));
    assert!(same(
        "SELECT 'a''b', E'x\\'y', $$z$$, $f$q$f$, 1.5e3",
        "SELECT 'c', E'd', $$e$$, $f$g$f$, 2"
    ));
    assert!(!same("SELECT a FROM t", "SELECT b FROM t"));
    assert!(!same("SELECT \"a\" FROM t", "SELECT \"b\" FROM t"));
    assert!(!same("SELECT \"A\" FROM t", "SELECT \"a\" FROM t"));
    assert!(!same("SELECT 1 FROM t", "SELECT 1 FROM t FOR UPDATE"));
    // A digit inside an identifier is not a literal.
    assert!(!same("SELECT * FROM t1", "SELECT * FROM t2"));
    // Literal kinds stay apart.
    assert!(!same("SELECT 'x'", "SELECT 1"));
    assert!(!same("SELECT 'x'", "SELECT $$x$$"));
    // An identifier byte can never look like a literal marker.
    assert!(!same("SELECT \u{ff}", "SELECT 1"));
}

/// The poisoning of issue 17: `name'\'` is an identifier and a standard string, not an
/// E-string, so the statement after it stays visible.
#[test]
fn only_a_lone_e_starts_an_escape_string() {
    let benign = r"SELECT name'\'                                 ; SELECT 'z'";
    let hostile = r"SELECT name'\'; DELETE FROM rt WHERE id >= 0   ; SELECT 'z'";
    assert_eq!(benign.len(), hostile.len());
    // A backslash in a standard string: no key at all (its meaning depends on a setting a
    // pipelined statement may change just before).
    assert!(key(benign).is_none() && key(hostile).is_none());
    // Without a backslash, the statement after `name'x'` is in the key.
    let hostile = "SELECT name'x'; DELETE FROM rt WHERE id >= 0";
    assert!(key(hostile)
        .unwrap()
        .windows(6)
        .any(|w| w.eq_ignore_ascii_case(b"delete")));
    // E'...' really is one: the backslash escapes the quote.
    assert!(same(r"SELECT E'\'' , 1", r"SELECT E'x' , 2"));
    assert!(!same(r"SELECT e'\''", r"SELECT x'\''"));
}

#[test]
fn strings_continue_across_newlines_in_their_own_quoting() {
    // The second part of a continued E-string is an E-string too.
    let continued = "SELECT E'a'\n'\\'; DELETE FROM t; --'";
    let k = key(continued).unwrap();
    assert!(
        !k.windows(6).any(|w| w.eq_ignore_ascii_case(b"delete")),
        "{k:?}"
    );
    // Without a newline, two strings.
    assert!(key("SELECT 'a' 'b'").is_some());
    assert!(!same("SELECT 'a'\n'b'", "SELECT 'a' 'b'"));
    // A comment may sit between the parts (PostgreSQL 15 reads `'a'\n-- c\n'b'` as 'ab'; the
    // parser library's scanner does not, so such a text is classified as unparsable).
    assert!(same("SELECT 'a'\n-- c\n'b'", "SELECT 'x'\n-- c\n'y'"));
    let mut key = Vec::new();
    let continued = "SELECT 'a'\n-- c\n'b'; DELETE FROM t";
    assert!(
        lex(continued.as_bytes(), true, &mut key).cacheable,
        "{continued}"
    );
}

#[test]
fn standard_strings_follow_the_session_setting() {
    let sql = r"SELECT 'a\' , 'b; DELETE FROM t; --'";
    let mut on = Vec::new();
    let mut off = Vec::new();
    let l_on = lex(sql.as_bytes(), true, &mut on);
    let l_off = lex(sql.as_bytes(), false, &mut off);
    // Either way the text is flagged and gets no key: the server's setting may have changed
    // since pgherd last heard of it.
    assert!(l_on.strings_depend_on_settings && !l_on.cacheable);
    assert!(l_off.strings_depend_on_settings && !l_off.cacheable);
    assert!(!on.windows(6).any(|w| w.eq_ignore_ascii_case(b"delete")));
    assert!(off.windows(6).any(|w| w.eq_ignore_ascii_case(b"delete")));
}

/// In a client-only encoding (SJIS, BIG5, GBK...) a backslash byte may be the second half of
/// a character: after a non-ASCII byte inside an E-string it is not trusted as an escape.
#[test]
fn a_backslash_after_a_non_ascii_byte_is_not_trusted() {
    let sjis = b"SELECT E'\x95\\'; SELECT pg_catalog.set_config('search_path', 'x', false); --'";
    let mut key = Vec::new();
    let lexed = lex(sjis, true, &mut key);
    assert!(lexed.strings_depend_on_settings && !lexed.cacheable);
    assert!(lex("SELECT E'caf\u{e9} \\n'".as_bytes(), true, &mut Vec::new()).cacheable);
}

#[test]
fn dollar_quotes_start_only_at_a_token() {
    // `a$b$` is an identifier; the text after it is not quoted.
    assert!(key("SELECT a$b$ FROM t WHERE x = $b$ y $b$").is_some());
    assert!(!same("SELECT a$b$, 1", "SELECT a$c$, 1"));
    // `1$a$...$a$`: a number, then a dollar-quoted string.
    assert!(same("SELECT 1$a$ x $a$", "SELECT 2$a$ y $a$"));
    // Parameters are not literals; trailing junk after them is refused by the server.
    assert!(!same("SELECT $1", "SELECT $2"));
    assert!(key("SELECT $1abc").is_none());
    // The closing tag must match exactly.
    assert!(same("SELECT $a$ $ab$ $$ $a$", "SELECT $a$ z $a$"));
}

#[test]
fn numbers_follow_postgresql_15() {
    assert!(same("SELECT 1.5e-3, .5, 5.", "SELECT 1, 2, 3"));
    // Trailing junk is an error on the server: no key.
    assert!(key("SELECT 1for update").is_none());
    assert!(key("SELECT 0x1F").is_none());
    assert!(key("SELECT 1e'x'").is_none());
    // `1..2` is 1, ., .2
    assert!(key("SELECT 1..2").is_some());
}

#[test]
fn unterminated_text_has_no_key() {
    for sql in [
        "SELECT 'abc",
        "SELECT \"abc",
        "SELECT $$abc",
        "SELECT 1 /* x",
        "SELECT E'\\'",
    ] {
        assert!(key(sql).is_none(), "{sql}");
    }
}

#[test]
fn hints_come_from_comments_only() {
    let hint = |s: &str| lexed(s).hint;
    assert_eq!(
        hint("/* pgherd:replica */ SELECT 1"),
        Ok(Some(Route::Replica))
    );
    assert_eq!(hint("SELECT 1 -- pgherd:primary"), Ok(Some(Route::Primary)));
    assert_eq!(hint("SELECT '/* pgherd:replica */'"), Ok(None));
    assert_eq!(hint("SELECT $$ -- pgherd:replica $$"), Ok(None));
    assert_eq!(hint("SELECT 1"), Ok(None));
    assert_eq!(
        hint("/* pgherd:replca */ SELECT 1"),
        Err(HintError {
            value: "replca".into()
        })
    );
    assert!(!same(
        "/* pgherd:replica */ SELECT 1",
        "/* pgherd:primary */ SELECT 1"
    ));
}

#[test]
fn shard_hints_name_a_shard_by_number() {
    let shard = |s: &str| lexed(s).shard;
    assert_eq!(shard("/* pgherd:shard=2 */ SELECT 1"), Ok(Some(2)));
    assert_eq!(shard("SELECT 1 -- pgherd:shard=0"), Ok(Some(0)));
    assert_eq!(shard("SELECT 1"), Ok(None));
    assert_eq!(shard("SELECT '/* pgherd:shard=1 */'"), Ok(None));
    for bad in ["shard=", "shard=-1", "shard=one", "shard=99999999999"] {
        assert_eq!(
            shard(&format!("/* pgherd:{bad} */ SELECT 1")),
            Err(HintError { value: bad.into() }),
            "{bad}"
        );
    }
    // Both kinds of hint may be given; a shard hint leaves the route alone.
    let both = lexed("/* pgherd:shard=1 pgherd:replica */ SELECT 1");
    assert_eq!(
        (both.shard, both.hint),
        (Ok(Some(1)), Ok(Some(Route::Replica)))
    );
    assert_eq!(lexed("/* pgherd:shard=1 */ SELECT 1").hint, Ok(None));
    assert!(!same(
        "/* pgherd:shard=1 */ SELECT 1",
        "/* pgherd:shard=2 */ SELECT 1"
    ));
}

#[test]
fn nesting_estimate_counts_operator_chains() {
    let depth = |s: &str| lexed(s).nesting_estimate;
    assert_eq!(depth("SELECT 1"), 0);
    assert_eq!(depth(&format!("SELECT {}", vec!["1"; 101].join("+"))), 100);
    assert_eq!(depth("SELECT ((((1))))"), 0);
    assert_eq!(depth("SELECT 1+(1+(1+(1)))"), 3);
    // Long WHERE clauses and CASE lists are wide, not deep.
    let wide = (0..500)
        .map(|i| format!("a = {i}"))
        .collect::<Vec<_>>()
        .join(" AND ");
    assert!(depth(&format!("SELECT 1 WHERE {wide}")) <= 2);
    let cases: String = (0..500)
        .map(|i| format!(" WHEN a = {i} THEN {i}"))
        .collect();
    assert!(depth(&format!("SELECT CASE{cases} END")) <= 2);
    assert_eq!(
        lexed("SELECT set_config('a.b', 'c', false), \"set_config\"(x)").set_config_names,
        2
    );
}

/// Literal spans the parser library's scanner reports, for texts the lexer keys: they must
/// agree, or two different statements could share a key.
#[test]
fn literals_agree_with_the_parser_librarys_scanner() {
    use pg_query::protobuf::Token;
    const PIECES: &[&str] = &[
        "SELECT ",
        "a",
        "e",
        "E",
        "b",
        "x",
        "n",
        "u",
        "U&",
        "'",
        "''",
        "\\",
        "\\'",
        "\"",
        "$",
        "$$",
        "$a$",
        "$1",
        "1",
        "1.5",
        ".",
        "e5",
        "--",
        "/*",
        "*/",
        "\n",
        " ",
        ";",
        "(",
        ")",
        "+",
        "-",
        "::",
        "name",
        "\r",
        "x'",
        "E'",
        "'\n'",
        "'\n  '",
        "set_config",
        "0",
    ];
    let literal_tokens = [
        Token::Sconst,
        Token::Usconst,
        Token::Bconst,
        Token::Xconst,
        Token::Iconst,
        Token::Fconst,
    ];
    let mut next = crate::xorshift(0x9e37_79b9_7f4a_7c15);
    let mut compared = 0;
    for _ in 0..20_000 {
        let len = 1 + next() % 12;
        let sql: String = (0..len)
            .map(|_| PIECES[(next() % PIECES.len() as u64) as usize])
            .collect();
        let mut key = Vec::new();
        let mut spans = Vec::new();
        let lexed = super::lexer::lex_with_spans(sql.as_bytes(), true, &mut key, &mut spans);
        if !lexed.cacheable {
            continue;
        }
        let Ok(scanned) = pg_query::scan(&sql) else {
            continue;
        };
        let theirs: Vec<(usize, usize)> = scanned
            .tokens
            .iter()
            .filter(|t| literal_tokens.iter().any(|k| *k as i32 == t.token))
            .map(|t| (t.start as usize, t.end as usize))
            .collect();
        // Dollar-quoted strings are SCONST for the scanner too.
        assert_eq!(spans, theirs, "literals differ for {sql:?}");
        compared += 1;
    }
    assert!(compared > 2_000, "only {compared} texts compared");
}

#[test]
fn blanks_before_a_statement_are_skipped_as_the_server_reads_them() {
    fn start(sql: &str) -> &str {
        &sql[crate::skip_blanks(sql.as_bytes(), 0)..]
    }
    assert_eq!(start(" \t\r\n\x0b\x0cSET a = 1"), "SET a = 1");
    assert_eq!(start("-- a comment\rSET a = 1"), "SET a = 1");
    assert_eq!(start("-- one\n-- two\n  SET a = 1"), "SET a = 1");
    assert_eq!(start("/* a /* nested */ comment */ SET a = 1"), "SET a = 1");
    assert_eq!(start("/**/SET a = 1"), "SET a = 1");
    assert_eq!(start("/* a ***/ /*/ still a comment */SET"), "SET");
    assert_eq!(start("/* a /* unterminated */ SET a = 1"), "");
    assert_eq!(start("-- only a comment"), "");
    assert_eq!(start(""), "");
    // A text that starts with a letter starts there, whatever follows.
    assert_eq!(start("SET a = 1"), "SET a = 1");
    assert_eq!(start("s-- not a comment yet"), "s-- not a comment yet");
    assert_eq!(start("x"), "x");
    assert_eq!(start("- 1"), "- 1");
    assert_eq!(start("/ 2"), "/ 2");
    let from_the_middle = "SELECT 1; /* x */ SET a = 1";
    assert_eq!(
        &from_the_middle[crate::skip_blanks(from_the_middle.as_bytes(), 9)..],
        "SET a = 1"
    );
}

#[test]
fn the_session_check_reads_the_key_where_it_stands_for_the_text() {
    let may_set = |sql: &str| lexed(sql).may_change_session;
    // What the plain check says too.
    assert!(may_set("SET search_path = a"));
    assert!(may_set("/* pgherd:primary */ reset all"));
    assert!(may_set("SELECT 1; SET x = 1"));
    assert!(may_set("SELECT 1; /* x */ SET x = 1"));
    assert!(!may_set("SELECT 1;"));
    assert!(!may_set("UPDATE t SET a = 1"));
    // A `;` inside a literal is no second statement, a `;` between them is.
    assert!(!may_set("SELECT 'a; SET x = 1'"));
    assert!(!may_set("SELECT $$;$$, E';', 'x'';'"));
    assert!(may_set("SELECT ';'; SET x = 1"));
    assert!(may_set("SELECT $f$;$f$; DISCARD ALL"));
    // A comment stays in the key: its `;` is taken for a boundary, which only costs a copy.
    assert!(may_set("SELECT 1 /* ; */ + 2"));
    // Texts with no key (unterminated, strings the session's settings decide) get the plain
    // check on their text.
    assert!(may_set("SELECT 'x; SET y = 1"));
    assert!(may_set("SELECT 'a\\'; SET x = 1; --'"));
    assert!(!may_set("SELECT 'a\\'"));
    // Shapes that differ only in literals agree.
    assert_eq!(
        may_set("SELECT 'a;b'; RESET x"),
        may_set("SELECT 'c'; RESET x")
    );
}

/// For every text with a key, the lexer's answer is the plain check's on that key, and never
/// yes where the plain check on the text says no; without a key, it is the plain check's on
/// the text.
#[test]
fn the_session_check_on_the_key_says_yes_whenever_the_text_needs_it() {
    let pieces: &[&str] = &[
        "SET x = 1",
        "select 1",
        "reset all",
        " ",
        ";",
        "'a;b'",
        "$$;$$",
        "/* ; */",
        "-- c\n",
        "discard all",
        "savepoint s",
        "E'\\';'",
        "\"q;\"",
        "release s",
        "x",
        "'",
    ];
    let mut next = crate::xorshift(7);
    for _ in 0..50_000 {
        let mut sql = String::new();
        for _ in 0..next() % 6 {
            sql.push_str(pieces[next() as usize % pieces.len()]);
        }
        let mut key = Vec::new();
        let lexed = lex(sql.as_bytes(), true, &mut key);
        let plain = crate::may_change_session(sql.as_bytes());
        if lexed.cacheable {
            assert_eq!(
                lexed.may_change_session,
                crate::may_change_session(&key),
                "{sql:?}"
            );
            // Blanking literals only takes `;`s away, and a statement's first word is never
            // a literal.
            assert!(plain || !lexed.may_change_session, "{sql:?}");
        } else {
            assert_eq!(lexed.may_change_session, plain, "{sql:?}");
        }
    }
}
