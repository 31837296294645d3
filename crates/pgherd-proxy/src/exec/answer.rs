//! Where a statement's answer goes on its way to the client: sent as it grows, or held whole
//! for a portal the client reads a few rows at a time (bounded).

use bytes::BytesMut;

use super::{extended, fan_out, Failed, FLUSH_BYTES};
use crate::error::client_io;
use crate::msgio::write_flush;
use crate::stream::Stream;

pub struct Answer<'a> {
    client: &'a mut Stream,
    pub out: &'a mut BytesMut,
    hold: bool,
}

impl<'a> Answer<'a> {
    /// `hold`: the answer stays in `out` (a portal's rows handed out as asked).
    pub fn new(client: &'a mut Stream, out: &'a mut BytesMut, hold: bool) -> Answer<'a> {
        Answer { client, out, hold }
    }

    /// After messages were appended to `out`: what grew past [`FLUSH_BYTES`] goes to the
    /// client; a held answer past [`fan_out::MAX_FAN_OUT_BYTES`] fails the statement.
    pub async fn grown(&mut self) -> Result<(), Failed> {
        if self.hold {
            if self.out.len() > fan_out::MAX_FAN_OUT_BYTES {
                return Err(Failed::Statement(extended::too_many_held_rows()));
            }
        } else if self.out.len() >= FLUSH_BYTES {
            write_flush(self.client, self.out)
                .await
                .map_err(|e| Failed::Client(client_io(e)))?;
            self.out.clear();
        }
        Ok(())
    }
}
