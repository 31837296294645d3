//! PostgreSQL's md5 password scheme: the stored hash is `md5` + hex(md5(password ++ user)) and
//! the wire response is `md5` + hex(md5(hex_of_stored_hash ++ salt)).
//!
//! Because the response needs only the stored hash, a proxy holding that hash can both check a
//! client and log in to a server without the password.

use md5::{Digest, Md5};

fn hex_md5(parts: &[&[u8]]) -> String {
    let mut hasher = Md5::new();
    for part in parts {
        hasher.update(part);
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The hash PostgreSQL stores for `password` of `user`.
pub fn md5_password_hash(user: &str, password: &str) -> String {
    format!("md5{}", hex_md5(&[password.as_bytes(), user.as_bytes()]))
}

/// True for text shaped like a stored md5 hash.
pub fn is_md5_hash(text: &str) -> bool {
    text.len() == 35 && text.starts_with("md5") && text[3..].bytes().all(|b| b.is_ascii_hexdigit())
}

/// The PasswordMessage payload answering an md5 request with `salt`.
pub fn md5_salted_response(stored_hash: &str, salt: [u8; 4]) -> String {
    let digest = stored_hash.strip_prefix("md5").unwrap_or(stored_hash);
    format!("md5{}", hex_md5(&[digest.as_bytes(), &salt]))
}

/// Checks a client's md5 response in constant time.
pub fn verify_md5_response(stored_hash: &str, salt: [u8; 4], response: &[u8]) -> bool {
    let expected = md5_salted_response(stored_hash, salt);
    expected.len() == response.len()
        && expected
            .bytes()
            .zip(response)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_postgresql() {
        // SELECT 'md5' || md5('secret' || 'alice');
        assert_eq!(
            md5_password_hash("alice", "secret"),
            "md54a0a68b43b6cd5cf266fa02f196e2371"
        );
        assert!(is_md5_hash(&md5_password_hash("alice", "secret")));
        assert!(!is_md5_hash("md5xyz"));
    }

    #[test]
    fn response_verifies_only_with_the_right_salt() {
        let stored = md5_password_hash("bob", "pw");
        let response = md5_salted_response(&stored, [1, 2, 3, 4]);
        assert!(verify_md5_response(
            &stored,
            [1, 2, 3, 4],
            response.as_bytes()
        ));
        assert!(!verify_md5_response(
            &stored,
            [4, 3, 2, 1],
            response.as_bytes()
        ));
        assert!(!verify_md5_response(&stored, [1, 2, 3, 4], b"md5"));
    }
}
