//! When the cache may serve: the state of one database's invalidation stream.
//!
//! The stream is live from the moment its slot is made on the primary (every commit before
//! the slot's consistent point is visible to any snapshot taken after it, every commit after
//! it is decoded). It must be heard from regularly (pgherd asks the server for a reply with
//! each of its status updates), must not be far behind the primary's WAL, and must have
//! decoded a session's own last write before that session is served from the cache.
//! (Commits decoded but not yet visible are the store's to hold: `Store::commit_decoded`.)

/// Bounds on the stream's health, from the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateLimits {
    /// Not heard from for longer than this: not served.
    pub max_silence_ms: u64,
    /// Decoded position further than this behind the primary's WAL: not served.
    pub max_lag_bytes: u64,
}

/// Why the cache does not serve now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotServing {
    #[error("the invalidation stream is not running")]
    Down,
    #[error("the invalidation stream has not been heard from for {silent_ms} ms")]
    Silent { silent_ms: u64 },
    #[error("the invalidation stream is {lag_bytes} bytes behind the primary")]
    Behind { lag_bytes: u64 },
    #[error("the session's own last write has not been decoded yet")]
    OwnWriteNotDecoded,
}

#[derive(Debug, Default)]
pub struct Feed {
    live: bool,
    decoded_lsn: u64,
    last_heard_ms: u64,
}

impl Feed {
    pub fn is_live(&self) -> bool {
        self.live
    }

    /// Everything committed up to this WAL position has been decoded (and invalidated).
    pub fn decoded_lsn(&self) -> u64 {
        self.decoded_lsn
    }

    /// The slot was made with this consistent point.
    pub fn went_live(&mut self, now_ms: u64, start_lsn: u64) {
        self.live = true;
        self.decoded_lsn = start_lsn;
        self.last_heard_ms = now_ms;
    }

    /// The stream broke or the primary changed (`Cache::went_down` clears the store too).
    pub fn went_down(&mut self) {
        self.live = false;
    }

    /// A message from the server: everything before `lsn` has been sent.
    pub fn heard(&mut self, now_ms: u64, lsn: u64) {
        self.last_heard_ms = self.last_heard_ms.max(now_ms);
        self.decoded_lsn = self.decoded_lsn.max(lsn);
    }

    /// How far the decoded position is behind `primary_lsn` (the primary's WAL position as
    /// last seen).
    pub fn lag_bytes(&self, primary_lsn: u64) -> u64 {
        primary_lsn.saturating_sub(self.decoded_lsn)
    }

    /// Whether a session whose last write ended at `session_write_lsn` (0: none) may be
    /// served from the cache now.
    pub fn may_serve(
        &self,
        now_ms: u64,
        session_write_lsn: u64,
        primary_lsn: u64,
        limits: GateLimits,
    ) -> Result<(), NotServing> {
        if !self.live {
            return Err(NotServing::Down);
        }
        let silent_ms = now_ms.saturating_sub(self.last_heard_ms);
        if silent_ms > limits.max_silence_ms {
            return Err(NotServing::Silent { silent_ms });
        }
        let lag_bytes = self.lag_bytes(primary_lsn);
        if lag_bytes > limits.max_lag_bytes {
            return Err(NotServing::Behind { lag_bytes });
        }
        if session_write_lsn > self.decoded_lsn {
            return Err(NotServing::OwnWriteNotDecoded);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: GateLimits = GateLimits {
        max_silence_ms: 1000,
        max_lag_bytes: 100,
    };

    #[test]
    fn serves_only_while_live_heard_caught_up_and_past_the_sessions_write() {
        let mut feed = Feed::default();
        assert_eq!(feed.may_serve(0, 0, 0, LIMITS), Err(NotServing::Down));
        feed.went_live(10, 500);
        assert_eq!(feed.may_serve(10, 0, 500, LIMITS), Ok(()));
        assert_eq!(
            feed.may_serve(1011, 0, 500, LIMITS),
            Err(NotServing::Silent { silent_ms: 1001 })
        );
        assert_eq!(
            feed.may_serve(10, 0, 601, LIMITS),
            Err(NotServing::Behind { lag_bytes: 101 })
        );
        assert_eq!(
            feed.may_serve(10, 501, 501, LIMITS),
            Err(NotServing::OwnWriteNotDecoded)
        );
        feed.heard(20, 501);
        assert_eq!(feed.may_serve(20, 501, 501, LIMITS), Ok(()));
        // Positions never go back.
        feed.heard(30, 400);
        assert_eq!(feed.decoded_lsn(), 501);
        feed.went_down();
        assert_eq!(feed.may_serve(30, 0, 501, LIMITS), Err(NotServing::Down));
    }
}
