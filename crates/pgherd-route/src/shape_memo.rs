//! Statement shapes already lexed, so that a text the lexer has seen before up to its literals'
//! values is not lexed again. An application sends a few hundred statement texts over and over
//! with only the values changing (pgbench's TPC-B: seven), and the lexer, at about 28
//! instructions per byte, was a tenth of everything pgherd did per transaction.
//!
//! A shape is a text the lexer read whole: its fixed stretches, and between them each literal's
//! kind (a number starting with a digit, one starting with `.`, or a plain `'...'` string). A
//! new text has that shape when its bytes equal the fixed stretches and, where each literal
//! stood, a literal of the same kind starts and ends by the lexer's own rules
//! ([`lexer::number_end`], a quoted string without backslashes or continuation). Then the
//! lexer would read it token for token as it read the shape: the fixed bytes are the same, the
//! literal starts with a byte of the same class (so the token before it ends where it ended),
//! and what follows each literal is the same fixed bytes, which ended it in the shape. It gets
//! the shape's key and findings, and its own literals' spans.
//!
//! Only shapes whose key is exactly their fixed stretches with a marker per literal are kept:
//! a literal the key keeps as written (a setting's name in `set_config('name', ...)`), a
//! dollar-quoted, prefixed (`E'...'`, `B'...'`, `U&'...'`) or continued string, or a text the
//! lexer found uncacheable or dependent on settings is lexed every time, as before.
//!
//! Each shape also carries a slot of the caller's (`T`), empty when the shape is learnt: what
//! the caller derived from the shape's key, kept where the next text of the shape finds it
//! without looking the key up again (the proxy keeps its routing decision there).
//!
//! Pure: no IO, no clock; the proxy keeps one memo per worker thread.

use crate::lexer::{self, Lexed, MARK};

/// Texts longer than this are lexed every time, not remembered.
const TEXT_MAX_BYTES: usize = 1024;
/// Buckets (a power of two) by a text's first bytes, and shapes kept per bucket: at most
/// 1,024 shapes, a few hundred kB per worker with texts of typical length.
const BUCKET_BITS: u32 = 8;
const SHAPES_PER_BUCKET: usize = 4;
/// Keys remembered per bucket as lexed once, to learn a shape when one comes again.
const RECENT_MISSES: usize = 4;
/// How many leading bytes choose a bucket, stopping before the first byte that may start a
/// literal, so every text of one shape lands in the shape's bucket.
const PREFIX_BYTES: usize = 16;
/// Multiplier that spreads a word's bits upwards, for the bucket hash and the fingerprint.
const MIX: u64 = 0x9e37_79b9_7f4a_7c15;

/// A literal's kind in a shape, by its first byte: the token before a literal ends according
/// to the literal's first byte, so a text must start its literal with a byte of the same class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Literal {
    /// `7`, `1.5`, `2e10`.
    Number,
    /// `.5`.
    Fraction,
    /// `'...'`, with `''` inside and no backslash.
    Quoted,
}

impl Literal {
    fn starting(first: u8) -> Option<Literal> {
        match first {
            b'0'..=b'9' => Some(Literal::Number),
            b'.' => Some(Literal::Fraction),
            b'\'' => Some(Literal::Quoted),
            _ => None,
        }
    }

    /// The lexer's marker kind for this literal.
    fn mark(self) -> u8 {
        match self {
            Literal::Number | Literal::Fraction => b'N',
            Literal::Quoted => b'S',
        }
    }

    /// Where a literal of this kind starting at `at` ends, if one does and the lexer would
    /// read it as this memo reads it.
    fn end_in(self, sql: &[u8], at: usize) -> Option<usize> {
        let first = *sql.get(at)?;
        match self {
            Literal::Number if first.is_ascii_digit() => Self::number_end(sql, at),
            Literal::Fraction
                if first == b'.' && sql.get(at + 1).is_some_and(u8::is_ascii_digit) =>
            {
                Self::number_end(sql, at)
            }
            Literal::Quoted if first == b'\'' => plain_string_end(sql, at),
            _ => None,
        }
    }

    fn number_end(sql: &[u8], at: usize) -> Option<usize> {
        let end = lexer::number_end(sql, at);
        // Trailing junk (`1for`) makes a text uncacheable: left to the lexer.
        (!sql.get(end).copied().is_some_and(lexer::is_ident_start)).then_some(end)
    }
}

/// The end of a standard string starting at the quote `at`, with `''` inside: `None` for
/// what the memo leaves to the lexer (a backslash, whose meaning depends on settings; no
/// closing quote; a continuation on a later line).
fn plain_string_end(sql: &[u8], at: usize) -> Option<usize> {
    let mut i = at + 1;
    loop {
        match *sql.get(i)? {
            b'\\' => return None,
            b'\'' if sql.get(i + 1) == Some(&b'\'') => i += 2,
            b'\'' => {
                i += 1;
                return lexer::continuation(sql, i).is_none().then_some(i);
            }
            _ => i += 1,
        }
    }
}

