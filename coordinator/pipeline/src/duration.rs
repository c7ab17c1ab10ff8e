//! Durations as Argo writes them: a bare number of seconds (`"30"`) or Go's form (`"1m30s"`,
//! `"500ms"`, `"2h"`), plus `d` for days.

/// Milliseconds, or `None` when `text` is not a duration.
pub fn parse_ms(text: &str) -> Option<u64> {
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    if let Ok(secs) = text.parse::<f64>() {
        return (secs >= 0.0 && secs.is_finite()).then(|| (secs * 1000.0).round() as u64);
    }
    let mut total = 0f64;
    let mut rest = text;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-6,
            "us" | "µs" => 1e-3,
            "ms" => 1.0,
            "s" => 1e3,
            "m" => 60e3,
            "h" => 3600e3,
            "d" => 86_400e3,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += number * scale;
    }
    total.is_finite().then(|| total.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_ms;

    #[test]
    fn argo_durations() {
        assert_eq!(parse_ms("1"), Some(1000));
        assert_eq!(parse_ms("20s"), Some(20_000));
        assert_eq!(parse_ms("1m30s"), Some(90_000));
        assert_eq!(parse_ms("500ms"), Some(500));
        assert_eq!(parse_ms("6h"), Some(6 * 3_600_000));
        assert_eq!(parse_ms("1d"), Some(86_400_000));
        assert_eq!(parse_ms("soon"), None);
        assert_eq!(parse_ms("5x"), None);
        assert_eq!(parse_ms("-1"), None);
    }
}
