//! The rows of a fan-out as a stream, pure: a k-way merge that is offered the shards' rows one
//! at a time and says which shard it needs next ([`KWay`]), so the IO shell reads the shards
//! as the client takes rows and holds one row per shard; and the client's side of the stream
//! ([`Finisher`]: DISTINCT, OFFSET, LIMIT, hidden columns cut), which says when no more rows
//! are wanted. [`Merger::merge_sorted`] and [`Merger::finish`] are these two over iterators.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashSet};

use crate::merge_plan::Column;
use crate::merge_rows::{MergeError, Merger, Row};

/// A k-way merge of sorted shard streams, fed by the caller.
pub struct KWay<'m> {
    merger: &'m Merger,
    heads: BinaryHeap<Head<'m>>,
    /// Per shard: its next row is needed (it has no head and has not ended).
    wanted: Vec<bool>,
    failed: Option<MergeError>,
}

struct Head<'m> {
    row: Row,
    shard: usize,
    merger: &'m Merger,
}

impl PartialEq for Head<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Head<'_> {}
impl PartialOrd for Head<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Head<'_> {
    /// Reversed, so the heap's top is the least row (the earlier shard on ties, for a stable
    /// merge).
    fn cmp(&self, other: &Self) -> Ordering {
        self.merger
            .compare_rows(&other.row, &self.row)
            .then(other.shard.cmp(&self.shard))
    }
}

impl<'m> KWay<'m> {
    /// Over `shards` streams, none read yet.
    pub fn new(merger: &'m Merger, shards: usize) -> KWay<'m> {
        KWay {
            merger,
            heads: BinaryHeap::with_capacity(shards),
            wanted: vec![true; shards],
            failed: None,
        }
    }

    /// The shard whose next row must be offered before the merge can give one; `None`: it
    /// can give one (or every shard ended).
    pub fn wants(&self) -> Option<usize> {
        if self.failed.is_some() {
            return None;
        }
        self.wanted.iter().position(|&wanted| wanted)
    }

    /// Shard `shard`'s next row, or `None` at its end. A row that cannot be read fails the
    /// merge.
    pub fn offer(&mut self, shard: usize, row: Option<Row>) {
        let Some(wanted) = self.wanted.get_mut(shard) else {
            return;
        };
        *wanted = false;
        let Some(row) = row else {
            return;
        };
        if let Err(e) = self.merger.check_row(&row) {
            self.failed.get_or_insert(e);
            return;
        }
        self.heads.push(Head {
            row,
            shard,
            merger: self.merger,
        });
    }

    /// The least row of all, once [`Self::wants`] is `None`; `None` when every shard ended.
    pub fn next_row(&mut self) -> Option<Result<Row, MergeError>> {
        if let Some(e) = self.failed.take() {
            self.heads.clear();
            self.wanted.fill(false);
            return Some(Err(e));
        }
        if self.wanted.iter().any(|&wanted| wanted) {
            return None;
        }
        let Head { row, shard, .. } = self.heads.pop()?;
        self.wanted[shard] = true;
        Some(Ok(row))
    }
}

/// [`KWay`] over iterators: [`Merger::merge_sorted`].
pub struct MergeSorted<'m, I: Iterator<Item = Row>> {
    kway: KWay<'m>,
    shards: Vec<I>,
}

impl<'m, I: Iterator<Item = Row>> MergeSorted<'m, I> {
    pub(crate) fn new(merger: &'m Merger, shards: Vec<I>) -> Self {
        MergeSorted {
            kway: KWay::new(merger, shards.len()),
            shards,
        }
    }
}

impl<I: Iterator<Item = Row>> Iterator for MergeSorted<'_, I> {
    type Item = Result<Row, MergeError>;

    fn next(&mut self) -> Option<Self::Item> {
        while let Some(shard) = self.kway.wants() {
            let row = self.shards[shard].next();
            self.kway.offer(shard, row);
        }
        self.kway.next_row()
    }
}

/// What became of a merged row on its way to the client.
#[derive(Debug, PartialEq, Eq)]
pub enum Taken {
    /// The client gets it (hidden columns cut off).
    Row(Row),
    /// A duplicate (DISTINCT) or within the OFFSET.
    Skipped,
    /// The LIMIT was reached before it: no more rows are wanted.
    Done,
}

/// The client's rows from merged ones, one at a time.
pub struct Finisher<'m> {
    merger: &'m Merger,
    seen: HashSet<Vec<Option<Vec<u8>>>>,
    /// Bytes of the rows `seen` holds, at most `max_seen_bytes`.
    seen_bytes: usize,
    max_seen_bytes: usize,
    skip: u64,
    given: u64,
}

