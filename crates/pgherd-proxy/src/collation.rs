//! How a fan-out's merge orders text (`pgherd_route::merge_rows::TextRules`): what each
//! shard's database says about its collations, and the C library's collation on pgherd's own
//! machine when it is the very one the servers sort by.
//!
//! PostgreSQL orders text of a libc collation with `strcoll_l` and breaks its ties by bytes.
//! pgherd can do the same only with the same locale of the same C library: the servers report
//! the version of the library they sort with now (`pg_database_collation_actual_version`,
//! glibc's version for a libc collation), and pgherd compares it with its own. Anything else
//! (an ICU default collation, shards that disagree, a locale pgherd's machine lacks, another
//! C library) leaves text unordered: a fan-out that would order it is refused with the
//! reason, never answered in another order.

use std::cell::RefCell;
use std::cmp::Ordering;
use std::ffi::{c_char, c_int, CStr, CString};
use std::sync::Arc;

use pgherd_route::merge_rows::{Collator, TextRules};

use crate::server::ServerConn;

/// What one shard's database says about its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseCollation {
    /// The database's `LC_COLLATE`.
    pub collate: String,
    /// `c` for the C library, `i` for ICU.
    pub provider: String,
    /// The version of the collation library the server sorts with now, if it reports one.
    pub version: Option<String>,
    /// Every collation of the database is deterministic.
    pub deterministic: bool,
}

const COLLATION_SQL: &str = "\
SELECT d.datcollate, d.datlocprovider, pg_catalog.pg_database_collation_actual_version(d.oid), \
       NOT EXISTS (SELECT 1 FROM pg_catalog.pg_collation WHERE NOT collisdeterministic) \
FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database()";

/// Before PostgreSQL 15 (no ICU default, no version of the database's collation).
const COLLATION_SQL_BEFORE_15: &str = "\
SELECT d.datcollate, 'c', NULL, \
       NOT EXISTS (SELECT 1 FROM pg_catalog.pg_collation WHERE NOT collisdeterministic) \
FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database()";

/// Asks the database `conn` is connected to.
pub async fn read(conn: &mut ServerConn) -> Result<DatabaseCollation, String> {
    let version = conn
        .simple_query("SELECT pg_catalog.current_setting('server_version_num')")
        .await
        .map_err(|e| e.to_string())?;
    let version: u32 = match version.first().map(Vec::as_slice) {
        Some([Some(v)]) => v.parse().unwrap_or(0),
        _ => 0,
    };
    let sql = if version >= 150_000 {
        COLLATION_SQL
    } else {
        COLLATION_SQL_BEFORE_15
    };
    let rows = conn.simple_query(sql).await.map_err(|e| e.to_string())?;
    match rows.first().map(Vec::as_slice) {
        Some([Some(collate), Some(provider), version, Some(deterministic)]) => {
            Ok(DatabaseCollation {
                collate: collate.clone(),
                provider: provider.clone(),
                version: version.clone(),
                deterministic: deterministic == "t",
            })
        }
        _ => Err("the server did not say what its database's collation is".to_owned()),
    }
}

