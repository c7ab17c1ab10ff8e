//! Accounting: turns per-lease usage records ([`Usage`]) into a [`Report`] over a period,
//! grouped by team, job, day or month (UTC). A lease is counted for the part of it inside the
//! period; a lease spanning midnight is split between its days. Pure date arithmetic: the
//! service builds reports with it and the CLI reads and shows their dates with it.

use std::collections::BTreeMap;

use nightshift_common::{Report, ReportGroup, ReportTotals, UnixMillis};

use crate::Usage;

const HOUR_MS: f64 = 3_600_000.0;
/// A UTC day.
pub const DAY_MS: u64 = 86_400_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupBy {
    Team,
    Job,
    Day,
    Month,
}

impl std::str::FromStr for GroupBy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "team" => Ok(Self::Team),
            "job" => Ok(Self::Job),
            "day" => Ok(Self::Day),
            "month" => Ok(Self::Month),
            other => Err(format!("by: {other:?} is not one of team, job, day, month")),
        }
    }
}

impl GroupBy {
    fn as_str(self) -> &'static str {
        match self {
            Self::Team => "team",
            Self::Job => "job",
            Self::Day => "day",
            Self::Month => "month",
        }
    }
}

/// Builds the report of `[since, until)` from usage records (ended leases, and running ones
/// with `ended_at` = now).
pub fn build(
    usage: &[Usage],
    since: UnixMillis,
    until: UnixMillis,
    by: Option<GroupBy>,
    price_per_gpu_hour: f64,
    currency: &str,
) -> Report {
    let hours = (until.saturating_sub(since) as f64 / HOUR_MS).max(f64::MIN_POSITIVE);
    let mut totals = Acc::default();
    let mut groups: BTreeMap<String, Acc> = BTreeMap::new();
    for u in usage {
        let (start, end) = (u.started_at.max(since), u.ended_at.min(until));
        let ended_inside = (since..until).contains(&u.ended_at);
        if start >= end && !ended_inside {
            continue;
        }
        totals.add(u, start, end, ended_inside);
        match by {
            None => {}
            Some(GroupBy::Team) => {
                groups
                    .entry(u.team.clone())
                    .or_default()
                    .add(u, start, end, ended_inside)
            }
            Some(GroupBy::Job) => {
                groups
                    .entry(u.job_id.to_string())
                    .or_default()
                    .add(u, start, end, ended_inside)
            }
            Some(GroupBy::Day | GroupBy::Month) => {
                // Split at UTC midnights; the preemption belongs to the day it ended on.
                let mut t = start;
                while t < end {
                    let next = ((t / DAY_MS) + 1) * DAY_MS;
                    let piece_end = next.min(end);
                    let key = period_key(t, by == Some(GroupBy::Month));
                    let last = piece_end == end;
                    groups
                        .entry(key)
                        .or_default()
                        .add(u, t, piece_end, ended_inside && last);
                    t = piece_end;
                }
                if start >= end && ended_inside {
                    let key = period_key(u.ended_at, by == Some(GroupBy::Month));
                    groups.entry(key).or_default().add(u, end, end, true);
                }
            }
        }
    }
    Report {
        since,
        until,
        by: by.map(|b| b.as_str().to_owned()),
        currency: currency.to_owned(),
        price_per_gpu_hour,
        totals: totals.finish(hours, price_per_gpu_hour),
        groups: groups
            .into_iter()
            .map(|(key, acc)| ReportGroup {
                key,
                totals: acc.finish(hours, price_per_gpu_hour),
            })
            .collect(),
    }
}

#[derive(Debug, Default)]
struct Acc {
    gpu_ms: u64,
    lost_gpu_ms: u64,
    preemptions: u64,
    leases: u64,
}

impl Acc {
    fn add(&mut self, u: &Usage, start: UnixMillis, end: UnixMillis, ended_inside: bool) {
        self.gpu_ms += end.saturating_sub(start) * u64::from(u.gpus);
        self.leases += 1;
        if ended_inside && u.preempted {
            self.preemptions += 1;
            self.lost_gpu_ms += u.lost_gpu_ms;
        }
    }

    fn finish(&self, hours: f64, price: f64) -> ReportTotals {
        let harvested = self.gpu_ms as f64 / HOUR_MS;
        ReportTotals {
            harvested_gpu_hours: round(harvested),
            equivalent_gpus: round(harvested / hours),
            savings: round(harvested * price),
            preemptions: self.preemptions,
            lost_gpu_hours: round(self.lost_gpu_ms as f64 / HOUR_MS),
            leases: self.leases,
        }
    }
}

/// Figures are kept to the microsecond-GPU-hour; displays round further.
fn round(v: f64) -> f64 {
    (v * 1e9).round() / 1e9
}

/// `YYYY-MM-DD` or `YYYY-MM` of a Unix time, in UTC.
pub fn period_key(t: UnixMillis, month: bool) -> String {
    let (y, m, d) = civil_from_days((t / DAY_MS) as i64);
    if month {
        format!("{y:04}-{m:02}")
    } else {
        format!("{y:04}-{m:02}-{d:02}")
    }
}

/// The first millisecond of `t`'s day (UTC).
pub fn day_start(t: UnixMillis) -> UnixMillis {
    t - t % DAY_MS
}

/// The first millisecond of `t`'s month (UTC).
pub fn month_start(t: UnixMillis) -> UnixMillis {
    let (y, m, _) = civil_from_days((t / DAY_MS) as i64);
    days_from_civil(y, m, 1) as u64 * DAY_MS
}

