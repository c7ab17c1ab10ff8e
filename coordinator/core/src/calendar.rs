//! Harvest windows: when a service may lend its replicas, as weekly calendar entries such as
//! `Mon-Fri 20:00-08:00` (a window that crosses midnight belongs to the day it starts on) or
//! `Sat-Sun 00:00-24:00`. Times are local: the caller gives the offset from UTC.

use nightshift_common::UnixMillis;

const MINUTE_MS: u64 = 60_000;
const DAY_MIN: u32 = 24 * 60;
const WEEK_MIN: u32 = 7 * DAY_MIN;

/// One weekly window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HarvestWindow {
    /// Bit 0 is Monday, bit 6 Sunday: the days the window starts on.
    pub days: u8,
    /// Minutes after local midnight.
    pub start: u32,
    /// Minutes after local midnight; at or before `start` means the next day.
    pub end: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?}: {rule}")]
pub struct WindowError {
    pub text: String,
    pub rule: String,
}

const DAYS: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

impl std::str::FromStr for HarvestWindow {
    type Err = WindowError;

    /// `Mon-Fri 20:00-08:00`, `Sat,Sun 00:00-24:00`, `daily 22:00-06:00`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let err = |rule: &str| WindowError {
            text: text.to_owned(),
            rule: rule.to_owned(),
        };
        let (days, times) = text
            .trim()
            .split_once(' ')
            .ok_or_else(|| err("expected DAYS HH:MM-HH:MM, e.g. \"Mon-Fri 20:00-08:00\""))?;
        let days =
            parse_days(days).ok_or_else(|| err("days must be like Mon-Fri, Sat,Sun or daily"))?;
        let (start, end) = times
            .trim()
            .split_once('-')
            .ok_or_else(|| err("times must be HH:MM-HH:MM"))?;
        let (start, end) = (
            parse_minute(start)
                .ok_or_else(|| err("start must be HH:MM between 00:00 and 24:00"))?,
            parse_minute(end).ok_or_else(|| err("end must be HH:MM between 00:00 and 24:00"))?,
        );
        if start == end || start == DAY_MIN {
            return Err(err("a window must not be empty"));
        }
        Ok(Self { days, start, end })
    }
}

fn parse_days(text: &str) -> Option<u8> {
    let text = text.to_ascii_lowercase();
    if text == "daily" {
        return Some(0x7f);
    }
    let index = |d: &str| DAYS.iter().position(|x| *x == d);
    let mut mask = 0u8;
    for part in text.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (index(a)?, index(b)?);
                let mut d = a;
                loop {
                    mask |= 1 << d;
                    if d == b {
                        break;
                    }
                    d = (d + 1) % 7;
                }
            }
            None => mask |= 1 << index(part)?,
        }
    }
    Some(mask)
}

fn parse_minute(text: &str) -> Option<u32> {
    let (h, m) = text.split_once(':')?;
    let (h, m): (u32, u32) = (h.parse().ok()?, m.parse().ok()?);
    let minute = h * 60 + m;
    (m < 60 && minute <= DAY_MIN).then_some(minute)
}

/// Local minute of the week (0 = Monday 00:00).
pub fn minute_of_week(now: UnixMillis, utc_offset_minutes: i32) -> u32 {
    let minutes = (now / MINUTE_MS) as i64 + i64::from(utc_offset_minutes);
    // 1970-01-01 was a Thursday: day 3 of a Monday-first week.
    ((minutes + 3 * i64::from(DAY_MIN)).rem_euclid(i64::from(WEEK_MIN))) as u32
}

impl HarvestWindow {
    /// Whether local minute-of-week `m` falls inside this window.
    fn contains(&self, m: u32) -> bool {
        let length = if self.end > self.start {
            self.end - self.start
        } else {
            DAY_MIN - self.start + self.end
        };
        (0..7u32).filter(|d| self.days & (1 << d) != 0).any(|d| {
            let start = d * DAY_MIN + self.start;
            (m + WEEK_MIN - start) % WEEK_MIN < length
        })
    }
}

/// Whether lending is allowed at `now`, and stays allowed for at least `lead_ms` more (so a
/// window's end is met with replicas already serving). No windows means always.
pub fn open_for(
    windows: &[HarvestWindow],
    now: UnixMillis,
    lead_ms: u64,
    utc_offset_minutes: i32,
) -> bool {
    if windows.is_empty() {
        return true;
    }
    let inside = |t: UnixMillis| {
        let m = minute_of_week(t, utc_offset_minutes);
        windows.iter().any(|w| w.contains(m))
    };
    inside(now) && inside(now + lead_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Monday 2026-11-30 00:00 UTC, in Unix ms.
    const MONDAY: u64 = 1_795_996_800_000;
    const H: u64 = 3_600_000;

    #[test]
    fn monday_is_minute_zero() {
        assert_eq!(minute_of_week(MONDAY, 0), 0);
        assert_eq!(minute_of_week(MONDAY + 25 * H, 0), DAY_MIN + 60);
        assert_eq!(
            minute_of_week(MONDAY, -60),
            WEEK_MIN - 60,
            "Sunday 23:00 one hour west"
        );
    }

    #[test]
    fn a_night_window_crosses_midnight_and_skips_the_weekend_start() {
        let w: HarvestWindow = "Mon-Fri 20:00-08:00".parse().unwrap();
        let open = |t| open_for(&[w], t, 0, 0);
        assert!(!open(MONDAY + 12 * H));
        assert!(open(MONDAY + 21 * H));
        assert!(
            open(MONDAY + 31 * H),
            "Tuesday 07:00 still belongs to Monday's night"
        );
        assert!(!open(MONDAY + 32 * H));
        assert!(open(MONDAY + 4 * 24 * H + 23 * H), "Friday night");
        assert!(
            open(MONDAY + 5 * 24 * H + 7 * H),
            "Saturday 07:00, Friday's night"
        );
        assert!(
            !open(MONDAY + 5 * 24 * H + 21 * H),
            "no window starts on Saturday"
        );
    }

    #[test]
    fn the_lead_time_closes_the_window_early() {
        let w: HarvestWindow = "daily 20:00-08:00".parse().unwrap();
        assert!(
            open_for(&[w], MONDAY + 30 * H, H, 0),
            "06:00 with an hour's lead"
        );
        assert!(
            !open_for(&[w], MONDAY + 31 * H + H / 2, H, 0),
            "07:30 with an hour's lead"
        );
    }

    #[test]
    fn bad_windows_say_why() {
        let e = "Mon-Fri 20:00".parse::<HarvestWindow>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "\"Mon-Fri 20:00\": times must be HH:MM-HH:MM"
        );
        assert!("Someday 20:00-08:00".parse::<HarvestWindow>().is_err());
        assert!("Mon 25:00-08:00".parse::<HarvestWindow>().is_err());
        assert!(
            "Mon 08:00-08:00"
                .parse::<HarvestWindow>()
                .unwrap_err()
                .to_string()
                .contains("empty")
        );
        assert_eq!(
            "Sat,Sun 00:00-24:00".parse::<HarvestWindow>().unwrap().days,
            0b110_0000
        );
    }
}