/// The merge's rules for text, from what every shard's database says (`shards[k]` is shard
/// k's, or why it could not be asked), `open` (a collator of this machine for a locale name)
/// and this machine's C library version.
pub fn text_rules(
    shards: &[Result<DatabaseCollation, String>],
    open: &dyn Fn(&str) -> Option<Arc<dyn Collator>>,
    local_version: Option<&str>,
) -> TextRules {
    let mut known = Vec::with_capacity(shards.len());
    for (shard, said) in shards.iter().enumerate() {
        match said {
            Ok(collation) => known.push(collation),
            Err(why) => {
                return TextRules::unknown(&format!(
                    "a collation pgherd could not learn (shard {shard}: {why})"
                ))
            }
        }
    }
    let Some(first) = known.first() else {
        return TextRules::unknown("a collation pgherd could not learn (no shard answered)");
    };
    let deterministic = known.iter().all(|c| c.deterministic);
    let rules = |default_order| TextRules {
        default_order,
        deterministic,
    };
    if let Some((shard, other)) = known
        .iter()
        .enumerate()
        .find(|(_, c)| (&c.collate, &c.provider) != (&first.collate, &first.provider))
    {
        return rules(Err(format!(
            "the database's default collation, which differs between shards (shard 0: {}, shard {shard}: {})",
            first.collate, other.collate
        )));
    }
    if first.provider != "c" {
        let provider = match first.provider.as_str() {
            "i" => "ICU",
            "b" => "builtin",
            _ => "non-libc",
        };
        return rules(Err(format!(
            "the database's {provider} collation {}, which pgherd does not apply",
            first.collate
        )));
    }
    if matches!(first.collate.as_str(), "C" | "POSIX") {
        return rules(Ok(None));
    }
    let collate = &first.collate;
    // PostgreSQL keeps no version of the "C." locales (code point order, which it takes as
    // stable): neither does pgherd.
    let unversioned = collate
        .get(..2)
        .is_some_and(|c| c.eq_ignore_ascii_case("C."));
    if !unversioned {
        let Some(local) = local_version else {
            return rules(Err(format!(
                "the database's collation {collate}: pgherd's C library does not say its version"
            )));
        };
        if let Some(other) = known.iter().find(|c| c.version.as_deref() != Some(local)) {
            return rules(Err(format!(
                "the database's collation {collate} of C library {}, where pgherd's machine has {local}",
                other.version.as_deref().unwrap_or("(unknown)")
            )));
        }
    }
    match open(collate) {
        Some(collator) => rules(Ok(Some(collator))),
        None => rules(Err(format!(
            "the database's collation {collate}, a locale pgherd's machine does not have"
        ))),
    }
}

/// This machine's C library version, as PostgreSQL reports a libc collation's version.
pub fn local_version() -> Option<String> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: glibc returns a pointer to a static NUL-terminated string.
        let version = unsafe { CStr::from_ptr(libc::gnu_get_libc_version()) };
        version.to_str().ok().map(str::to_owned)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

/// The C library's collation for `locale` (`LC_COLLATE` only), if this machine has it.
pub fn open_libc(locale: &str) -> Option<Arc<dyn Collator>> {
    let name = CString::new(locale).ok()?;
    // SAFETY: `name` is NUL-terminated and outlives the call; a null base asks for a new
    // locale object, which `LibcCollator` frees.
    let handle =
        unsafe { libc::newlocale(libc::LC_COLLATE_MASK, name.as_ptr(), std::ptr::null_mut()) };
    if handle.is_null() {
        return None;
    }
    Some(Arc::new(LibcCollator { handle }))
}

extern "C" {
    fn strcoll_l(a: *const c_char, b: *const c_char, locale: libc::locale_t) -> c_int;
}

struct LibcCollator {
    handle: libc::locale_t,
}

// SAFETY: a locale object is only read by `strcoll_l`, which may use it from any thread at
// once; it is freed once, when the last owner drops it.
unsafe impl Send for LibcCollator {}
unsafe impl Sync for LibcCollator {}

impl Drop for LibcCollator {
    fn drop(&mut self) {
        // SAFETY: made by `newlocale`, freed only here.
        unsafe { libc::freelocale(self.handle) };
    }
}

