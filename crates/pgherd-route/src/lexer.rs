//! One pass over a statement's text, following PostgreSQL's own scanner (`scan.l`), that gives
//! the *key* routing decisions are cached under (the text with every literal's value replaced
//! by a marker, so `... WHERE aid = 7` and `... WHERE aid = 8` share a decision), the routing
//! hints found in comments (`/* pgherd:replica */`, `/* pgherd:shard=1 */`), and an estimate of how deeply the
//! statement nests, to skip parses that could only fail.
//!
//! Safety rests on one property: two texts with the same key are the same token stream for
//! PostgreSQL, up to the values of literals. So the lexer must see every literal, comment and
//! quoted identifier exactly where the server does: E-strings only where `E` starts a token,
//! backslashes by `standard_conforming_strings`, string continuation across newlines, dollar
//! quotes only at a token start. A text it cannot lex as the server would (unterminated
//! literals, trailing junk after a number) gets no key and is classified afresh every time.
//! The differential test in `tests.rs` checks literal boundaries against the parser library's
//! own scanner.

use smallvec::SmallVec;

use crate::Route;

/// A hint that names no known route or shard.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid pgherd hint \"pgherd:{value}\"; allowed values are primary, replica, cache, nocache and shard=N")]
pub struct HintError {
    pub value: String,
}

/// What the lexer learned about a statement text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lexed {
    /// The last `pgherd:primary` or `pgherd:replica` hint in a comment, if any.
    pub hint: Result<Option<Route>, HintError>,
    /// The last `pgherd:shard=N` hint in a comment, if any: the shard a sharded endpoint
    /// runs the statement on.
    pub shard: Result<Option<u32>, HintError>,
    /// The last `pgherd:cache` (`Some(true)`) or `pgherd:nocache` (`Some(false)`) hint: keep
    /// the answer in the result cache, or do not even where the config says to.
    pub cache: Option<bool>,
    /// False when the key must not be used: the text does not lex as the server would
    /// accept it.
    pub cacheable: bool,
    /// The server may read the text's strings otherwise than the parser library: a standard
    /// string (`'...'`) holds a backslash (its meaning depends on
    /// `standard_conforming_strings`, which a statement pipelined just before may change), or
    /// a backslash follows a non-ASCII byte (in a client-only encoding such as SJIS it may be
    /// half of a character). Such a text gets no key and is not parsed.
    pub strings_depend_on_settings: bool,
    /// A lower bound on how deeply the expression tree nests: operator chains, summed over
    /// enclosing parentheses.
    pub nesting_estimate: usize,
    /// Tokens naming `set_config`: how many calls of it the text can hold at most.
    pub set_config_names: usize,
    /// Tokens naming `current_setting`, likewise.
    pub current_setting_names: usize,
    /// [`crate::may_change_session`] of the key (a `;` in a literal is no second statement),
    /// or of the text itself when the key does not stand for it. Found once per shape: a
    /// shape's texts differ only in their literals.
    pub may_change_session: bool,
}

/// Marks a literal in the key. No SQL text contains a NUL byte (the protocol ends query
/// strings with one), so a marker can never equal text.
pub(crate) const MARK: u8 = 0;

/// The token the lexer saw last, as far as operator chains are concerned.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Last {
    /// Start of a statement, after `,` `;` or an opening parenthesis.
    Boundary,
    Operand,
    Operator,
    /// `.` between the parts of a qualified name.
    Glue,
}

struct Lexer<'a> {
    sql: &'a [u8],
    at: usize,
    key: &'a mut Vec<u8>,
    /// The key holds the text up to here: text between literals is copied in one piece
    /// when the next literal, quoted name or comment (or the end) comes, not token by token.
    copied: usize,
    standard_strings: bool,
    out: Lexed,
    /// Operator run per open parenthesis, innermost last.
    runs: SmallVec<[usize; 8]>,
    run: usize,
    last: Last,
    /// Where the lexer stands in `set_config(` / `current_setting(`: their first argument, a
    /// setting's name, decides what the statement does, so it stays in the key.
    setting_call: SettingCall,
    /// The token being read is a setting's name in such a call.
    naming_setting: bool,
    /// Where each literal starts and ends, for the differential test against the scanner.
    spans: Option<&'a mut Vec<(usize, usize)>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum SettingCall {
    None,
    /// The function's name was the last token.
    Named,
    /// Its opening parenthesis was: the next token is the setting's name.
    Opened,
}

