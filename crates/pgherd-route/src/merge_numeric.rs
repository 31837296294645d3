//! Numeric values of a fan-out's merge, exactly: unscaled digits in an `i128` and a scale
//! (digits after the point), read from and written to PostgreSQL's text and binary forms,
//! ordered, added, and divided as `avg` divides. Pure; what does not fit an `i128` is an error,
//! never a rounded value.

use std::cmp::Ordering;

use crate::merge_rows::MergeError;

/// `sign` of a binary numeric: positive, negative; NaN and the infinities are refused.
const POSITIVE: u16 = 0x0000;
const NEGATIVE: u16 = 0x4000;

/// Two numerics in order, exactly: by sign, then whole part, then the fraction's digits.
pub(crate) fn compare_numeric((a, sa): (i128, u32), (b, sb): (i128, u32)) -> Ordering {
    let sign = a.signum().cmp(&b.signum());
    if sign != Ordering::Equal || a == 0 {
        return sign;
    }
    let parts = |v: i128, s: u32| {
        // Never i128::MIN: `parse_numeric` and `add` keep out of it.
        let text = format_numeric(v.unsigned_abs().min(i128::MAX as u128) as i128, s);
        let (whole, fraction) = text.split_once('.').unwrap_or((&text, ""));
        (whole.len(), whole.to_owned(), fraction.to_owned())
    };
    let ((la, wa, fa), (lb, wb, fb)) = (parts(a, sa), parts(b, sb));
    let width = fa.len().max(fb.len());
    let magnitude = (la, wa, format!("{fa:0<width$}")).cmp(&(lb, wb, format!("{fb:0<width$}")));
    if a < 0 {
        magnitude.reverse()
    } else {
        magnitude
    }
}

/// A numeric's text: an optional sign, digits, an optional point and digits. `NaN` and the
/// infinities are refused: they do not add up.
pub(crate) fn parse_numeric(text: &str) -> Result<(i128, u32), MergeError> {
    let (negative, body) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (whole, fraction) = body.split_once('.').unwrap_or((body, ""));
    if whole.is_empty()
        || !whole
            .bytes()
            .chain(fraction.bytes())
            .all(|b| b.is_ascii_digit())
    {
        return Err(MergeError::Unsupported(format!(
            "the numeric value {text} across shards"
        )));
    }
    let digits: i128 = format!("{whole}{fraction}")
        .parse()
        .map_err(|_| MergeError::OutOfRange("numeric"))?;
    let scale = u32::try_from(fraction.len()).map_err(|_| MergeError::OutOfRange("numeric"))?;
    Ok((if negative { -digits } else { digits }, scale))
}

pub(crate) fn format_numeric(digits: i128, scale: u32) -> String {
    let sign = if digits < 0 { "-" } else { "" };
    let text = digits.unsigned_abs().to_string();
    if scale == 0 {
        return format!("{sign}{text}");
    }
    let text = format!("{text:0>width$}", width = scale as usize + 1);
    let (whole, fraction) = text.split_at(text.len() - scale as usize);
    format!("{sign}{whole}.{fraction}")
}

/// `numeric_div` of a sum by a count, as `avg` gives it: the scale PostgreSQL selects
/// (`select_div_scale`: at least 16 significant digits, no fewer than the sum's scale), the
/// last digit rounded half away from zero.
pub(crate) fn average(
    sum_digits: i128,
    sum_scale: u32,
    count: i64,
) -> Result<(i128, u32), MergeError> {
    let overflow = || MergeError::OutOfRange("an average");
    // Weights in base-10000 digits, as PostgreSQL's numeric stores them.
    let weight_and_first = |digits: u128, scale: u32| -> (i64, u128) {
        if digits == 0 {
            return (0, 0);
        }
        // Align to a multiple of 4 decimal places, then find the leading base-10000 digit.
        let pad = (4 - scale % 4) % 4;
        let mut value = digits * 10u128.pow(pad);
        let mut groups = 0i64;
        while value >= 10_000 {
            value /= 10_000;
            groups += 1;
        }
        (groups - i64::from((scale + pad) / 4), value)
    };
    let (weight1, first1) = weight_and_first(sum_digits.unsigned_abs(), sum_scale);
    let (weight2, first2) = weight_and_first(u128::from(count.unsigned_abs()), 0);
    let mut qweight = weight1 - weight2;
    if first1 <= first2 {
        qweight -= 1;
    }
    let rscale = (16 - qweight * 4).max(i64::from(sum_scale)).clamp(0, 1000);
    let rscale = u32::try_from(rscale).map_err(|_| overflow())?;
    // sum / count to rscale + 1 places, then rounded to rscale.
    let shift = (rscale + 1)
        .checked_sub(sum_scale)
        .and_then(|p| 10i128.checked_pow(p))
        .ok_or_else(overflow)?;
    let scaled = sum_digits.checked_mul(shift).ok_or_else(overflow)?;
    let quotient = scaled / i128::from(count);
    let rounded = (quotient + quotient.signum() * 5) / 10;
    Ok((rounded, rscale))
}

