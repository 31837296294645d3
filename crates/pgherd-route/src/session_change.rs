//! Whether a statement text may change the session's settings, told from its first word and
//! its `;`s. The lexer runs it on a statement's key (`Lexed::may_change_session`); the proxy
//! runs it on texts nothing routed.

/// Could `sql` change session settings? A cheap test: only then is the text kept and, if the
/// server says it set something, parsed. It may say yes for a text that changes nothing,
/// never no for one that changes something.
pub fn may_change_session(sql: &[u8]) -> bool {
    let rest = &sql[crate::skip_blanks(sql, 0)..];
    starts_with_session_command(rest) || holds_more_than_one_statement(rest)
}

/// Whether the text starts with a command that can change settings: `SET`, `RESET`,
/// `DISCARD`, and the savepoint commands too (a `ROLLBACK TO` undoes the settings made since
/// its savepoint). Runs on every statement, most of which start with none of these: the first
/// letters pick the one word to compare.
fn starts_with_session_command(rest: &[u8]) -> bool {
    let letter = |i: usize| rest.get(i).map_or(0, u8::to_ascii_lowercase);
    let word: &[u8] = match (letter(0), letter(1)) {
        (b's', b'e') => b"set",
        (b's', b'a') => b"savepoint",
        (b'r', b'e') if letter(2) == b'l' => b"release",
        (b'r', b'e') => b"reset",
        (b'r', b'o') => b"rollback",
        (b'd', _) => b"discard",
        (b'a', _) => b"abort",
        _ => return false,
    };
    rest.get(..word.len())
        .is_some_and(|head| head.eq_ignore_ascii_case(word))
        && rest
            .get(word.len())
            .is_none_or(|b| !b.is_ascii_alphanumeric() && *b != b'_')
}

/// Several statements in one query: any of them could be a `SET`. True when a `;` comes before
/// the last byte that is neither blank nor `;`, as in `SELECT 1; SET x = 1` but not
/// `SELECT 1;`. From the end first: most texts end in their statement or its `;`, so the
/// search for a `;` covers the text once.
fn holds_more_than_one_statement(rest: &[u8]) -> bool {
    let end = rest
        .iter()
        .rposition(|b| !b.is_ascii_whitespace() && *b != b';')
        .map_or(0, |last| last + 1);
    memchr::memchr(b';', &rest[..end]).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capture_check() {
        for (sql, expected) in [
            ("SET search_path = a", true),
            ("  /* pgherd:primary */ set work_mem='1MB'", true),
            ("-- hi\nRESET ALL", true),
            ("discard all", true),
            ("SELECT 1", false),
            ("UPDATE t SET a = 1", false),
            ("settings_table", false),
            ("SELECT 1;", false),
            ("SELECT 1; SET x = 1", true),
            // As PostgreSQL 16 reads them: a vertical tab is space, a line comment ends at a
            // carriage return too, block comments nest.
            ("\x0bSET x = 1", true),
            ("-- hi\rSET x = 1", true),
            ("/* a /* b */ c */ SET x = 1", true),
            ("/* a /* b */ SET x = 1", false),
        ] {
            assert_eq!(may_change_session(sql.as_bytes()), expected, "{sql}");
        }
    }

    /// The check written plainly (every word compared whole, the `;` searched from the
    /// start): the one that runs must answer as it does for every text.
    fn may_change_session_reference(sql: &[u8]) -> bool {
        let rest = &sql[crate::skip_blanks(sql, 0)..];
        let starts_with = |word: &[u8]| {
            rest.len() >= word.len()
                && rest[..word.len()].eq_ignore_ascii_case(word)
                && rest
                    .get(word.len())
                    .is_none_or(|b| !b.is_ascii_alphanumeric() && *b != b'_')
        };
        let words: [&[u8]; 7] = [
            b"set",
            b"savepoint",
            b"reset",
            b"release",
            b"rollback",
            b"discard",
            b"abort",
        ];
        if words.iter().any(|w| starts_with(w)) {
            return true;
        }
        match rest.iter().position(|b| *b == b';') {
            Some(i) => rest[i + 1..]
                .iter()
                .any(|b| !b.is_ascii_whitespace() && *b != b';'),
            None => false,
        }
    }

    #[test]
    fn the_capture_check_answers_as_the_plain_one_for_any_text() {
        // Pieces that meet at every boundary the check looks at: words and their prefixes in
        // either case, name characters after them, blanks, comments, semicolons, bytes above
        // ASCII.
        let pieces: &[&[u8]] = &[
            b"set",
            b"SET",
            b"Se",
            b"savepoint",
            b"SAVE",
            b"reset",
            b"RESET",
            b"re",
            b"release",
            b"REL",
            b"rollback",
            b"RO",
            b"discard",
            b"d",
            b"abort",
            b"A",
            b"RELEASE",
            b"ROLLBACK",
            b"SAVEPOINT",
            b"DISCARD",
            b"ABORT",
            b"select",
            b"e",
            b"l",
            b"t",
            b"_",
            b"1",
            b" ",
            b"\t",
            b"\n",
            b"\r",
            b"\x0b",
            b"\x0c",
            b";",
            b";;",
            b"-- c\n",
            b"/* c */",
            b"/*",
            b"*/",
            b"\xc3\xa9",
            b"x",
        ];
        let mut next = crate::xorshift(20261207);
        for _ in 0..200_000 {
            let mut sql = Vec::new();
            for _ in 0..next() % 7 {
                sql.extend_from_slice(pieces[next() as usize % pieces.len()]);
            }
            assert_eq!(
                may_change_session(&sql),
                may_change_session_reference(&sql),
                "{:?}",
                String::from_utf8_lossy(&sql)
            );
        }
    }
}
