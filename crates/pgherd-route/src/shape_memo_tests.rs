//! The shape memo against the lexer it stands in for: whatever texts come, in whatever order,
//! the memo's key, spans and findings are the lexer's.

use crate::lexer::lex_with_spans;
use crate::ShapeMemo;

/// Compares the memo's answer for `sql` with the lexer's; true when it came from a shape.
fn same_as_lexer(memo: &mut ShapeMemo, sql: &[u8], scs: bool, with_spans: bool) -> bool {
    let mut want_key = Vec::new();
    let mut want_spans = Vec::new();
    let want = lex_with_spans(sql, scs, &mut want_key, &mut want_spans);
    // Both append to what the caller holds.
    let mut key = b"held".to_vec();
    let mut spans = vec![(7, 9)];
    let (hits_before, _) = memo.counts();
    let got = match with_spans {
        true => memo.lex(sql, scs, &mut key, Some(&mut spans)),
        false => memo.lex(sql, scs, &mut key, None),
    };
    let text = String::from_utf8_lossy(sql);
    assert_eq!(got, want, "findings differ for {text:?} (scs {scs})");
    assert_eq!(
        &key[4..],
        &want_key[..],
        "keys differ for {text:?} (scs {scs})"
    );
    assert_eq!(&key[..4], b"held");
    if with_spans {
        assert_eq!(spans[0], (7, 9));
        assert_eq!(&spans[1..], &want_spans[..], "spans differ for {text:?}");
    } else {
        assert_eq!(spans, vec![(7, 9)]);
    }
    memo.counts().0 > hits_before
}

#[test]
fn texts_of_a_seen_shape_are_answered_from_it() {
    let mut memo = ShapeMemo::default();
    let statements = [
        "UPDATE pgbench_accounts SET abalance = abalance + {} WHERE aid = {};",
        "SELECT abalance FROM pgbench_accounts WHERE aid = {};",
        "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES ({}, {}, {}, {}, CURRENT_TIMESTAMP);",
        "SELECT * FROM t WHERE name = {} AND x > {}",
    ];
    // Numbers of every form share a shape, and strings another one.
    let kinds: [&[&str]; 2] = [
        &[
            "1",
            "4123",
            "2345",
            "0.5",
            "1e5",
            "77.25e-3",
            "12345678901234567890",
        ],
        &["'it''s'", "''", "'é'", "'x'", "'a b c'"],
    ];
    for statement in statements {
        for values in kinds {
            let mut hits = 0;
            for (i, value) in values.iter().enumerate() {
                let other = values[(i + 1) % values.len()];
                let sql = statement.replacen("{}", value, 1).replace("{}", other);
                hits += usize::from(same_as_lexer(&mut memo, sql.as_bytes(), true, i % 2 == 0));
            }
            // A shape is learnt from the second text of it.
            assert_eq!(hits, values.len() - 2, "for {statement}");
        }
    }
    assert!(!same_as_lexer(&mut memo, b"BEGIN;", true, false));
    assert!(!same_as_lexer(&mut memo, b"BEGIN;", true, false));
    assert!(same_as_lexer(&mut memo, b"BEGIN;", true, false));
    // The other `standard_conforming_strings` is a shape of its own (learnt at its first
    // sighting: the same key was lexed before).
    assert!(!same_as_lexer(&mut memo, b"BEGIN;", false, false));
    assert!(same_as_lexer(&mut memo, b"BEGIN;", false, false));
    assert!(same_as_lexer(&mut memo, b"BEGIN;", true, false));
}

