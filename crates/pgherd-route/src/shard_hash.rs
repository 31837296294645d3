//! Which hash shard a key belongs to, computed as PostgreSQL computes which partition of a
//! `PARTITION BY HASH` table a row goes to: the type's extended hash function with the
//! partitioning seed, combined over the key's columns, modulo the number of shards. So a table
//! sharded by pgherd over N shards splits exactly as the same table hash-partitioned into N
//! partitions (modulus N, remainders 0 to N-1) would, and rows can move between the two.
//!
//! The hash is Bob Jenkins' lookup3 as `src/common/hashfn.c` has it, on a little-endian
//! machine (PostgreSQL's hashes differ by byte order; pgherd runs where the servers run).
//! Integers of every width hash as `hashint8extended` does, which agrees with `hashint4extended`
//! and `hashint2extended` for the values they share; text hashes its bytes (a deterministic
//! collation); a uuid its 16 bytes.

use pgherd_wire::SqlState;

/// The seed PostgreSQL hashes partition keys with (`HASH_PARTITION_SEED`).
pub const HASH_PARTITION_SEED: u64 = 0x7A5B_2236_7996_DCFD;

/// The type of a shard key column, as far as its hash goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyType {
    /// `smallint`.
    Int2,
    /// `integer`.
    Int4,
    /// `bigint`.
    Int8,
    /// `text` or `varchar`.
    Text,
    Uuid,
}

impl KeyType {
    /// The type as `format_type` names it (`pg_attribute` of the key column).
    pub fn from_type_name(name: &str) -> Option<KeyType> {
        Some(match name {
            "smallint" | "int2" => KeyType::Int2,
            "integer" | "int" | "int4" => KeyType::Int4,
            "bigint" | "int8" => KeyType::Int8,
            "text" | "character varying" | "varchar" => KeyType::Text,
            "uuid" => KeyType::Uuid,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            KeyType::Int2 => "smallint",
            KeyType::Int4 => "integer",
            KeyType::Int8 => "bigint",
            KeyType::Text => "text",
            KeyType::Uuid => "uuid",
        }
    }
}

/// A key value pgherd cannot hash, as PostgreSQL would refuse it for the column's type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("invalid input syntax for type {0}: \"{1}\"")]
    Syntax(&'static str, String),
    #[error("value \"{1}\" is out of range for type {0}")]
    OutOfRange(&'static str, String),
}

impl KeyError {
    pub fn sqlstate(&self) -> SqlState {
        match self {
            KeyError::Syntax(..) => SqlState::INVALID_TEXT_REPRESENTATION,
            KeyError::OutOfRange(..) => SqlState::NUMERIC_VALUE_OUT_OF_RANGE,
        }
    }
}

/// The extended hash of one key value given in its text form (a literal, a bind parameter in
/// text format), as the column's type hashes it.
pub fn hash_key_text(key_type: KeyType, text: &str, seed: u64) -> Result<u64, KeyError> {
    match key_type {
        KeyType::Int2 | KeyType::Int4 | KeyType::Int8 => {
            Ok(hash_int8_extended(parse_int(key_type, text)?, seed))
        }
        KeyType::Text => Ok(hash_bytes_extended(text.as_bytes(), seed)),
        KeyType::Uuid => Ok(hash_bytes_extended(&parse_uuid(text)?, seed)),
    }
}

/// The shard (0 to `shards` - 1) of a row whose key columns hash to `column_hashes` (NULLs
/// left out, as PostgreSQL leaves them out of the row's hash).
pub fn shard_of(column_hashes: impl IntoIterator<Item = u64>, shards: u32) -> u32 {
    let row_hash = column_hashes.into_iter().fold(0, hash_combine64);
    (row_hash % u64::from(shards.max(1))) as u32
}

/// The shard of a single-column key given in its text form.
pub fn shard_of_text(key_type: KeyType, text: &str, shards: u32) -> Result<u32, KeyError> {
    let hash = hash_key_text(key_type, text, HASH_PARTITION_SEED)?;
    Ok(shard_of([hash], shards))
}

/// A key bound in binary format, in its text form. The bytes are the binary form of the
/// parameter's type, which for a key is the key column's type (as the server infers it) or one
/// of its family the client declared: an integer of 2, 4 or 8 bytes, a uuid's 16 bytes, text
/// as UTF-8.
pub fn binary_key_text(key_type: KeyType, bytes: &[u8]) -> Result<String, KeyError> {
    let unreadable = || {
        KeyError::Syntax(
            key_type.name(),
            format!("a binary value of {} bytes", bytes.len()),
        )
    };
    match key_type {
        KeyType::Int2 | KeyType::Int4 | KeyType::Int8 => {
            let value = match bytes.len() {
                2 => i64::from(i16::from_be_bytes([bytes[0], bytes[1]])),
                4 => i64::from(i32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])),
                8 => i64::from_be_bytes(bytes.try_into().map_err(|_| unreadable())?),
                _ => return Err(unreadable()),
            };
            let text = value.to_string();
            // Within the key type's range, as the server's receive function checks it.
            parse_int(key_type, &text)?;
            Ok(text)
        }
        KeyType::Text => std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| KeyError::Syntax("text", String::from_utf8_lossy(bytes).into_owned())),
        KeyType::Uuid => {
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            if bytes.len() != 16 {
                return Err(unreadable());
            }
            Ok(format!(
                "{}-{}-{}-{}-{}",
                &hex[..8],
                &hex[8..12],
                &hex[12..16],
                &hex[16..20],
                &hex[20..]
            ))
        }
    }
}