/// The sum of two numerics at the larger scale.
pub(crate) fn add_numeric(
    (a, sa): (i128, u32),
    (b, sb): (i128, u32),
) -> Result<(i128, u32), MergeError> {
    let scale = sa.max(sb);
    let widen = |v: i128, s: u32| v.checked_mul(10i128.checked_pow(scale - s)?);
    widen(a, sa)
        .zip(widen(b, sb))
        .and_then(|(a, b)| a.checked_add(b))
        // i128::MIN has no magnitude of its own (`unsigned_abs` of it is out of i128).
        .filter(|sum| *sum != i128::MIN)
        .map(|sum| (sum, scale))
        .ok_or(MergeError::OutOfRange("numeric"))
}

/// A numeric in PostgreSQL's binary form (`numeric_send`): digit count, weight, sign and
/// display scale as 16-bit integers, then base-10000 digits, the first of them worth
/// 10000^weight.
pub(crate) fn decode_binary(bytes: &[u8]) -> Result<(i128, u32), MergeError> {
    let bad = || MergeError::BadValue("a binary numeric");
    let word = |i: usize| -> Result<u16, MergeError> {
        let at = bytes.get(2 * i..2 * i + 2).ok_or_else(bad)?;
        Ok(u16::from_be_bytes([at[0], at[1]]))
    };
    let ndigits = usize::from(word(0)?);
    let weight = i64::from(word(1)? as i16);
    let sign = word(2)?;
    let dscale = u32::from(word(3)?);
    if bytes.len() != 8 + 2 * ndigits {
        return Err(bad());
    }
    if sign != POSITIVE && sign != NEGATIVE {
        return Err(MergeError::Unsupported(
            "the numeric value NaN or Infinity across shards".to_owned(),
        ));
    }
    if ndigits == 0 {
        // Zero, at any display scale.
        return Ok((0, dscale));
    }
    let overflow = || MergeError::OutOfRange("numeric");
    let mut value: i128 = 0;
    for i in 0..ndigits {
        let digit = word(4 + i)?;
        if digit >= 10_000 {
            return Err(bad());
        }
        value = value
            .checked_mul(10_000)
            .and_then(|v| v.checked_add(i128::from(digit)))
            .ok_or_else(overflow)?;
    }
    // The last digit is worth 10000^(weight - ndigits + 1); in units of 10^-dscale:
    let exponent = 4 * (weight - ndigits as i64 + 1) + i64::from(dscale);
    let power = |e: i64| {
        u32::try_from(e)
            .ok()
            .and_then(|e| 10i128.checked_pow(e))
            .ok_or_else(overflow)
    };
    let unscaled = if exponent >= 0 {
        value.checked_mul(power(exponent)?).ok_or_else(overflow)?
    } else {
        let divisor = power(-exponent)?;
        if value % divisor != 0 {
            // More fractional digits than the display scale: not a value PostgreSQL sends.
            return Err(bad());
        }
        value / divisor
    };
    Ok((
        if sign == NEGATIVE {
            -unscaled
        } else {
            unscaled
        },
        dscale,
    ))
}

