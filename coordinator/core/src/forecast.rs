//! Predictive reclaim: each service's load profile by time of day and of week, learned from
//! what its replicas report, so that nodes are taken back early enough to be serving before
//! the usual ramp. The lead time is the service's measured reclaim time (job stop, GPU check,
//! vLLM start, health), not a constant.
//!
//! Load is requests in the system (running + waiting, summed over replicas). For each
//! 10-minute slot the highest load seen is kept; when a slot ends, it is blended into the
//! profiles with an exponential average (half the weight to the newest observation).

use nightshift_common::UnixMillis;

use crate::calendar::minute_of_week;

const SLOT_MIN: u32 = 10;
const DAY_SLOTS: usize = (24 * 60 / SLOT_MIN) as usize;
const WEEK_SLOTS: usize = 7 * DAY_SLOTS;

#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// Expected peak load per slot of the week; `None` until seen.
    pub weekly: Vec<Option<f64>>,
    /// Expected peak load per slot of the day; `None` until seen.
    pub daily: Vec<Option<f64>>,
    /// The slot being observed and the highest load seen in it so far.
    current: Option<(usize, f64)>,
}

impl Default for Profile {
    fn default() -> Self {
        Self {
            weekly: vec![None; WEEK_SLOTS],
            daily: vec![None; DAY_SLOTS],
            current: None,
        }
    }
}

impl Profile {
    /// A profile rebuilt from what was persisted; the slot being observed starts afresh.
    pub fn from_parts(weekly: Vec<Option<f64>>, daily: Vec<Option<f64>>) -> Self {
        let mut p = Self::default();
        if weekly.len() == WEEK_SLOTS {
            p.weekly = weekly;
        }
        if daily.len() == DAY_SLOTS {
            p.daily = daily;
        }
        p
    }
}

fn slot(now: UnixMillis, utc_offset_minutes: i32) -> usize {
    (minute_of_week(now, utc_offset_minutes) / SLOT_MIN) as usize
}

fn blend(old: Option<f64>, new: f64) -> Option<f64> {
    Some(old.map_or(new, |o| 0.5 * o + 0.5 * new))
}

impl Profile {
    /// Records the load seen now. Returns true when a slot ended and the profile changed.
    pub fn observe(&mut self, now: UnixMillis, utc_offset_minutes: i32, load: f64) -> bool {
        let s = slot(now, utc_offset_minutes);
        match self.current {
            Some((cur, peak)) if cur == s => {
                self.current = Some((cur, peak.max(load)));
                false
            }
            Some((cur, peak)) => {
                self.weekly[cur] = blend(self.weekly[cur], peak);
                let d = cur % DAY_SLOTS;
                self.daily[d] = blend(self.daily[d], peak);
                self.current = Some((s, load));
                true
            }
            None => {
                self.current = Some((s, load));
                false
            }
        }
    }

    /// The expected peak load at `at`: this slot of the week if it was ever seen, else this
    /// slot of the day, else unknown.
    pub fn predict(&self, at: UnixMillis, utc_offset_minutes: i32) -> Option<f64> {
        let s = slot(at, utc_offset_minutes);
        self.weekly[s].or(self.daily[s % DAY_SLOTS])
    }

    /// The highest expected load over `[from, to]`, slot by slot.
    pub fn predict_peak(
        &self,
        from: UnixMillis,
        to: UnixMillis,
        utc_offset_minutes: i32,
    ) -> Option<f64> {
        let step = u64::from(SLOT_MIN) * 60_000;
        let mut t = from;
        let mut peak: Option<f64> = None;
        while t <= to {
            if let Some(p) = self.predict(t, utc_offset_minutes) {
                peak = Some(peak.map_or(p, |q| q.max(p)));
            }
            t += step;
        }
        if let Some(p) = self.predict(to, utc_offset_minutes) {
            peak = Some(peak.map_or(p, |q| q.max(p)));
        }
        peak
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MONDAY: u64 = 1_795_996_800_000;
    const MIN: u64 = 60_000;
    const DAY: u64 = 24 * 60 * MIN;

    #[test]
    fn yesterdays_ramp_is_expected_today() {
        let mut p = Profile::default();
        // Monday: quiet at night, a ramp to 40 at 08:00.
        for minute in (0..24 * 60).step_by(5) {
            let load = if (8 * 60..20 * 60).contains(&minute) {
                40.0
            } else {
                2.0
            };
            p.observe(MONDAY + minute * MIN, 0, load);
        }
        p.observe(MONDAY + DAY, 0, 0.0);
        let tuesday = MONDAY + DAY;
        assert_eq!(p.predict(tuesday + 7 * 60 * MIN, 0), Some(2.0));
        assert_eq!(p.predict(tuesday + 8 * 60 * MIN, 0), Some(40.0));
        assert_eq!(
            p.predict_peak(tuesday + 7 * 60 * MIN, tuesday + 8 * 60 * MIN, 0),
            Some(40.0)
        );
        // Only Monday's slots of the week are known.
        assert_eq!(p.weekly[slot(tuesday + 8 * 60 * MIN, 0)], None);
    }

    #[test]
    fn observations_blend_week_over_week() {
        let mut p = Profile::default();
        p.observe(MONDAY, 0, 10.0);
        p.observe(MONDAY + 10 * MIN, 0, 0.0);
        p.observe(MONDAY + 7 * DAY, 0, 30.0);
        p.observe(MONDAY + 7 * DAY + 10 * MIN, 0, 0.0);
        assert_eq!(p.predict(MONDAY + 14 * DAY, 0), Some(20.0));
    }
}
