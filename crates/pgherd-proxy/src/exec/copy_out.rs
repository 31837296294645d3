//! `COPY ... TO STDOUT` of rows on several shards: every shard runs the COPY at once, and
//! the client gets one COPY: the first shard's CopyOutResponse, each shard's rows in turn
//! (streamed; a header line once), one CopyDone and the rows counted over every shard.

use pgherd_wire::backend::{self, tag as btag};
use pgherd_wire::{PgError, SqlState};

use super::answer::Answer;
use super::link::{command_tag, copied_rows, encode_message, server_error, Link, Query};
use super::Failed;

/// Runs `query` on `links` and sends the one COPY to `answer`; `header`: each shard's output
/// starts with a header line.
pub async fn run(
    links: &mut [Link],
    query: Query<'_>,
    header: bool,
    answer: &mut Answer<'_>,
) -> Result<(), Failed> {
    for link in links.iter_mut() {
        link.send_query(query).await?;
    }
    let mut copied = 0u64;
    let mut began = false;
    let mut failure: Option<PgError> = None;
    for (i, link) in links.iter_mut().enumerate() {
        // The header line comes with the first shard's rows only.
        let mut skip_header = header && i > 0;
        loop {
            let (tag, body) = match link.next().await {
                Ok(message) => message,
                Err(e) => {
                    failure.get_or_insert(e);
                    break;
                }
            };
            match tag {
                btag::COPY_OUT_RESPONSE if !began && failure.is_none() => {
                    encode_message(answer.out, &(tag, body));
                    began = true;
                }
                btag::COPY_DATA if failure.is_none() => {
                    if std::mem::take(&mut skip_header) {
                        continue;
                    }
                    encode_message(answer.out, &(tag, body));
                    answer.grown().await?;
                }
                btag::COMMAND_COMPLETE => match command_tag(&body).and_then(copied_rows) {
                    Some(rows) => copied += rows,
                    None => {
                        failure.get_or_insert(PgError::error(
                            SqlState::PROTOCOL_VIOLATION,
                            format!(
                                "shard {} ended the COPY with {:?}",
                                link.shard,
                                command_tag(&body)
                            ),
                        ));
                    }
                },
                btag::ERROR_RESPONSE => {
                    failure.get_or_insert(server_error(link.shard, &body));
                }
                btag::NOTICE_RESPONSE | btag::PARAMETER_STATUS => {
                    encode_message(answer.out, &(tag, body));
                }
                // A portal's description (extended protocol), once.
                btag::NO_DATA if i == 0 => encode_message(answer.out, &(tag, body)),
                btag::READY_FOR_QUERY => break,
                // The other shards' CopyOutResponse, every CopyDone: the client gets one.
                _ => {}
            }
        }
    }
    if let Some(failure) = failure {
        return Err(Failed::Statement(failure));
    }
    let encoded = |e: pgherd_wire::WireError| {
        Failed::Statement(PgError::error(SqlState::INTERNAL_ERROR, e.to_string()))
    };
    if began {
        backend::encode_empty(answer.out, btag::COPY_DONE);
    }
    backend::encode_command_complete(answer.out, &format!("COPY {copied}")).map_err(encoded)?;
    Ok(())
}