/// Integers as their input functions read them: surrounding spaces allowed, an optional sign,
/// decimal digits, within the type's range.
pub(crate) fn parse_int(key_type: KeyType, text: &str) -> Result<i64, KeyError> {
    let syntax = || KeyError::Syntax(key_type.name(), text.to_owned());
    let trimmed = text.trim_matches(|c: char| c.is_ascii_whitespace());
    let digits = trimmed.strip_prefix(['+', '-']).unwrap_or(trimmed);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(syntax());
    }
    let out_of_range = || KeyError::OutOfRange(key_type.name(), text.to_owned());
    let value: i64 = trimmed.parse().map_err(|_| out_of_range())?;
    let fits = match key_type {
        KeyType::Int2 => i16::try_from(value).is_ok(),
        KeyType::Int4 => i32::try_from(value).is_ok(),
        _ => true,
    };
    if fits {
        Ok(value)
    } else {
        Err(out_of_range())
    }
}

/// A uuid as `uuid_in` reads it: 32 hex digits, optionally in braces, with an optional hyphen
/// after any group of four digits.
pub(crate) fn parse_uuid(text: &str) -> Result<[u8; 16], KeyError> {
    let syntax = || KeyError::Syntax("uuid", text.to_owned());
    let inner = match text.strip_prefix('{') {
        Some(rest) => rest.strip_suffix('}').ok_or_else(syntax)?,
        None => text,
    };
    let mut bytes = [0u8; 16];
    let mut digits = 0usize;
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        let nibble = c.to_digit(16).ok_or_else(syntax)? as u8;
        if digits >= 32 {
            return Err(syntax());
        }
        bytes[digits / 2] |= nibble << if digits.is_multiple_of(2) { 4 } else { 0 };
        digits += 1;
        if digits.is_multiple_of(4) && digits < 32 && chars.peek() == Some(&'-') {
            chars.next();
        }
    }
    if digits == 32 {
        Ok(bytes)
    } else {
        Err(syntax())
    }
}

/// `hash_combine64`: folds one column's hash into the row's.
pub fn hash_combine64(a: u64, b: u64) -> u64 {
    a ^ b
        .wrapping_add(0x49a0_f4dd_15e5_a8e3)
        .wrapping_add(a << 54)
        .wrapping_add(a >> 7)
}