/// Appends `sql`'s key to `key` (which the caller clears) and says what else it saw.
/// `standard_conforming_strings` is the session's setting.
pub fn lex(sql: &[u8], standard_conforming_strings: bool, key: &mut Vec<u8>) -> Lexed {
    lex_inner(sql, standard_conforming_strings, key, None)
}

/// [`lex`], also listing each literal's byte range.
pub fn lex_with_spans(
    sql: &[u8],
    standard_conforming_strings: bool,
    key: &mut Vec<u8>,
    spans: &mut Vec<(usize, usize)>,
) -> Lexed {
    lex_inner(sql, standard_conforming_strings, key, Some(spans))
}

/// Where the statement text from `at` on really starts: past whitespace and comments as
/// PostgreSQL's scanner reads them (`--` to the end of the line, either end; `/* */` nested;
/// vertical tab as space, as PostgreSQL 16 reads it, a text PostgreSQL 15 refuses anyway).
/// For the few places that look at a statement's first words without lexing it whole.
pub fn skip_blanks(sql: &[u8], mut at: usize) -> usize {
    // Most texts start with their first word: a letter is neither blank nor a comment's start.
    if sql.get(at).is_some_and(u8::is_ascii_alphabetic) {
        return at;
    }
    loop {
        while sql.get(at).copied().is_some_and(is_space) {
            at += 1;
        }
        let rest = sql.get(at..).unwrap_or_default();
        if rest.starts_with(b"--") {
            at += rest
                .iter()
                .position(|&b| b == b'\n' || b == b'\r')
                .unwrap_or(rest.len());
        } else if rest.starts_with(b"/*") {
            let mut depth = 0usize;
            loop {
                match sql.get(at..at + 2) {
                    Some(b"/*") => {
                        depth += 1;
                        at += 2;
                    }
                    Some(b"*/") => {
                        depth -= 1;
                        at += 2;
                        if depth == 0 {
                            break;
                        }
                    }
                    Some(_) => at += 1,
                    // Unterminated: nothing of the text is a statement.
                    None => return sql.len(),
                }
            }
        } else {
            return at;
        }
    }
}

fn lex_inner<'a>(
    sql: &'a [u8],
    standard_conforming_strings: bool,
    key: &'a mut Vec<u8>,
    spans: Option<&'a mut Vec<(usize, usize)>>,
) -> Lexed {
    let mut lexer = Lexer {
        sql,
        at: 0,
        key,
        copied: 0,
        standard_strings: standard_conforming_strings,
        out: Lexed {
            hint: Ok(None),
            shard: Ok(None),
            cache: None,
            cacheable: true,
            strings_depend_on_settings: false,
            nesting_estimate: 0,
            set_config_names: 0,
            current_setting_names: 0,
            may_change_session: false,
        },
        runs: SmallVec::new(),
        run: 0,
        last: Last::Boundary,
        setting_call: SettingCall::None,
        naming_setting: false,
        spans,
    };
    let key_start = lexer.key.len();
    lexer.run();
    let mut out = lexer.out;
    out.may_change_session = if out.cacheable {
        crate::may_change_session(&lexer.key[key_start..])
    } else {
        crate::may_change_session(sql)
    };
    out
}

// Byte classes, one table lookup per byte in the hot loops (a chain of range tests per byte
// was a fifth of the lexer's instructions).
const SPACE: u8 = 1;
const IDENT_START: u8 = 1 << 1;
const IDENT_CONT: u8 = 1 << 2;
const DOLLAR_TAG_CONT: u8 = 1 << 3;
const OP_CHAR: u8 = 1 << 4;