/// Reused by every attempt to learn a shape, so one that makes none allocates nothing.
#[derive(Debug, Default)]
struct Scratch {
    /// The key the fixed stretches and markers give, to compare with the lexer's.
    rebuilt: Vec<u8>,
    literals: Vec<(usize, usize, Literal)>,
}

#[derive(Debug)]
struct Shape<T> {
    text: Box<[u8]>,
    /// Per literal: the fixed stretch of `text` before it, and its kind.
    literals: Box<[(usize, usize, Literal)]>,
    /// Where the fixed stretch after the last literal starts in `text`.
    tail: usize,
    key: Box<[u8]>,
    lexed: Lexed,
    standard_conforming_strings: bool,
    slot: T,
}

impl<T: Default> Shape<T> {
    /// The shape of `sql`, which the lexer read with `lexed`, `key` and `spans`, if a text
    /// can be matched against it.
    fn learn(
        sql: &[u8],
        standard_conforming_strings: bool,
        lexed: &Lexed,
        key: &[u8],
        spans: &[(usize, usize)],
        scratch: &mut Scratch,
    ) -> Option<Shape<T>> {
        if !lexed.cacheable || lexed.strings_depend_on_settings || sql.len() > TEXT_MAX_BYTES {
            return None;
        }
        let Scratch { rebuilt, literals } = scratch;
        rebuilt.clear();
        literals.clear();
        let mut from = 0;
        for &(start, end) in spans {
            let literal = Literal::starting(*sql.get(start)?)?;
            if start < from || literal.end_in(sql, start) != Some(end) {
                return None;
            }
            rebuilt.extend_from_slice(&sql[from..start]);
            rebuilt.extend_from_slice(&[MARK, literal.mark()]);
            literals.push((from, start, literal));
            from = end;
        }
        rebuilt.extend_from_slice(sql.get(from..)?);
        // A literal kept in the key as written, or text the key leaves out, would make the
        // key depend on more than the fixed stretches: not a shape.
        if rebuilt.as_slice() != key {
            return None;
        }
        Some(Shape {
            text: sql.into(),
            literals: literals.as_slice().into(),
            tail: from,
            key: key.into(),
            lexed: lexed.clone(),
            standard_conforming_strings,
            slot: T::default(),
        })
    }

    /// Whether `sql` has this shape; its literals' spans are pushed to `spans` as found (the
    /// caller drops them when it has not).
    fn matches(&self, sql: &[u8], mut spans: Option<&mut Vec<(usize, usize)>>) -> bool {
        let mut at = 0;
        for &(from, to, literal) in self.literals.iter() {
            let fixed = &self.text[from..to];
            if sql.get(at..at + fixed.len()) != Some(fixed) {
                return false;
            }
            at += fixed.len();
            let Some(end) = literal.end_in(sql, at) else {
                return false;
            };
            if let Some(spans) = spans.as_deref_mut() {
                spans.push((at, end));
            }
            at = end;
        }
        sql.get(at..) == Some(&self.text[self.tail..])
    }
}

/// The bucket a text's shape is kept in: a hash of its first bytes up to the first one that
/// may start a literal. Those bytes are fixed text of the shape, equal in every text of it.
fn bucket_of(sql: &[u8]) -> usize {
    let limit = sql.len().min(PREFIX_BYTES);
    let mut bytes = [0u8; PREFIX_BYTES];
    bytes[..limit].copy_from_slice(&sql[..limit]);
    let (low, high) = bytes.split_at(8);
    let low = u64::from_le_bytes(low.try_into().unwrap_or_default());
    let high = u64::from_le_bytes(high.try_into().unwrap_or_default());
    // Zero bytes past the text start no literal, so the first start found is within it.
    let prefix_len = match (literal_starts(low), literal_starts(high)) {
        (0, 0) => limit,
        (0, in_high) => 8 + in_high.trailing_zeros() as usize / 8,
        (in_low, _) => in_low.trailing_zeros() as usize / 8,
    };
    let keep = |word: u64, len: usize| match len {
        0 => 0,
        1..=7 => word & ((1u64 << (8 * len)) - 1),
        _ => word,
    };
    let low = keep(low, prefix_len);
    let high = keep(high, prefix_len.saturating_sub(8));
    let hash = (low ^ high.rotate_left(29).wrapping_mul(MIX) ^ prefix_len as u64).wrapping_mul(MIX);
    (hash >> (64 - BUCKET_BITS)) as usize
}

/// The high bit of each byte of `word` that is a digit, `.` or `'` (the bytes a literal may
/// start with), eight bytes at a time. A byte above a set one may be set wrongly (a borrow
/// runs upwards), so only the lowest set bit is to be trusted.
pub(crate) fn literal_starts(word: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let below = |x: u64, n: u64| x.wrapping_sub(ONES * n) & !x & HIGH;
    let digits = below(word ^ (ONES * u64::from(b'0')), 10);
    let dots = below(word ^ (ONES * u64::from(b'.')), 1);
    let quotes = below(word ^ (ONES * u64::from(b'\'')), 1);
    digits | dots | quotes
}

