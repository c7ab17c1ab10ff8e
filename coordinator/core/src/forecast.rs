//! Predictive reclaim: each service's load profile by time of day and of week, learned from
//! what its replicas report, so that nodes are taken back early enough to be serving before
//! the usual ramp. The lead time is the service's measured reclaim time (job stop, GPU check,
//! vLLM start, health), not a constant.
//!
//! Load is requests in the system (running + waiting, summed over replicas). For each
//! 10-minute slot the highest load seen is kept; when a slot ends, it is blended into the
//! profiles with an exponential average (half the weight to the newest observation).
//!
//! Beside the profile, the short term: the load smoothed over half a minute, the mean load
//! of each of the last minutes, a trend fitted to them, and the forecast's own error. Every minute the forecast made one lead time
//! earlier is compared with the highest load that actually came in between; the errors (in
//! replicas) go into a histogram that forgets with a half-life of a day, and the headroom kept
//! is a high quantile of it, so a service with a noisy load keeps more spare replicas than a
//! steady one, and the margin follows the service rather than a constant.

use std::collections::VecDeque;

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
    /// The last minutes' peaks and forecasts, and the forecast's errors. Not persisted: a
    /// restart learns them again within the hour.
    recent: Recent,
}

impl Default for Profile {
    fn default() -> Self {
        Self {
            weekly: vec![None; WEEK_SLOTS],
            daily: vec![None; DAY_SLOTS],
            current: None,
            recent: Recent::default(),
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

/// Minutes of peaks kept: enough for the trend, the lending window and the error of a
/// forecast made one lead time ago.
const RECENT_MIN: u64 = 120;
/// The trend is fitted to this many last complete minutes.
const TREND_MIN: u64 = 10;
/// Error histogram: bins of a tenth of a replica, from 0 to 30 replicas under-forecast.
const ERR_BIN: f64 = 0.1;
const ERR_BINS: usize = 300;
/// Each minute the histogram keeps this share of its weight: a half-life of one day.
const ERR_DECAY: f64 = 0.999_518_8;
/// The share of forecasts the headroom must cover. A replica planned at 80 % of its slots
/// still serves a load a quarter above the plan without queueing, so a forecast missed by
/// a little costs a capacity minute, not a user's wait: on the four ServeGen traces of
/// issue 22, 0.99 to 0.9985 gave the same queue-wait minutes, and 0.99 the most harvest
/// within 0.5 % capacity minutes (docs/BENCHMARKS.md).
const ERR_QUANTILE: f64 = 0.99;
/// Until this much error weight exists (about an hour), the headroom is the prior.
const ERR_MIN_WEIGHT: f64 = 60.0;

/// One minute of the short-term record.
#[derive(Debug, Clone, PartialEq)]
struct MinuteRecord {
    minute: u64,
    /// The load seen in the minute: sum and number of observations.
    sum: f64,
    count: u32,
    /// The forecast (without headroom) of the peak over the next lead time, made when the
    /// minute was first seen, with the lead it was made for, in minutes, and whether the
    /// profile knew the slots it covered.
    forecast: Option<(f64, u64, bool)>,
}

#[derive(Debug, Clone, PartialEq, Default)]
struct Recent {
    minutes: VecDeque<MinuteRecord>,
    /// The smoothed load, and when it was last fed.
    smooth: Option<(f64, UnixMillis)>,
    /// Replicas wanted (headroom included) as a sliding maximum: times increase and counts
    /// strictly decrease from front to back, so the most wanted since any time is the
    /// first entry at or after it.
    wanted: VecDeque<(UnixMillis, usize)>,
    /// The errors of forecasts made without the profile (index 0: the first day, or slots
    /// never seen) and with it (index 1), kept apart: a ramp that surprised the service
    /// before it had a profile says little about the error once the profile knows the ramp.
    errors: [Errors; 2],
}

#[derive(Debug, Clone, PartialEq)]
struct Errors {
    /// Decayed weight of under-forecasts per bin; over-forecasts count in `total` only.
    bins: Vec<f64>,
    total: f64,
    /// The under-forecast that `ERR_QUANTILE` of the errors stayed within, as of the last
    /// error recorded (the headroom reads it every decision; errors come once a minute).
    within: f64,
}

impl Default for Errors {
    fn default() -> Self {
        Self {
            bins: vec![0.0; ERR_BINS],
            total: 0.0,
            within: 0.0,
        }
    }
}

impl MinuteRecord {
    fn mean(&self) -> f64 {
        self.sum / f64::from(self.count.max(1))
    }
}

/// What the short term says about the next lead time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShortTerm {
    /// The load now, smoothed.
    pub level: f64,
    /// The trend line's value one lead time ahead (at least `level`).
    pub trend: f64,
    /// Replicas to keep beyond the forecast: a high quantile of its past errors.
    pub headroom: f64,
}

impl Profile {
    /// Records the load seen now for the short term, smoothed with an exponential average
    /// of time constant `smooth_ms`. `per_replica` is the load one replica carries, so that
    /// forecast errors are counted in replicas. When this starts a new minute, returns the
    /// start and the mean load of the last minute recorded, for [`Profile::observe`].
    pub fn observe_recent(
        &mut self,
        now: UnixMillis,
        load: f64,
        per_replica: f64,
        smooth_ms: u64,
    ) -> Option<(UnixMillis, f64)> {
        let minute = now / 60_000;
        let r = &mut self.recent;
        r.smooth = Some(match r.smooth {
            Some((v, t)) if now > t => {
                let a = 1.0 - (-((now - t) as f64) / smooth_ms.max(1) as f64).exp();
                (v + a * (load - v), now)
            }
            Some(old) => old,
            None => (load, now),
        });
        match r.minutes.back_mut() {
            Some(m) if m.minute == minute => {
                m.sum += load;
                m.count += 1;
                return None;
            }
            Some(m) if m.minute > minute => return None,
            _ => {}
        }
        let closed = r.minutes.back().map(|m| (m.minute * 60_000, m.mean()));
        // A new minute: the forecasts whose lead time has now passed are checked against
        // the highest minute mean that came during it, then the record moves on.
        let per = per_replica.max(f64::MIN_POSITIVE);
        let mut checked = Vec::new();
        for i in 0..r.minutes.len() {
            let Some((f, lead, with_profile)) = r.minutes[i].forecast else {
                continue;
            };
            let end = r.minutes[i].minute + lead;
            if end >= minute {
                continue;
            }
            let actual = r
                .minutes
                .iter()
                .skip(i)
                .take_while(|n| n.minute <= end)
                .map(MinuteRecord::mean)
                .fold(f64::MIN, f64::max);
            checked.push(((actual - f) / per, with_profile));
            r.minutes[i].forecast = None;
        }
        for (e, with_profile) in checked {
            r.errors[usize::from(with_profile)].record(e);
        }
        r.minutes.push_back(MinuteRecord {
            minute,
            sum: load,
            count: 1,
            forecast: None,
        });
        while r
            .minutes
            .front()
            .is_some_and(|m| m.minute + RECENT_MIN < minute)
        {
            r.minutes.pop_front();
        }
        closed
    }

    /// Records the forecast made now (without headroom) of the peak over the next
    /// `lead_ms`, `with_profile` when the profile contributed: the minute's first is
    /// checked one lead time later. `wanted` is the replicas wanted now, headroom included.
    pub fn note_forecast(
        &mut self,
        now: UnixMillis,
        forecast: f64,
        with_profile: bool,
        lead_ms: u64,
        wanted: usize,
    ) {
        let r = &mut self.recent;
        while r.wanted.back().is_some_and(|&(_, w)| w <= wanted) {
            r.wanted.pop_back();
        }
        r.wanted.push_back((now, wanted));
        while r
            .wanted
            .front()
            .is_some_and(|&(t, _)| t + RECENT_MIN * 60_000 < now)
        {
            r.wanted.pop_front();
        }
        if let Some(m) = r
            .minutes
            .back_mut()
            .filter(|m| m.minute == now / 60_000 && m.forecast.is_none())
        {
            m.forecast = Some((forecast, lead_ms.div_ceil(60_000), with_profile));
        }
    }

    /// The short-term view at `now` for a lead of `lead_ms`, counting `load` seen now, for
    /// a forecast made with or without the profile. `prior_headroom` (replicas) stands in
    /// for the error quantile until enough errors of that kind were seen.
    pub fn short_term(
        &self,
        now: UnixMillis,
        load: f64,
        lead_ms: u64,
        with_profile: bool,
        prior_headroom: f64,
    ) -> ShortTerm {
        let minute = now / 60_000;
        let r = &self.recent;
        let level = r.smooth.map_or(load, |(v, _)| v);
        // Least squares over the last complete minutes' means, newest first. The record's
        // minutes increase, so the walk stops at the first one too old for the trend.
        let points = || {
            r.minutes
                .iter()
                .rev()
                .skip_while(|m| m.minute >= minute)
                .take_while(|m| m.minute + TREND_MIN >= minute)
                .map(|m| (m.minute as f64 - minute as f64, m.mean()))
        };
        let mut trend = level;
        let count = points().count();
        if count >= 3 {
            let n = count as f64;
            let (sx, sy) = points().fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
            let (mx, my) = (sx / n, sy / n);
            let sxx: f64 = points().map(|(x, _)| (x - mx).powi(2)).sum();
            let sxy: f64 = points().map(|(x, y)| (x - mx) * (y - my)).sum();
            if sxx > 0.0 {
                let slope = sxy / sxx;
                let ahead = lead_ms as f64 / 60_000.0;
                trend = trend.max(my + slope * (ahead - mx));
            }
        }
        // A forecast with the profile whose errors are not yet known (the profile's first
        // hour, on the second day) borrows those measured without it, which are larger.
        let own = &r.errors[usize::from(with_profile)];
        let without = &r.errors[0];
        let headroom = if own.total >= ERR_MIN_WEIGHT {
            own.within
        } else if with_profile && without.total >= ERR_MIN_WEIGHT {
            without.within
        } else {
            prior_headroom
        };
        ShortTerm {
            level,
            trend,
            headroom,
        }
    }

    /// The most replicas wanted at any observation since `since`.
    pub fn wanted_since(&self, since: UnixMillis) -> Option<usize> {
        self.recent
            .wanted
            .iter()
            .find(|&&(t, _)| t >= since)
            .map(|&(_, w)| w)
    }
}

impl Errors {
    fn record(&mut self, replicas: f64) {
        for w in &mut self.bins {
            *w *= ERR_DECAY;
        }
        self.total = self.total * ERR_DECAY + 1.0;
        if replicas > 0.0 {
            let bin = ((replicas / ERR_BIN) as usize).min(ERR_BINS - 1);
            self.bins[bin] += 1.0;
        }
        self.within = self.quantile(ERR_QUANTILE);
    }

    /// The under-forecast, in replicas, that a share `q` of the errors stayed within.
    fn quantile(&self, q: f64) -> f64 {
        let mut tail = 0.0;
        let allowed = (1.0 - q) * self.total;
        for (i, w) in self.bins.iter().enumerate().rev() {
            tail += w;
            if tail > allowed {
                return (i + 1) as f64 * ERR_BIN;
            }
        }
        0.0
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

    #[test]
    fn a_rising_load_is_extrapolated_one_lead_time_ahead() {
        let mut p = Profile::default();
        // Ten minutes rising by 10 a minute, observed every 5 s.
        for s in (0..600).step_by(5) {
            let load = (s / 60) as f64 * 10.0;
            p.observe_recent(MONDAY + s * 1_000, load, 10.0, 1);
            p.note_forecast(MONDAY + s * 1_000, load, false, 5 * MIN, 1);
        }
        let st = p.short_term(MONDAY + 600_000, 100.0, 5 * MIN, false, 0.0);
        // The fitted line reaches 100 now and 150 five minutes on.
        assert!((st.trend - 150.0).abs() < 1.0, "trend {}", st.trend);
        assert!(st.level <= 100.0);
    }

    #[test]
    fn headroom_is_the_forecast_error_a_high_share_of_minutes_stayed_within() {
        let mut p = Profile::default();
        // Three hours: the forecast says 100, the load is 100, except every 20 minutes
        // one minute of 130 (3 replicas of 10 over the forecast).
        for minute in 0..180u64 {
            let load = if minute % 20 == 19 { 130.0 } else { 100.0 };
            p.observe_recent(MONDAY + minute * MIN, load, 10.0, 1);
            p.note_forecast(MONDAY + minute * MIN, 100.0, true, MIN, 1);
        }
        let with = p.short_term(MONDAY + 180 * MIN, 100.0, MIN, true, 0.0);
        // A surprise in one minute of 20 is 5 % of the lead-time windows (each spans two
        // minutes, so 10 %): far more than the 0.2 % the headroom may miss.
        assert!(
            (with.headroom - 3.0).abs() < 0.15,
            "headroom {}",
            with.headroom
        );
        // No errors were measured for forecasts without the profile: the prior stands.
        let without = p.short_term(MONDAY + 180 * MIN, 100.0, MIN, false, 0.5);
        assert_eq!(without.headroom, 0.5);
    }

    #[test]
    fn a_forecast_with_a_new_profile_borrows_the_errors_measured_without_it() {
        let mut p = Profile::default();
        // Two hours of forecasts without the profile, every tenth minute 2 replicas short.
        for minute in 0..120u64 {
            let load = if minute % 10 == 9 { 120.0 } else { 100.0 };
            p.observe_recent(MONDAY + minute * MIN, load, 10.0, 1);
            p.note_forecast(MONDAY + minute * MIN, 100.0, false, MIN, 1);
        }
        let now = MONDAY + 120 * MIN;
        let without = p.short_term(now, 100.0, MIN, false, 0.0).headroom;
        assert!((without - 2.0).abs() < 0.15, "headroom {without}");
        // No forecast with the profile was checked yet: not the prior 0, but those errors.
        let with = p.short_term(now, 100.0, MIN, true, 0.0).headroom;
        assert_eq!(with, without);
    }

    #[test]
    fn the_most_wanted_since_a_time_is_a_sliding_maximum() {
        let mut p = Profile::default();
        for (s, wanted) in [(0, 3), (10, 5), (20, 2), (30, 4), (40, 1)] {
            p.note_forecast(MONDAY + s * 1_000, 0.0, false, MIN, wanted);
        }
        assert_eq!(p.wanted_since(MONDAY), Some(5));
        assert_eq!(p.wanted_since(MONDAY + 15_000), Some(4));
        assert_eq!(p.wanted_since(MONDAY + 35_000), Some(1));
        assert_eq!(p.wanted_since(MONDAY + 50_000), None);
    }
}