const fn class_of(b: u8) -> u8 {
    let mut class = 0;
    if matches!(b, b' ' | b'\t' | b'\n' | b'\r' | b'\x0c' | b'\x0b') {
        class |= SPACE;
    }
    if b.is_ascii_alphabetic() || b == b'_' || b >= 0x80 {
        class |= IDENT_START | IDENT_CONT | DOLLAR_TAG_CONT;
    }
    if b.is_ascii_digit() {
        class |= IDENT_CONT | DOLLAR_TAG_CONT;
    }
    if b == b'$' {
        class |= IDENT_CONT;
    }
    if matches!(
        b,
        b'~' | b'!'
            | b'@'
            | b'#'
            | b'^'
            | b'&'
            | b'|'
            | b'`'
            | b'?'
            | b'+'
            | b'-'
            | b'*'
            | b'/'
            | b'%'
            | b'<'
            | b'>'
            | b'='
    ) {
        class |= OP_CHAR;
    }
    class
}

static CLASSES: [u8; 256] = {
    let mut table = [0; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = class_of(b as u8);
        b += 1;
    }
    table
};

fn is(class: u8, b: u8) -> bool {
    CLASSES[usize::from(b)] & class != 0
}

pub(crate) fn is_ident_start(b: u8) -> bool {
    is(IDENT_START, b)
}

fn is_dollar_tag_cont(b: u8) -> bool {
    is(DOLLAR_TAG_CONT, b)
}

fn is_op_char(b: u8) -> bool {
    is(OP_CHAR, b)
}

fn is_space(b: u8) -> bool {
    is(SPACE, b)
}

/// How a quoted string treats backslashes and doubled quotes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Quoting {
    /// `'...'`: `''` is a quote; backslashes as `standard_conforming_strings` says.
    Standard,
    /// `E'...'`: backslash escapes and `''`.
    Escape,
    /// `B'...'`, `X'...'`: the first quote ends them.
    Bits,
}