/// `hashint8extended`: the high half folded into the low one so that values every integer
/// type holds hash alike.
pub fn hash_int8_extended(value: i64, seed: u64) -> u64 {
    let high = (value >> 32) as u32;
    let low = value as u32 ^ if value >= 0 { high } else { !high };
    hash_uint32_extended(low, seed)
}

pub fn hash_uint32_extended(k: u32, seed: u64) -> u64 {
    let init = 0x9e37_79b9u32.wrapping_add(4).wrapping_add(3_923_095);
    let (mut a, b, c) = seeded(init, seed);
    a = a.wrapping_add(k);
    let (_, b, c) = final_mix(a, b, c);
    (u64::from(b) << 32) | u64::from(c)
}

pub fn hash_bytes_extended(key: &[u8], seed: u64) -> u64 {
    let init = 0x9e37_79b9u32
        .wrapping_add(key.len() as u32)
        .wrapping_add(3_923_095);
    let (mut a, mut b, mut c) = seeded(init, seed);
    let word = |bytes: &[u8]| {
        bytes
            .iter()
            .enumerate()
            .fold(0u32, |w, (i, &byte)| w | u32::from(byte) << (8 * i))
    };
    let mut chunks = key.chunks_exact(12);
    for chunk in chunks.by_ref() {
        a = a.wrapping_add(word(&chunk[0..4]));
        b = b.wrapping_add(word(&chunk[4..8]));
        c = c.wrapping_add(word(&chunk[8..12]));
        (a, b, c) = mix(a, b, c);
    }
    // The last 11 bytes or fewer; the lowest byte of c is left for the length (which the
    // initial state holds instead).
    let tail = chunks.remainder();
    a = a.wrapping_add(word(&tail[..tail.len().min(4)]));
    if tail.len() > 4 {
        b = b.wrapping_add(word(&tail[4..tail.len().min(8)]));
    }
    if tail.len() > 8 {
        c = c.wrapping_add(word(&tail[8..]) << 8);
    }
    let (_, b, c) = final_mix(a, b, c);
    (u64::from(b) << 32) | u64::from(c)
}

fn seeded(init: u32, seed: u64) -> (u32, u32, u32) {
    let (a, b, c) = (init, init, init);
    if seed == 0 {
        return (a, b, c);
    }
    mix(
        a.wrapping_add((seed >> 32) as u32),
        b.wrapping_add(seed as u32),
        c,
    )
}

fn mix(mut a: u32, mut b: u32, mut c: u32) -> (u32, u32, u32) {
    a = a.wrapping_sub(c);
    a ^= c.rotate_left(4);
    c = c.wrapping_add(b);
    b = b.wrapping_sub(a);
    b ^= a.rotate_left(6);
    a = a.wrapping_add(c);
    c = c.wrapping_sub(b);
    c ^= b.rotate_left(8);
    b = b.wrapping_add(a);
    a = a.wrapping_sub(c);
    a ^= c.rotate_left(16);
    c = c.wrapping_add(b);
    b = b.wrapping_sub(a);
    b ^= a.rotate_left(19);
    a = a.wrapping_add(c);
    c = c.wrapping_sub(b);
    c ^= b.rotate_left(4);
    b = b.wrapping_add(a);
    (a, b, c)
}