thread_local! {
    /// The two strings of a comparison, NUL-terminated, reused.
    static TERMINATED: RefCell<(Vec<u8>, Vec<u8>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

impl Collator for LibcCollator {
    fn compare(&self, a: &[u8], b: &[u8]) -> Ordering {
        TERMINATED.with(|buffers| {
            let (x, y) = &mut *buffers.borrow_mut();
            for (buffer, text) in [(&mut *x, a), (&mut *y, b)] {
                buffer.clear();
                // PostgreSQL's text holds no NUL; a value that did would end there for both.
                buffer.extend(text.iter().take_while(|&&c| c != 0));
                buffer.push(0);
            }
            // SAFETY: both buffers are NUL-terminated and live through the call; the locale
            // object lives as long as `self`.
            let order = unsafe { strcoll_l(x.as_ptr().cast(), y.as_ptr().cast(), self.handle) };
            order.cmp(&0)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the shards say, this machine's version, what the rules must say.
    type Case<'a> = (
        Vec<Result<DatabaseCollation, String>>,
        Option<&'a str>,
        &'a str,
    );

    fn database(collate: &str, version: Option<&str>) -> Result<DatabaseCollation, String> {
        Ok(DatabaseCollation {
            collate: collate.to_owned(),
            provider: "c".to_owned(),
            version: version.map(str::to_owned),
            deterministic: true,
        })
    }

    fn why(rules: &TextRules) -> String {
        match &rules.default_order {
            Err(why) => why.clone(),
            Ok(None) => "bytes".to_owned(),
            Ok(Some(_)) => "collator".to_owned(),
        }
    }

    #[test]
    fn text_is_ordered_only_as_every_shard_orders_it() {
        let open = |name: &str| open_libc(name);
        let local = local_version();
        let here = local.as_deref();
        let cases: Vec<Case> = vec![
            (
                vec![database("C", None), database("C", None)],
                here,
                "bytes",
            ),
            (vec![database("POSIX", None)], here, "bytes"),
            // PostgreSQL reports no version of C.UTF-8.
            (
                vec![database("C.UTF-8", None), database("C.UTF-8", None)],
                here,
                "collator",
            ),
            (
                vec![database("C.UTF-8", None), database("C", None)],
                here,
                "differs between shards",
            ),
            (
                vec![database("en_US.UTF-8", Some("1.0"))],
                Some("2.0"),
                "C library 1.0, where pgherd's machine has 2.0",
            ),
            (
                vec![
                    database("en_US.UTF-8", Some("2.0")),
                    database("en_US.UTF-8", None),
                ],
                Some("2.0"),
                "of C library (unknown)",
            ),
            (
                vec![database("en_US.UTF-8", Some("2.0"))],
                None,
                "does not say its version",
            ),
            (
                vec![database("xx_NOWHERE.UTF-8", here)],
                here,
                "a locale pgherd's machine does not have",
            ),
            (
                vec![database("C.NOWHERE", None)],
                here,
                "a locale pgherd's machine does not have",
            ),
            (
                vec![database("C", None), Err("connection refused".to_owned())],
                here,
                "shard 1: connection refused",
            ),
        ];
        for (shards, local, expected) in cases {
            let rules = text_rules(&shards, &open, local);
            assert!(why(&rules).contains(expected), "{shards:?}: {rules:?}");
        }
        let icu = DatabaseCollation {
            provider: "i".to_owned(),
            ..database("en-US", None).unwrap()
        };
        assert!(why(&text_rules(&[Ok(icu)], &open, here)).contains("ICU"));
        let nondeterministic = DatabaseCollation {
            deterministic: false,
            ..database("C", None).unwrap()
        };
        let rules = text_rules(&[database("C", None), Ok(nondeterministic)], &open, here);
        assert!(!rules.deterministic);
    }

    #[test]
    fn the_c_librarys_order_is_strcolls_with_bytes_for_c_utf8() {
        let collator = open_libc("C.UTF-8").expect("glibc has C.UTF-8 built in");
        let words: [&[u8]; 5] = [b"B", b"a", "é".as_bytes(), b"ab", b""];
        for x in words {
            for y in words {
                // C.UTF-8 orders by code point, which UTF-8 bytes keep.
                assert_eq!(collator.compare(x, y), x.cmp(y), "{x:?} {y:?}");
            }
        }
        assert!(open_libc("xx_NOWHERE.UTF-8").is_none());
    }
}