impl Lexer<'_> {
    fn peek(&self, offset: usize) -> Option<u8> {
        self.sql.get(self.at + offset).copied()
    }

    fn starts_with(&self, s: &[u8]) -> bool {
        self.sql[self.at..].starts_with(s)
    }

    /// Copies the text not copied yet, up to `to`, as written. Not case-folded: `SELECT` and
    /// `select` get keys of their own, each safe, and an application sends its statements
    /// the same way every time; folding was a fifth of the lexer's instructions.
    fn flush(&mut self, to: usize) {
        self.key.extend_from_slice(&self.sql[self.copied..to]);
        self.copied = to;
    }

    /// The token from `start` to the cursor goes into the key as written (a quoted name keeps
    /// its case; a comment its text).
    fn copy_as_written(&mut self, start: usize) {
        self.flush(start);
        self.key.extend_from_slice(&self.sql[start..self.at]);
        self.copied = self.at;
    }

    /// The literal from `start` to the cursor becomes a marker of its kind, unless it names a
    /// setting (`set_config('name', ...)`): such a literal stays as written. Its quotes keep it
    /// apart from any other text, as a quote outside a literal cannot occur.
    /// `value_start` is where the literal's value starts (its quote, after a prefix such as
    /// `E`, which stays in the key).
    fn mark(&mut self, start: usize, value_start: usize, kind: u8) {
        if self.naming_setting && kind == b'S' && self.sql[start] == b'\'' {
            self.copy_as_written(start);
        } else {
            self.flush(value_start);
            self.key.extend_from_slice(&[MARK, kind]);
            self.copied = self.at;
        }
        if let Some(spans) = self.spans.as_mut() {
            spans.push((start, self.at));
        }
    }

    fn uncacheable(&mut self) {
        self.out.cacheable = false;
    }

    fn operand(&mut self) {
        if self.last == Last::Operand {
            // Two operands in a row (`1 AND`, `THEN 'x'`): no operator chain runs through.
            self.run = 0;
        }
        self.last = Last::Operand;
    }

    fn operator(&mut self) {
        self.run += 1;
        self.last = Last::Operator;
        let depth = self.runs.iter().sum::<usize>() + self.run;
        self.out.nesting_estimate = self.out.nesting_estimate.max(depth);
    }

    fn boundary(&mut self) {
        self.run = 0;
        self.last = Last::Boundary;
    }

    fn run(&mut self) {
        self.scan();
        self.flush(self.sql.len());
    }

    fn scan(&mut self) {
        let sql = self.sql;
        while let Some(&c) = sql.get(self.at) {
            // Space and words first, by byte class: they are most of any statement's tokens.
            let class = CLASSES[usize::from(c)];
            if class & SPACE != 0 {
                self.at += 1;
                while sql.get(self.at).copied().is_some_and(is_space) {
                    self.at += 1;
                }
                continue;
            }
            if class & IDENT_START != 0 {
                self.significant_token(c);
                self.identifier();
                continue;
            }
            match c {
                b'-' if self.peek(1) == Some(b'-') => {
                    self.line_comment();
                    continue;
                }
                b'/' if self.peek(1) == Some(b'*') => {
                    self.block_comment();
                    continue;
                }
                _ => {}
            }
            self.significant_token(c);
            let start = self.at;
            match c {
                b'\'' => {
                    self.operand();
                    self.string(start, Quoting::Standard, b'S')
                }
                b'"' => {
                    self.operand();
                    self.quoted_identifier();
                }
                b'$' => self.dollar(),
                b'0'..=b'9' => {
                    self.operand();
                    self.number();
                }
                b'.' if self.peek(1).is_some_and(|b| b.is_ascii_digit()) => {
                    self.operand();
                    self.number();
                }
                b'.' if self.peek(1) == Some(b'.') => {
                    // `..`, one token of its own (a range in PL/pgSQL).
                    self.at += 2;
                }
                c if is_op_char(c) => {
                    // An operator ends where a comment starts.
                    while self.peek(0).is_some_and(is_op_char)
                        && !self.starts_with(b"--")
                        && !self.starts_with(b"/*")
                    {
                        self.at += 1;
                    }
                    self.operator();
                }
                _ => {
                    self.at += 1;
                    self.punctuation(c);
                }
            }
        }
    }

    /// A token other than space or a comment starts with `c`: where a `set_config(` or
    /// `current_setting(` call stands.
    fn significant_token(&mut self, c: u8) {
        if self.setting_call == SettingCall::None {
            // Almost every token: no call of either function is being read.
            self.naming_setting = false;
            return;
        }
        let call = std::mem::replace(&mut self.setting_call, SettingCall::None);
        self.naming_setting = call == SettingCall::Opened;
        if self.naming_setting && c != b'\'' {
            // A name pgherd cannot see (an expression, an E-string): the decision would
            // depend on it, so no key.
            self.uncacheable();
        }
        if call == SettingCall::Named && c == b'(' {
            self.setting_call = SettingCall::Opened;
        }
    }

    fn punctuation(&mut self, c: u8) {
        match c {
            b'(' | b'[' => {
                self.runs.push(self.run);
                self.boundary();
            }
            b')' | b']' => {
                self.run = self.runs.pop().unwrap_or(0);
                self.last = Last::Boundary;
                self.operand();
            }
            b',' | b';' => self.boundary(),
            b'.' => self.last = Last::Glue,
            b':' if self.peek(0) == Some(b':') => {
                self.at += 1;
                self.operator();
            }
            _ => {}
        }
    }

    fn line_comment(&mut self) {
        let start = self.at;
        while self.peek(0).is_some_and(|b| b != b'\n' && b != b'\r') {
            self.at += 1;
        }
        self.note_hints(start + 2, self.at);
        self.copy_as_written(start);
    }

    fn block_comment(&mut self) {
        let start = self.at;
        let mut depth = 0usize;
        loop {
            if self.starts_with(b"/*") {
                depth += 1;
                self.at += 2;
            } else if self.starts_with(b"*/") {
                depth -= 1;
                self.at += 2;
                if depth == 0 {
                    break;
                }
            } else if self.peek(0).is_some() {
                self.at += 1;
            } else {
                // Unterminated: the server refuses the statement.
                self.uncacheable();
                break;
            }
        }
        let inner_end = if depth == 0 { self.at - 2 } else { self.at };
        self.note_hints(start + 2, inner_end);
        self.copy_as_written(start);
    }

    fn note_hints(&mut self, from: usize, to: usize) {
        let text = String::from_utf8_lossy(&self.sql[from..to.max(from)]);
        for word in text.split_whitespace() {
            let Some(value) = word.strip_prefix("pgherd:") else {
                continue;
            };
            let invalid = || HintError {
                value: value.to_owned(),
            };
            match value {
                "primary" => self.out.hint = Ok(Some(Route::Primary)),
                "replica" => self.out.hint = Ok(Some(Route::Replica)),
                "cache" => self.out.cache = Some(true),
                "nocache" => self.out.cache = Some(false),
                _ => match value.strip_prefix("shard=") {
                    Some(number) => {
                        self.out.shard = number.parse().map(Some).map_err(|_| invalid())
                    }
                    None => self.out.hint = Err(invalid()),
                },
            }
        }
    }

    /// An identifier or keyword; a one-letter one glued to a quote is a string's prefix
    /// (`E'...'`, `B'...'`, `X'...'`, `N'...'`, `U&'...'`, `U&"..."`), as the scanner's longest
    /// match decides.
    fn identifier(&mut self) {
        let start = self.at;
        let sql = self.sql;
        let mut end = start + 1;
        while sql.get(end).is_some_and(|&b| is(IDENT_CONT, b)) {
            end += 1;
        }
        self.at = end;
        let word = &sql[start..end];
        match word.len() {
            10 if word.eq_ignore_ascii_case(b"set_config") => {
                self.out.set_config_names += 1;
                self.setting_call = SettingCall::Named;
            }
            15 if word.eq_ignore_ascii_case(b"current_setting") => {
                self.out.current_setting_names += 1;
                self.setting_call = SettingCall::Named;
            }
            _ => {}
        }
        if self.last == Last::Glue {
            // The second part of a qualified name continues the same operand.
            self.last = Last::Operand;
        } else {
            self.operand();
        }
        if word.len() == 1 {
            self.string_prefix(start, word[0].to_ascii_lowercase());
        }
    }

    /// After a one-letter word: a string it prefixes, if a quote is glued to it.
    fn string_prefix(&mut self, start: usize, letter: u8) {
        match (letter, self.peek(0)) {
            (b'e', Some(b'\'')) => self.string(start, Quoting::Escape, b'S'),
            (b'b', Some(b'\'')) => self.string(start, Quoting::Bits, b'B'),
            (b'x', Some(b'\'')) => self.string(start, Quoting::Bits, b'X'),
            // `N` is a keyword of its own; the string starts at the quote.
            (b'n', Some(b'\'')) => self.string(self.at, Quoting::Standard, b'S'),
            (b'u', Some(b'&')) if self.peek(1) == Some(b'\'') => {
                self.at += 1;
                // Unicode escapes use the backslash (or UESCAPE) whatever the settings say.
                self.string(start, Quoting::Standard, b'U');
            }
            (b'u', Some(b'&')) if self.peek(1) == Some(b'"') => {
                self.at += 1;
                self.quoted_identifier();
                // The name depends on a UESCAPE literal the key would not see.
                self.uncacheable();
            }
            _ => {}
        }
    }

    /// A quoted string starting at the quote under the cursor, with every continuation (a
    /// quote after whitespace holding a newline continues the same literal); its value
    /// becomes a marker.
    fn string(&mut self, start: usize, quoting: Quoting, kind: u8) {
        let quote = self.at;
        self.at += 1;
        loop {
            match self.peek(0) {
                None => {
                    self.uncacheable();
                    break;
                }
                Some(b'\\') if quoting != Quoting::Bits => {
                    let escapes = quoting == Quoting::Escape || !self.standard_strings;
                    let after_non_ascii = self.at > 0 && self.sql[self.at - 1] >= 0x80;
                    if quoting == Quoting::Standard || after_non_ascii {
                        self.out.strings_depend_on_settings = true;
                        self.uncacheable();
                    }
                    self.at += if escapes { 2 } else { 1 };
                }
                Some(b'\'') if quoting != Quoting::Bits && self.peek(1) == Some(b'\'') => {
                    self.at += 2;
                }
                Some(b'\'') => {
                    self.at += 1;
                    match continuation(self.sql, self.at) {
                        Some(next_quote) => self.at = next_quote + 1,
                        None => break,
                    }
                }
                Some(_) => self.at += 1,
            }
        }
        self.at = self.at.min(self.sql.len());
        self.mark(start, quote, kind);
    }

    fn quoted_identifier(&mut self) {
        let start = self.at;
        self.at += 1;
        loop {
            match self.peek(0) {
                None => {
                    self.uncacheable();
                    break;
                }
                Some(b'"') if self.peek(1) == Some(b'"') => self.at += 2,
                Some(b'"') => {
                    self.at += 1;
                    break;
                }
                Some(_) => self.at += 1,
            }
        }
        // Part of the key as written: quoted names keep their case.
        self.copy_as_written(start);
        match &self.sql[start..self.at] {
            b"\"set_config\"" => {
                self.out.set_config_names += 1;
                self.setting_call = SettingCall::Named;
            }
            b"\"current_setting\"" => {
                self.out.current_setting_names += 1;
                self.setting_call = SettingCall::Named;
            }
            _ => {}
        }
        if self.last == Last::Glue {
            self.last = Last::Operand;
        }
    }

    /// `$1` (a parameter), `$tag$...$tag$` (a dollar-quoted literal), or a lone `$`.
    fn dollar(&mut self) {
        let start = self.at;
        self.operand();
        if self.peek(1).is_some_and(|b| b.is_ascii_digit()) {
            self.at += 1;
            while self.peek(0).is_some_and(|b| b.is_ascii_digit()) {
                self.at += 1;
            }
            if self.peek(0).is_some_and(is_ident_start) {
                // Trailing junk after a parameter: the server refuses it.
                self.uncacheable();
            }
            return;
        }
        let mut end = self.at + 1;
        if self.sql.get(end).copied().is_some_and(is_ident_start) {
            while self.sql.get(end).copied().is_some_and(is_dollar_tag_cont) {
                end += 1;
            }
        }
        if self.sql.get(end) != Some(&b'$') {
            self.at += 1;
            return;
        }
        let tag = &self.sql[start..=end];
        let body = end + 1;
        match self.sql[body..].windows(tag.len()).position(|w| w == tag) {
            Some(i) => self.at = body + i + tag.len(),
            None => {
                self.uncacheable();
                self.at = self.sql.len();
            }
        }
        self.mark(start, start, b'D');
    }

    /// A numeric literal (integer, decimal, real): PostgreSQL 15 refuses trailing junk
    /// such as `1for`, so a number glued to a letter makes the text uncacheable.
    fn number(&mut self) {
        let start = self.at;
        self.at = number_end(self.sql, start);
        if self.peek(0).is_some_and(is_ident_start) {
            self.uncacheable();
        }
        self.mark(start, start, b'N');
    }
}

