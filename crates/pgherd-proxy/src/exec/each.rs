//! One statement sent unchanged to several shards, one after the other in shard order: a
//! schema change (every shard runs it and answers alike) or a write over several shards (the
//! counts add up, returned rows are all passed on).

use std::collections::{BTreeMap, VecDeque};

use bytes::BytesMut;
use pgherd_route::shard_route::SplitInsert;
use pgherd_wire::backend::{self, tag as btag};
use pgherd_wire::{PgError, SqlState};

use super::link::{command_tag, encode_message, server_error, Link, Message, Query};
use super::Failed;

/// One shard's answer: its messages but the error and `ReadyForQuery`, and its error.
type Answer = (u32, Result<(Vec<Message>, Option<PgError>), PgError>);

/// Runs the statement on each link in turn, in shard order: every session takes the rows and
/// locks of several shards in the same order, so two writes to the same rows on several
/// shards wait for each other instead of each holding one shard's rows and waiting for the
/// other's, a deadlock no server would see.
async fn on_each<'a>(links: &mut [Link], query_of: impl Fn(u32) -> Query<'a>) -> Vec<Answer> {
    let mut answers = Vec::with_capacity(links.len());
    for link in links.iter_mut() {
        let shard = link.shard;
        let answer = answer_of(link, query_of(shard)).await;
        let failed = !matches!(answer, Ok((_, None)));
        answers.push((shard, answer));
        // The statement failed: the shards after this one are spared it.
        if failed {
            break;
        }
    }
    answers
}

/// One shard's answer: its messages but the error and `ReadyForQuery`, and its error.
async fn answer_of(
    link: &mut Link,
    query: Query<'_>,
) -> Result<(Vec<Message>, Option<PgError>), PgError> {
    link.send_query(query).await?;
    let mut messages = Vec::new();
    let mut error = None;
    loop {
        let message = link.next().await?;
        match message.0 {
            btag::READY_FOR_QUERY => return Ok((messages, error)),
            btag::ERROR_RESPONSE => {
                error.get_or_insert(server_error(link.shard, &message.1));
            }
            _ => messages.push(message),
        }
    }
}

/// The first failure, with which shard it came from and (outside a transaction, where each
/// shard committed on its own) which shards did apply the statement.
fn failure(answers: &[Answer], own_commits: bool) -> Option<PgError> {
    let applied: Vec<String> = answers
        .iter()
        .filter(|(_, a)| matches!(a, Ok((_, None))))
        .map(|(shard, _)| shard.to_string())
        .collect();
    let (shard, error) = answers.iter().find_map(|(shard, a)| match a {
        Ok((_, Some(e))) | Err(e) => Some((shard, e.clone())),
        Ok((_, None)) => None,
    })?;
    let detail = match applied.as_slice() {
        _ if !own_commits => format!("on shard {shard}"),
        [] => format!("on shard {shard}; no shard applied it"),
        [one] => format!("on shard {shard}; shard {one} applied it"),
        many => format!("on shard {shard}; shards {} applied it", many.join(", ")),
    };
    Some(with_detail(error, detail))
}

/// A schema change or maintenance command: every shard runs it in turn (the shards after one
/// that fails do not), and the first answer stands for all. Outside a transaction each shard
/// commits on its own (`own_commits`), so a failure says which shards did apply it.
pub async fn schema_change(
    links: &mut [Link],
    query: Query<'_>,
    own_commits: bool,
    out: &mut BytesMut,
) -> Result<(), Failed> {
    let answers = on_each(links, |_| query).await;
    if let Some(error) = failure(&answers, own_commits) {
        return Err(Failed::Statement(error));
    }
    if let Some((_, Ok((messages, _)))) = answers.first() {
        messages.iter().for_each(|m| encode_message(out, m));
    }
    Ok(())
}