impl<'m> Finisher<'m> {
    /// `max_seen_bytes`: how much a DISTINCT may keep of the rows it has given.
    pub fn new(merger: &'m Merger, max_seen_bytes: usize) -> Finisher<'m> {
        Finisher {
            merger,
            seen: HashSet::new(),
            seen_bytes: 0,
            max_seen_bytes,
            skip: merger.spec().offset,
            given: 0,
        }
    }

    /// The LIMIT was reached.
    pub fn is_done(&self) -> bool {
        self.merger
            .spec()
            .limit
            .is_some_and(|limit| self.given >= limit)
    }

    pub fn take(&mut self, mut row: Row) -> Result<Taken, MergeError> {
        if self.is_done() {
            return Ok(Taken::Done);
        }
        let visible = self.merger.visible();
        row.truncate(visible);
        if self.merger.spec().distinct {
            let key = (0..visible)
                .map(|i| self.merger.key_of(Column::Visible(i), &row, true))
                .collect::<Result<Vec<_>, _>>()?;
            let bytes: usize = key.iter().flatten().map(|v| v.len() + 8).sum();
            if self.seen.contains(&key) {
                return Ok(Taken::Skipped);
            }
            self.seen_bytes += bytes;
            if self.seen_bytes > self.max_seen_bytes {
                return Err(MergeError::TooLarge {
                    what: "the distinct rows",
                    max_bytes: self.max_seen_bytes,
                });
            }
            self.seen.insert(key);
        }
        if self.skip > 0 {
            self.skip -= 1;
            return Ok(Taken::Skipped);
        }
        self.given += 1;
        Ok(Taken::Row(row))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::merge_plan::{Merge, SortKey};
    use crate::merge_rows::{ColumnType, Format, TextRules};

    fn int(v: i32) -> Row {
        vec![Some(v.to_string().into_bytes())]
    }

    fn ascending(limit: Option<u64>, offset: u64, distinct: bool) -> Merger {
        let spec = Merge {
            order_by: vec![SortKey {
                column: Column::Visible(0),
                descending: false,
                nulls_first: false,
            }],
            limit,
            offset,
            distinct,
            ..Merge::default()
        };
        let int4 = ColumnType {
            oid: 23,
            format: Format::Text,
        };
        Merger::new(spec, &[int4], &[], &TextRules::bytewise()).unwrap()
    }

    /// The merge asks for one row of each shard first, then only for the shard whose row it
    /// gave: it never holds more than one row per shard.
    #[test]
    fn the_merge_asks_for_the_shard_whose_row_it_gave() {
        let merger = ascending(None, 0, false);
        let mut shards = [vec![1, 4, 5].into_iter(), vec![2, 3].into_iter()];
        let mut kway = KWay::new(&merger, 2);
        let mut asked = Vec::new();
        let mut merged = Vec::new();
        loop {
            while let Some(shard) = kway.wants() {
                asked.push(shard);
                kway.offer(shard, shards[shard].next().map(int));
                assert!(kway.heads.len() <= 2);
            }
            match kway.next_row() {
                Some(row) => merged.push(row.unwrap()),
                None => break,
            }
        }
        assert_eq!(merged, [1, 2, 3, 4, 5].map(int));
        assert_eq!(asked, [0, 1, 0, 1, 1, 0, 0]);
        assert_eq!(kway.wants(), None);
    }

    #[test]
    fn a_row_that_cannot_be_read_fails_the_merge() {
        let merger = ascending(None, 0, false);
        let mut kway = KWay::new(&merger, 2);
        kway.offer(0, Some(int(1)));
        kway.offer(1, Some(vec![Some(b"one".to_vec())]));
        assert_eq!(kway.wants(), None);
        assert!(matches!(
            kway.next_row(),
            Some(Err(MergeError::BadValue(_)))
        ));
        assert_eq!(kway.wants(), None);
        assert!(kway.next_row().is_none());
    }

    #[test]
    fn the_finisher_skips_duplicates_and_the_offset_and_stops_at_the_limit() {
        let merger = ascending(Some(2), 1, true);
        let mut finisher = Finisher::new(&merger, usize::MAX);
        let taken: Vec<Taken> = [1, 1, 2, 2, 3, 4]
            .map(|v| finisher.take(int(v)).unwrap())
            .into();
        assert_eq!(
            taken,
            [
                Taken::Skipped,
                Taken::Skipped,
                Taken::Row(int(2)),
                Taken::Skipped,
                Taken::Row(int(3)),
                Taken::Done
            ]
        );
        assert!(finisher.is_done());
    }

    #[test]
    fn a_distinct_keeps_what_it_has_seen_within_its_bound() {
        let merger = ascending(None, 0, true);
        let mut finisher = Finisher::new(&merger, 20);
        assert_eq!(finisher.take(int(10)), Ok(Taken::Row(int(10))));
        assert_eq!(finisher.take(int(10)), Ok(Taken::Skipped));
        assert!(matches!(
            finisher.take(int(123456789)),
            Err(MergeError::TooLarge { .. })
        ));
    }
}