#[test]
fn a_text_that_only_looks_like_a_seen_shape_is_lexed() {
    let mut memo = ShapeMemo::default();
    let pairs: [(&str, &str); 10] = [
        // `.5` is a number after a name; `5` would continue the name.
        ("SELECT x.5", "SELECT x5"),
        (
            "SELECT a FROM t WHERE b = .5",
            "SELECT a FROM t WHERE b = 5",
        ),
        // A setting's name stays in the key: no shape, and no sharing between names.
        (
            "SELECT set_config('app.a', '1', false)",
            "SELECT set_config('app.b', '1', false)",
        ),
        // A backslash in a standard string depends on the settings.
        ("SELECT 'a' FROM t", "SELECT 'a\\' FROM t"),
        // A string continued on the next line is one literal.
        ("SELECT 'a'\n, 1", "SELECT 'a'\n'b'\n, 1"),
        // Trailing junk after a number is refused by the server.
        ("SELECT 1 ,a", "SELECT 1e ,a"),
        ("SELECT 1 FROM t", "SELECT 1for FROM t"),
        // Unterminated string.
        ("SELECT 'a' ", "SELECT 'a "),
        // An E-string and a dollar quote are literals the memo does not match.
        ("SELECT 'a'", "SELECT E'a'"),
        ("SELECT 1, 2", "SELECT $$1$$, 2"),
    ];
    for (seen, other) in pairs {
        for scs in [true, false] {
            same_as_lexer(&mut memo, seen.as_bytes(), scs, true);
            same_as_lexer(&mut memo, seen.as_bytes(), scs, false);
            assert!(
                !same_as_lexer(&mut memo, other.as_bytes(), scs, true),
                "{other:?} was answered from {seen:?}"
            );
            same_as_lexer(&mut memo, other.as_bytes(), scs, false);
        }
    }
    // The setting's name never made a shape: every such text is lexed.
    let (hits_before, _) = memo.counts();
    same_as_lexer(
        &mut memo,
        b"SELECT set_config('app.a', '1', false)",
        true,
        false,
    );
    assert_eq!(memo.counts().0, hits_before);
}

/// Pieces SQL's tricky tokens are made of, and values a literal may take.
const PIECES: &[&str] = &[
    "SELECT ",
    "a",
    "t.b",
    " ",
    ", ",
    "(",
    ")",
    " = ",
    "+",
    "-",
    "*/",
    "/*",
    "/* c */",
    "--",
    "\n",
    "'",
    "''",
    "'x'",
    "'\\'",
    "\"q\"",
    "\"",
    "$",
    "$$",
    "$1",
    "$a$",
    "1",
    "1.5",
    ".5",
    "..",
    ".",
    "e5",
    "E'",
    "x'",
    "N'",
    "U&'",
    "::",
    ";",
    "set_config(",
    "current_setting(",
    "é",
    "\r",
    "/* pgherd:replica */",
    "/* pgherd:shard=1 */",
    "WHERE id = ",
];
const VALUES: &[&str] = &[
    "0",
    "7",
    "12345678901234567890",
    "1.",
    "1.5",
    ".5",
    "1e5",
    "1e-5",
    "1e",
    "1..2",
    "5a",
    "'a'",
    "''",
    "'it''s'",
    "'a\\'",
    "'é'",
    "'a'\n'b'",
    "'unterminated",
    "E'x'",
    "$$x$$",
    "x",
    "",
    "-1",
];

#[test]
fn the_memo_answers_as_the_lexer_on_random_texts() {
    let mut next = crate::xorshift(0x2545_f491_4f6c_dd1d);
    let pick = |list: &[&'static str], next: &mut dyn FnMut() -> u64| {
        list[(next() % list.len() as u64) as usize]
    };
    let mut memo = ShapeMemo::default();
    let (mut compared, mut hits) = (0u32, 0u32);
    for round in 0..20_000u64 {
        let len = 1 + next() % 10;
        let mut sql = String::new();
        for _ in 0..len {
            sql.push_str(pick(PIECES, &mut next));
        }
        let scs = round % 5 != 0;
        same_as_lexer(&mut memo, sql.as_bytes(), scs, round % 2 == 0);
        // The same text with its literals' values changed, and with one piece inserted.
        let mut key = Vec::new();
        let mut spans = Vec::new();
        lex_with_spans(sql.as_bytes(), scs, &mut key, &mut spans);
        for variant in 0..4 {
            let mut other = String::new();
            let mut from = 0;
            for &(start, end) in &spans {
                other.push_str(&sql[from..start]);
                other.push_str(pick(VALUES, &mut next));
                from = end;
            }
            other.push_str(&sql[from..]);
            if variant == 3 {
                let at = (next() % (other.len() as u64 + 1)) as usize;
                if other.is_char_boundary(at) {
                    other.insert_str(at, pick(PIECES, &mut next));
                }
            }
            hits += u32::from(same_as_lexer(
                &mut memo,
                other.as_bytes(),
                scs,
                variant % 2 == 1,
            ));
            compared += 1;
        }
    }
    // The comparison means something only if the memo answered many of them.
    assert!(
        hits > compared / 10,
        "only {hits} of {compared} texts matched a shape"
    );
}