/// A write on several shards inside a transaction: one row description, every shard's
/// returned rows (of a split INSERT, in the order its rows were written), the shards' counts
/// added up in one command tag. Of a table every shard holds whole (`copies`), every shard
/// must answer alike, and the first answer stands.
pub async fn write(
    links: &mut [Link],
    query: Query<'_>,
    copies: bool,
    split: Option<&SplitInsert>,
    out: &mut BytesMut,
) -> Result<(), Failed> {
    let answers = on_each(links, |shard| {
        match split.and_then(|s| s.statements.get(&shard)) {
            Some(own) => query.with_sql(own),
            None => query,
        }
    })
    .await;
    if let Some(error) = failure(&answers, false) {
        return Err(Failed::Statement(error));
    }
    if copies {
        return one_of_the_copies(&answers, out);
    }
    // The first shard's description stands for all; rows are given back if one says so or
    // a shard gave rows back (the description is not passed on when the client did not ask).
    let mut described = false;
    let mut returns_rows = false;
    let mut tags = Vec::new();
    let mut rows: BTreeMap<u32, VecDeque<&Message>> = BTreeMap::new();
    for (shard, answer) in &answers {
        let Ok((messages, _)) = answer else { continue };
        for message in messages {
            match message.0 {
                btag::ROW_DESCRIPTION | btag::NO_DATA
                    if std::mem::replace(&mut described, true) => {}
                btag::ROW_DESCRIPTION => {
                    returns_rows = true;
                    encode_message(out, message);
                }
                btag::COMMAND_COMPLETE => tags.push(message.1.clone()),
                btag::DATA_ROW => rows.entry(*shard).or_default().push_back(message),
                _ => encode_message(out, message),
            }
        }
    }
    // A split INSERT's rows come back per shard in the order written there: taken in the
    // order of the statement's rows, they are in the order the client wrote them, provided
    // each shard gave back one row per row it was given.
    returns_rows |= !rows.is_empty();
    if let Some(split) = split.filter(|_| returns_rows) {
        for (shard, answer) in &answers {
            let given = split.row_shards.iter().filter(|s| *s == shard).count();
            let returned = rows.get(shard).map_or(0, VecDeque::len);
            if answer.is_ok() && returned != given {
                return Err(Failed::Statement(PgError::error(
                    SqlState::FEATURE_NOT_SUPPORTED,
                    format!("not supported on sharded tables: RETURNING of a split INSERT whose rows a trigger or rule dropped or added (shard {shard} returned {returned} rows for {given}): the INSERT is undone"),
                )));
            }
        }
    }
    for shard in split.iter().flat_map(|s| &s.row_shards) {
        if let Some(row) = rows.get_mut(shard).and_then(VecDeque::pop_front) {
            encode_message(out, row);
        }
    }
    rows.values()
        .flatten()
        .for_each(|row| encode_message(out, row));
    let tag = sum_tags(&tags).ok_or_else(|| {
        Failed::Statement(PgError::error(
            SqlState::PROTOCOL_VIOLATION,
            "the shards' command tags differ",
        ))
    })?;
    backend::encode_command_complete(out, &tag)
        .map_err(|e| Failed::Statement(PgError::error(SqlState::INTERNAL_ERROR, e.to_string())))
}

/// The first shard's answer, if every shard changed as many rows of its copy.
fn one_of_the_copies(answers: &[Answer], out: &mut BytesMut) -> Result<(), Failed> {
    fn tag_of(messages: &[Message]) -> Option<&str> {
        messages
            .iter()
            .rfind(|m| m.0 == btag::COMMAND_COMPLETE)
            .and_then(|m| command_tag(&m.1))
    }
    let tags: Vec<(u32, Option<&str>)> = answers
        .iter()
        .filter_map(|(shard, a)| a.as_ref().ok().map(|(m, _)| (*shard, tag_of(m))))
        .collect();
    // The rows each copy gave back, in an order of their own.
    fn returned(messages: &[Message]) -> Vec<&[u8]> {
        let mut rows: Vec<&[u8]> = messages
            .iter()
            .filter(|m| m.0 == btag::DATA_ROW)
            .map(|m| &m.1[..])
            .collect();
        rows.sort_unstable();
        rows
    }
    let rows: Vec<Vec<&[u8]>> = answers
        .iter()
        .filter_map(|(_, a)| a.as_ref().ok().map(|(m, _)| returned(m)))
        .collect();
    if tags.windows(2).any(|pair| pair[0].1 != pair[1].1) || rows.windows(2).any(|p| p[0] != p[1]) {
        let seen: Vec<String> = tags
            .iter()
            .map(|(shard, tag)| format!("{} on shard {shard}", tag.as_deref().unwrap_or("nothing")))
            .collect();
        return Err(Failed::Statement(
            PgError::error(
                SqlState::DATA_CORRUPTED,
                "the copies of this table differ between the shards: the write is undone",
            )
            .with_detail(seen.join(", ")),
        ));
    }
    if let Some((_, Ok((messages, _)))) = answers.first() {
        messages.iter().for_each(|m| encode_message(out, m));
    }
    Ok(())
}

/// `UPDATE 2` and `UPDATE 3` make `UPDATE 5` (`INSERT 0 n` alike); `None` if the shards
/// answered different commands.
fn sum_tags(tags: &[bytes::BytesMut]) -> Option<String> {
    let mut command: Option<&str> = None;
    let mut rows = 0u64;
    for tag in tags {
        let text = command_tag(tag)?;
        let (head, count) = text.rsplit_once(' ')?;
        if command.is_some_and(|c| c != head) {
            return None;
        }
        command = Some(head);
        rows += count.parse::<u64>().ok()?;
    }
    Some(format!("{} {rows}", command?))
}

pub fn with_detail(mut error: PgError, detail: String) -> PgError {
    error.detail = Some(match error.detail.take() {
        Some(own) => format!("{own} ({detail})"),
        None => detail,
    });
    error
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_per_command() {
        let tags = |list: &[&str]| -> Vec<BytesMut> {
            list.iter()
                .map(|t| BytesMut::from(format!("{t}\0").as_bytes()))
                .collect()
        };
        assert_eq!(
            sum_tags(&tags(&["UPDATE 2", "UPDATE 3"])).as_deref(),
            Some("UPDATE 5")
        );
        assert_eq!(
            sum_tags(&tags(&["INSERT 0 1", "INSERT 0 0"])).as_deref(),
            Some("INSERT 0 1")
        );
        assert_eq!(sum_tags(&tags(&["UPDATE 1", "DELETE 1"])), None);
        assert_eq!(sum_tags(&tags(&[])), None);
    }
}