/// Howard Hinnant's `civil_from_days`: days since 1970-01-01 → (year, month, day).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Days since 1970-01-01 of a civil date (the inverse of `civil_from_days`).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = i64::from(if m > 2 { m - 3 } else { m + 9 });
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Parses `2026-12-01`, `2026-12-01T06:30:00Z`, a relative `7d`/`12h`/`30m` before `now`,
/// or `now`, into Unix milliseconds.
pub fn parse_time(text: &str, now: UnixMillis) -> Result<UnixMillis, String> {
    let bad = || {
        format!(
            "{text:?} is not a date (2026-12-01, 2026-12-01T06:30:00Z) or an age (7d, 12h, 30m)"
        )
    };
    if text == "now" {
        return Ok(now);
    }
    if let Some((n, unit)) = text.char_indices().last().map(|(i, c)| (&text[..i], c))
        && let Ok(n) = n.parse::<u64>()
    {
        let ms = match unit {
            'd' => 86_400_000,
            'h' => 3_600_000,
            'm' => 60_000,
            's' => 1_000,
            _ => return Err(bad()),
        };
        return Ok(now.saturating_sub(n * ms));
    }
    let (date, time) = text.split_once('T').unwrap_or((text, "00:00:00Z"));
    let mut parts = date.splitn(3, '-').map(str::parse::<i64>);
    let (Some(Ok(y)), Some(Ok(m)), Some(Ok(d))) = (parts.next(), parts.next(), parts.next()) else {
        return Err(bad());
    };
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) || y < 1970 {
        return Err(bad());
    }
    let time = time.strip_suffix('Z').ok_or_else(bad)?;
    let mut hms = time.splitn(3, ':').map(str::parse::<u64>);
    let (Some(Ok(h)), Some(Ok(mi)), Some(Ok(s))) = (hms.next(), hms.next(), hms.next()) else {
        return Err(bad());
    };
    if h > 23 || mi > 59 || s > 59 {
        return Err(bad());
    }
    let days = days_from_civil(y, m as u32, d as u32) as u64;
    Ok(days * DAY_MS + (h * 3600 + mi * 60 + s) * 1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: u64 = 3_600_000;

    fn usage(id: u64, team: &str, gpus: u32, start_h: u64, end_h: u64, preempted: bool) -> Usage {
        Usage {
            lease_id: id,
            job_id: id,
            team: team.into(),
            node: "n".into(),
            gpus,
            started_at: start_h * H,
            ended_at: end_h * H,
            preempted,
            lost_gpu_ms: if preempted {
                u64::from(gpus) * H / 2
            } else {
                0
            },
        }
    }

    #[test]
    fn totals_are_the_sum_of_the_leases_clipped_to_the_period() {
        let rows = [
            usage(1, "nlp", 4, 0, 10, false),
            usage(2, "cv", 2, 5, 20, true),
        ];
        let r = build(&rows, 0, 24 * H, None, 2.5, "EUR");
        assert_eq!(r.totals.harvested_gpu_hours, 40.0 + 30.0);
        assert!(
            (r.totals.equivalent_gpus - 70.0 / 24.0).abs() < 1e-6,
            "70 GPU-hours over 24 hours"
        );
        assert_eq!(r.totals.savings, 175.0);
        assert_eq!((r.totals.preemptions, r.totals.lost_gpu_hours), (1, 1.0));
        let clipped = build(&rows, 8 * H, 12 * H, Some(GroupBy::Team), 1.0, "USD");
        assert_eq!(clipped.totals.harvested_gpu_hours, 2.0 * 4.0 + 4.0 * 2.0);
        assert_eq!(
            clipped.totals.preemptions, 0,
            "the preemption ended after the period"
        );
        let keys: Vec<_> = clipped
            .groups
            .iter()
            .map(|g| (g.key.as_str(), g.totals.harvested_gpu_hours))
            .collect();
        assert_eq!(keys, vec![("cv", 8.0), ("nlp", 8.0)]);
    }

    #[test]
    fn a_lease_over_midnight_is_split_between_its_days() {
        let day = days_from_civil(2025, 12, 2) as u64 * DAY_MS;
        let u = Usage {
            started_at: day - 2 * H,
            ended_at: day + 3 * H,
            ..usage(1, "t", 1, 0, 0, false)
        };
        let r = build(
            &[u],
            day - DAY_MS,
            day + DAY_MS,
            Some(GroupBy::Day),
            1.0,
            "USD",
        );
        let keys: Vec<_> = r
            .groups
            .iter()
            .map(|g| (g.key.as_str(), g.totals.harvested_gpu_hours))
            .collect();
        assert_eq!(keys, vec![("2025-12-01", 2.0), ("2025-12-02", 3.0)]);
    }

    #[test]
    fn dates_and_ages_parse() {
        assert_eq!(parse_time("1970-01-02", 0), Ok(DAY_MS));
        assert_eq!(
            parse_time("2026-12-02T06:30:00Z", 0).map(|t| period_key(t, false)),
            Ok("2026-12-02".into())
        );
        assert_eq!(parse_time("7d", 10 * DAY_MS), Ok(3 * DAY_MS));
        assert!(
            parse_time("2026-13-01", 0)
                .unwrap_err()
                .contains("is not a date")
        );
        assert!(parse_time("yesterday", 0).is_err());
    }

    #[test]
    fn days_and_months_start_at_utc_midnight() {
        let t = parse_time("2026-12-05T17:40:12Z", 0).unwrap();
        assert_eq!(day_start(t), parse_time("2026-12-05", 0).unwrap());
        assert_eq!(month_start(t), parse_time("2026-12-01", 0).unwrap());
        let first = parse_time("2026-03-01", 0).unwrap();
        assert_eq!(month_start(first), first);
        assert_eq!(month_start(first - 1), parse_time("2026-02-01", 0).unwrap());
    }
}