#[test]
fn the_first_byte_that_may_start_a_literal_is_found_eight_at_a_time() {
    let mut next = crate::xorshift(0x9e37_79b9_7f4a_7c15);
    let alphabet = b"09.'/a-A \x00\x7f\x80\xff:8(\x2f\x3a\x2d\x27";
    for _ in 0..200_000 {
        let seed = next();
        let bytes: [u8; 8] =
            std::array::from_fn(|i| alphabet[((seed >> (i * 5)) % alphabet.len() as u64) as usize]);
        let want = bytes
            .iter()
            .position(|&b| b.is_ascii_digit() || b == b'.' || b == b'\'');
        let starts = crate::shape_memo::literal_starts(u64::from_le_bytes(bytes));
        let got = (starts != 0).then(|| starts.trailing_zeros() as usize / 8);
        assert_eq!(got, want, "{bytes:?}");
    }
}

#[test]
fn texts_each_of_a_shape_of_its_own_do_not_push_out_the_shapes_in_use() {
    let mut memo = ShapeMemo::default();
    let used = "SELECT * FROM users WHERE id = 1";
    for _ in 0..2 {
        same_as_lexer(&mut memo, used.as_bytes(), true, false);
    }
    // IN lists of every length, each a shape seen once, in the same bucket as the one used:
    // more of them between two uses than a bucket keeps shapes.
    for round in 0..20 {
        for len in 1..10 {
            let list = vec!["1"; round * 10 + len].join(", ");
            let sql = format!("SELECT * FROM users WHERE id IN ({list})");
            same_as_lexer(&mut memo, sql.as_bytes(), true, len % 2 == 0);
        }
        assert!(same_as_lexer(&mut memo, used.as_bytes(), true, false));
    }
}

#[test]
fn a_slot_is_handed_back_only_for_texts_of_the_key_it_was_filled_for() {
    // The slot keeps the key it was filled with; whenever the memo hands it back, the text
    // must have had that key appended.
    let mut memo: ShapeMemo<Option<Vec<u8>>> = ShapeMemo::default();
    // One bucket (the same first 16 bytes) with more shapes than it keeps, so shapes are
    // evicted and learnt again; plus keys that differ only after a literal.
    let shapes = [
        "SELECT abalance FROM t1 WHERE aid = {}",
        "SELECT abalance FROM t2 WHERE aid = {}",
        "SELECT abalance FROM t3 WHERE aid = {}",
        "SELECT abalance FROM t4 WHERE aid = {}",
        "SELECT abalance FROM t5 WHERE aid = {}",
        "SELECT abalance FROM t1 WHERE aid = {} AND x = 1",
        "SELECT abalance FROM t1 WHERE aid = {} AND x = 'a'",
        "SELECT set_config('app.a', {}, false)",
        "SELECT set_config('app.b', {}, false)",
    ];
    let (mut handed, mut filled_and_handed) = (0, 0);
    for round in 0..40 {
        for (i, shape) in shapes.iter().enumerate() {
            // Some texts twice in a row, so their shapes are learnt, and evicted by others.
            for repeat in 0..1 + (round + i) % 2 {
                let sql = shape.replace("{}", &(round * 7 + i + repeat).to_string());
                let mut key = Vec::new();
                let (_, slot) = memo.lex_with_slot(sql.as_bytes(), true, &mut key, None);
                let Some(slot) = slot else { continue };
                handed += 1;
                match slot {
                    Some(kept) => {
                        filled_and_handed += 1;
                        assert_eq!(kept, &key, "a slot of another key for {sql:?}");
                    }
                    None => *slot = Some(key),
                }
            }
        }
    }
    assert!(filled_and_handed >= 50 && handed > filled_and_handed);
    // A learnt shape's slot starts empty.
    let mut memo: ShapeMemo<u32> = ShapeMemo::default();
    let mut key = Vec::new();
    for expected in [None, Some(0), Some(1), Some(2)] {
        key.clear();
        let (_, slot) = memo.lex_with_slot(b"SELECT 1", true, &mut key, None);
        assert_eq!(slot.as_deref().copied(), expected);
        if let Some(slot) = slot {
            *slot += 1;
        }
    }
}