/// Whether `key` was lexed in this bucket among its last few misses; notes it if not.
fn missed_before(recent: &mut [u64; RECENT_MISSES], key: &[u8]) -> bool {
    let fingerprint = fingerprint(key);
    if recent.contains(&fingerprint) {
        return true;
    }
    recent.rotate_right(1);
    recent[0] = fingerprint;
    false
}

/// A hash of a key, eight bytes at a time, never 0 (an empty slot). Two keys that share it
/// only make a shape learnt one sighting early.
fn fingerprint(key: &[u8]) -> u64 {
    let mut hash = (key.len() as u64).wrapping_mul(MIX);
    let mut words = key.chunks_exact(8);
    for word in &mut words {
        let word = u64::from_le_bytes(word.try_into().unwrap_or_default());
        hash = (hash.rotate_left(5) ^ word).wrapping_mul(MIX);
    }
    let mut rest = [0u8; 8];
    rest[..words.remainder().len()].copy_from_slice(words.remainder());
    hash = (hash.rotate_left(5) ^ u64::from_le_bytes(rest)).wrapping_mul(MIX);
    hash | 1
}

/// Shapes seen, for [`ShapeMemo::lex`], each with a slot of type `T` for the caller.
#[derive(Debug)]
pub struct ShapeMemo<T = ()> {
    buckets: Box<[Vec<Shape<T>>]>,
    /// Per bucket, fingerprints of the last keys lexed there without a shape.
    recent_misses: Box<[[u64; RECENT_MISSES]]>,
    spans: Vec<(usize, usize)>,
    scratch: Scratch,
    hits: u64,
    misses: u64,
}

impl<T> Default for ShapeMemo<T> {
    fn default() -> Self {
        ShapeMemo {
            buckets: (0..1usize << BUCKET_BITS).map(|_| Vec::new()).collect(),
            recent_misses: vec![[0; RECENT_MISSES]; 1 << BUCKET_BITS].into(),
            spans: Vec::new(),
            scratch: Scratch::default(),
            hits: 0,
            misses: 0,
        }
    }
}

impl<T: Default> ShapeMemo<T> {
    /// What [`lexer::lex`] gives (with `spans`, [`lexer::lex_with_spans`]): the same key
    /// appended to `key`, the same spans pushed, the same findings; from a remembered shape
    /// when `sql` has one.
    pub fn lex(
        &mut self,
        sql: &[u8],
        standard_conforming_strings: bool,
        key: &mut Vec<u8>,
        spans: Option<&mut Vec<(usize, usize)>>,
    ) -> Lexed {
        self.lex_with_slot(sql, standard_conforming_strings, key, spans)
            .0
    }

    /// [`Self::lex`], and the slot of the shape kept for `sql`'s key: the one `sql` matched,
    /// or the one just learnt from it; `None` when no shape is kept for it. Every text a
    /// slot is given for had the same key appended.
    pub fn lex_with_slot(
        &mut self,
        sql: &[u8],
        standard_conforming_strings: bool,
        key: &mut Vec<u8>,
        mut spans: Option<&mut Vec<(usize, usize)>>,
    ) -> (Lexed, Option<&mut T>) {
        let spans_before = spans.as_ref().map_or(0, |spans| spans.len());
        let bucket = bucket_of(sql);
        let shapes = &self.buckets[bucket];
        let matched = shapes.iter().position(|shape| {
            let matches = shape.standard_conforming_strings == standard_conforming_strings
                && shape.matches(sql, spans.as_deref_mut());
            if !matches {
                if let Some(spans) = spans.as_deref_mut() {
                    spans.truncate(spans_before);
                }
            }
            matches
        });
        if let Some(i) = matched {
            let shapes = &mut self.buckets[bucket];
            // The most used shapes come first. (A shape is large: a swap with itself would
            // copy it three times.)
            if i > 0 {
                shapes.swap(0, i);
            }
            let shape = &mut shapes[0];
            key.extend_from_slice(&shape.key);
            self.hits += 1;
            return (shape.lexed.clone(), Some(&mut shape.slot));
        }
        self.misses += 1;
        let key_before = key.len();
        let spans = match spans {
            Some(spans) => spans,
            None => {
                self.spans.clear();
                &mut self.spans
            }
        };
        let lexed = lexer::lex_with_spans(sql, standard_conforming_strings, key, spans);
        let key = &key[key_before..];
        // A shape is learnt the second time its key is lexed: texts of a kind seen once
        // (ad hoc queries, lists of every length) would only churn the memo.
        if !missed_before(&mut self.recent_misses[bucket], key) {
            return (lexed, None);
        }
        if let Some(shape) = Shape::learn(
            sql,
            standard_conforming_strings,
            &lexed,
            key,
            &spans[spans_before..],
            &mut self.scratch,
        ) {
            let shapes = &mut self.buckets[bucket];
            if shapes.len() >= SHAPES_PER_BUCKET {
                shapes.pop();
            }
            shapes.insert(0, shape);
            return (lexed, Some(&mut shapes[0].slot));
        }
        (lexed, None)
    }
}

impl<T> ShapeMemo<T> {
    /// Texts answered from a remembered shape, and texts lexed.
    pub fn counts(&self) -> (u64, u64) {
        (self.hits, self.misses)
    }
}