/// [`decode_binary`]'s inverse, as `numeric_send` writes it (no leading or trailing zero
/// digits, weight 0 for zero).
pub(crate) fn encode_binary((digits, scale): (i128, u32)) -> Result<Vec<u8>, MergeError> {
    let overflow = || MergeError::OutOfRange("numeric");
    let text = format_numeric(digits.unsigned_abs().min(i128::MAX as u128) as i128, scale);
    let (whole, fraction) = text.split_once('.').unwrap_or((&text, ""));
    // Align the point on a base-10000 digit boundary.
    let whole = format!("{:0>width$}", whole, width = whole.len().div_ceil(4) * 4);
    let fraction = format!(
        "{:0<width$}",
        fraction,
        width = fraction.len().div_ceil(4) * 4
    );
    let mut groups: Vec<u16> = format!("{whole}{fraction}")
        .as_bytes()
        .chunks(4)
        .map(|chunk| {
            chunk
                .iter()
                .fold(0u16, |acc, d| acc * 10 + u16::from(d - b'0'))
        })
        .collect();
    let mut weight = i64::try_from(whole.len() / 4).map_err(|_| overflow())? - 1;
    let leading = groups.iter().take_while(|&&g| g == 0).count();
    groups.drain(..leading);
    weight -= i64::try_from(leading).map_err(|_| overflow())?;
    while groups.last() == Some(&0) {
        groups.pop();
    }
    if groups.is_empty() {
        weight = 0;
    }
    let header = [
        u16::try_from(groups.len()).map_err(|_| overflow())?,
        i16::try_from(weight).map_err(|_| overflow())? as u16,
        if digits < 0 && !groups.is_empty() {
            NEGATIVE
        } else {
            POSITIVE
        },
        u16::try_from(scale).map_err(|_| overflow())?,
    ];
    Ok(header
        .iter()
        .chain(&groups)
        .flat_map(|w| w.to_be_bytes())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(w: &[u16]) -> Vec<u8> {
        w.iter().flat_map(|x| x.to_be_bytes()).collect()
    }

    /// numeric_send's bytes of values, as PostgreSQL 15 sends them
    /// (`SELECT numeric_send(v)`), both ways.
    #[test]
    fn binary_numerics_read_and_write_as_postgresql_sends_them() {
        let cases: Vec<((i128, u32), Vec<u8>)> = vec![
            // 0, 0.00, zero at a scale no i128 power of ten reaches
            ((0, 0), words(&[0, 0, 0, 0])),
            ((0, 2), words(&[0, 0, 0, 2])),
            ((0, 60), words(&[0, 0, 0, 60])),
            // 1, 10000, 12345678
            ((1, 0), words(&[1, 0, 0, 0, 1])),
            ((10_000, 0), words(&[1, 1, 0, 0, 1])),
            ((12_345_678, 0), words(&[2, 1, 0, 0, 1234, 5678])),
            // -1.5
            ((-15, 1), words(&[2, 0, NEGATIVE, 1, 1, 5000])),
            // 0.0001, 123.456000
            ((1, 4), words(&[1, 0xFFFF, 0, 4, 1])),
            ((123_456_000, 6), words(&[2, 0, 0, 6, 123, 4560])),
            // 99999999999999999999 (20 nines)
            (
                (99_999_999_999_999_999_999, 0),
                words(&[5, 4, 0, 0, 9999, 9999, 9999, 9999, 9999]),
            ),
        ];
        for (value, bytes) in cases {
            assert_eq!(decode_binary(&bytes).unwrap(), value, "{bytes:?}");
            assert_eq!(encode_binary(value).unwrap(), bytes, "{value:?}");
        }
        // NaN, a digit out of range, a short value.
        assert!(matches!(
            decode_binary(&words(&[0, 0, 0xC000, 0])),
            Err(MergeError::Unsupported(_))
        ));
        assert!(decode_binary(&words(&[1, 0, 0, 0, 10_000])).is_err());
        assert!(decode_binary(&words(&[2, 0, 0, 0, 1])).is_err());
        // Beyond an i128: an error, never a rounded value.
        let mut huge = vec![12, 11, 0, 0];
        huge.extend([9999; 12]);
        assert_eq!(
            decode_binary(&words(&huge)),
            Err(MergeError::OutOfRange("numeric"))
        );
    }
}