fn final_mix(mut a: u32, mut b: u32, mut c: u32) -> (u32, u32, u32) {
    c ^= b;
    c = c.wrapping_sub(b.rotate_left(14));
    a ^= c;
    a = a.wrapping_sub(c.rotate_left(11));
    b ^= a;
    b = b.wrapping_sub(a.rotate_left(25));
    c ^= b;
    c = c.wrapping_sub(b.rotate_left(16));
    a ^= c;
    a = a.wrapping_sub(c.rotate_left(4));
    b ^= a;
    b = b.wrapping_sub(a.rotate_left(14));
    c ^= b;
    c = c.wrapping_sub(b.rotate_left(24));
    (a, b, c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_of_every_width_hash_alike_and_input_is_read_as_postgresql_reads_it() {
        for v in [-70_000i64, -1, 0, 1, 32_767, 2_000_000_000] {
            let as_text = v.to_string();
            assert_eq!(
                hash_key_text(KeyType::Int4, &as_text, 7).ok(),
                Some(hash_int8_extended(v, 7))
            );
        }
        assert_eq!(
            hash_key_text(KeyType::Int8, " +42 ", 7),
            hash_key_text(KeyType::Int8, "42", 7)
        );
        let error = hash_key_text(KeyType::Int4, "3000000000", 7).unwrap_err();
        assert_eq!(error.sqlstate(), SqlState::NUMERIC_VALUE_OUT_OF_RANGE);
        assert_eq!(
            error.to_string(),
            "value \"3000000000\" is out of range for type integer"
        );
        let error = hash_key_text(KeyType::Int2, "1e3", 7).unwrap_err();
        assert_eq!(error.sqlstate(), SqlState::INVALID_TEXT_REPRESENTATION);
        assert!(hash_key_text(KeyType::Int8, "-", 7).is_err());
        assert!(hash_key_text(KeyType::Int8, "99999999999999999999", 7).is_err());
    }

    #[test]
    fn binary_keys_read_as_their_send_functions_wrote_them() {
        assert_eq!(
            binary_key_text(KeyType::Int2, &(-5i16).to_be_bytes()).unwrap(),
            "-5"
        );
        assert_eq!(
            binary_key_text(KeyType::Int8, &7i32.to_be_bytes()).unwrap(),
            "7"
        );
        assert_eq!(
            binary_key_text(KeyType::Int8, &i64::MIN.to_be_bytes()).unwrap(),
            i64::MIN.to_string()
        );
        let error = binary_key_text(KeyType::Int2, &70_000i32.to_be_bytes()).unwrap_err();
        assert_eq!(error.sqlstate(), SqlState::NUMERIC_VALUE_OUT_OF_RANGE);
        assert!(binary_key_text(KeyType::Int4, &[0, 1, 2]).is_err());
        assert_eq!(
            binary_key_text(KeyType::Text, "ké".as_bytes()).unwrap(),
            "ké"
        );
        assert!(binary_key_text(KeyType::Text, &[0xff]).is_err());
        let uuid = parse_uuid("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11").unwrap();
        assert_eq!(
            binary_key_text(KeyType::Uuid, &uuid).unwrap(),
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
        );
        assert!(binary_key_text(KeyType::Uuid, &uuid[..15]).is_err());
    }

    #[test]
    fn uuids_are_read_in_every_form_uuid_in_takes() {
        let plain = parse_uuid("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11").unwrap();
        for form in [
            "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11",
            "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}",
            "a0eebc999c0b4ef8bb6d6bb9bd380a11",
            "a0ee-bc99-9c0b-4ef8-bb6d-6bb9-bd38-0a11",
        ] {
            assert_eq!(parse_uuid(form), Ok(plain), "{form}");
        }
        assert_eq!(plain[0], 0xa0);
        assert_eq!(plain[15], 0x11);
        for bad in [
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a1",
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a111",
            "-a0eebc999c0b4ef8bb6d6bb9bd380a11",
            "{a0eebc999c0b4ef8bb6d6bb9bd380a11",
            "a0eebc99--9c0b-4ef8-bb6d-6bb9bd380a11",
        ] {
            assert!(parse_uuid(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_row_without_key_columns_is_on_shard_zero_and_shards_stay_in_range() {
        assert_eq!(shard_of([], 4), 0);
        for v in 0..1000 {
            let shard = shard_of_text(KeyType::Int8, &v.to_string(), 3).unwrap();
            assert!(shard < 3);
        }
    }
}