/// Where a numeric literal starting at `at` (a digit, or a `.` before one) ends: digits, a
/// fraction unless `..` follows, an exponent only when digits follow its sign.
pub(crate) fn number_end(s: &[u8], at: usize) -> usize {
    let digits = |mut i: usize| {
        while i < s.len() && s[i].is_ascii_digit() {
            i += 1;
        }
        i
    };
    let mut i = digits(at);
    if s.get(i) == Some(&b'.') && s.get(i + 1) != Some(&b'.') {
        i = digits(i + 1);
    }
    if matches!(s.get(i), Some(b'e' | b'E')) {
        let sign = usize::from(matches!(s.get(i + 1), Some(b'+' | b'-')));
        if s.get(i + 1 + sign).is_some_and(u8::is_ascii_digit) {
            i = digits(i + 1 + sign);
        }
    }
    i
}

/// Where the next part of a continued string starts (its opening quote), for a string that
/// closed just before `at`: horizontal space, a newline, then any space or `--` comments,
/// then a quote.
pub(crate) fn continuation(s: &[u8], at: usize) -> Option<usize> {
    let mut i = at;
    while i < s.len() && matches!(s[i], b' ' | b'\t' | b'\x0c') {
        i += 1;
    }
    if i >= s.len() || !matches!(s[i], b'\n' | b'\r') {
        return None;
    }
    loop {
        while i < s.len() && is_space(s[i]) {
            i += 1;
        }
        if s[i..].starts_with(b"--") {
            while i < s.len() && s[i] != b'\n' && s[i] != b'\r' {
                i += 1;
            }
            if i >= s.len() {
                return None;
            }
            continue;
        }
        break;
    }
    (s.get(i) == Some(&b'\'')).then_some(i)
}
