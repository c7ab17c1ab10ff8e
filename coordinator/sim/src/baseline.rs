//! What the baselines know with hindsight: the replicas each minute needs, the oracle's
//! harvest, and the best fixed daily window, which the core then runs as its own schedule
//! ([`window_config`]): the same placement, lending and reclaim code as every other policy.

use nightshift_core::{CoreConfig, HarvestWindow};

use crate::config::SimConfig;
use crate::model::ReplicaModel;
use crate::timeline::MinuteSample;

/// Every day, `lent` nodes are lent from `start_s` to `end_s` (seconds after midnight; a
/// window may wrap past midnight).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub start_s: u64,
    pub end_s: u64,
    pub lent: u32,
}

/// The core's configuration for a fixed daily window: harvesting only inside it (every
/// lent node taken back as it closes, a reclaim lead before its end), `window.lent` nodes
/// beyond `max_replicas` lent whatever the load as far as the queue uses them, none lent
/// for low load, none taken back for pressure inside the window, and no forecast. Jobs are
/// placed by the core's one placement model, as under every other policy.
pub fn window_config(cfg: &SimConfig, window: Window) -> CoreConfig {
    let mut core = cfg.core_config();
    for service in &mut core.services {
        service.predictive = false;
        service.harvest_windows = vec![HarvestWindow {
            days: 0x7f,
            start: (window.start_s / 60) as u32,
            end: (window.end_s / 60) as u32,
        }];
        // The simulation's clock starts at a UTC midnight, as the window's seconds do.
        service.utc_offset_minutes = 0;
        service.max_replicas = Some(cfg.nodes.saturating_sub(window.lent));
        // Never low enough to lend more: only the window's nodes are lent.
        service.scale_down.max_waiting = -1.0;
    }
    core
}

/// Replicas each minute needs: the minute's mean arrival rate over one replica's capacity
/// at its target utilisation, rounded up, at least `floor`.
pub fn need_per_minute(arrivals: &[u32], model: &ReplicaModel, floor: u32) -> Vec<u32> {
    arrivals
        .chunks(60)
        .map(|c| {
            let rate = c.iter().map(|&a| f64::from(a)).sum::<f64>() / c.len() as f64;
            model.needed(rate, floor)
        })
        .collect()
}

/// Perfect foresight and free transitions: every node the load does not need, every minute,
/// lends all its GPUs to useful work.
pub fn oracle_gpu_hours(need: &[u32], nodes: u32, gpus_per_node: u32) -> f64 {
    need.iter()
        .map(|&n| f64::from(nodes.saturating_sub(n) * gpus_per_node) / 60.0)
        .sum()
}

/// The oracle's run minute by minute: exactly the need serves, every other node is lent.
pub fn oracle_timeline(arrivals: &[u32], need: &[u32], nodes: u32) -> Vec<MinuteSample> {
    arrivals
        .chunks(60)
        .zip(need)
        .map(|(a, &n)| MinuteSample {
            arrivals: a.iter().map(|&a| f64::from(a)).sum(),
            min_ready: n.min(nodes),
            max_up: n.min(nodes),
            max_lent: nodes.saturating_sub(n),
            ..MinuteSample::default()
        })
        .collect()
}

/// Slots of the day a window may start or end on.
const SLOT_S: u64 = 1_800;
const SLOTS: usize = (86_400 / SLOT_S) as usize;

/// The highest need in each half hour of the day over the whole trace, each slot widened
/// by `margin_s` after it (lent replicas must be back before the load they serve arrives).
fn slot_peaks(need: &[u32]) -> [u32; SLOTS] {
    let mut peak = [0u32; SLOTS];
    for (m, &n) in need.iter().enumerate() {
        let slot = (m as u64 * 60 % 86_400 / SLOT_S) as usize;
        peak[slot] = peak[slot].max(n);
    }
    peak
}

/// The most replicas that can be lent over `start..start+len` slots every day without the
/// remaining ones falling below any minute's need, including `margin_slots` after the window
/// while the lent replicas start again.
fn lendable(peak: &[u32; SLOTS], start: usize, len: usize, margin_slots: usize, nodes: u32) -> u32 {
    let worst = (start..start + len + margin_slots)
        .map(|i| peak[i % SLOTS])
        .max()
        .unwrap_or(0);
    nodes.saturating_sub(worst)
}

/// The fixed daily window and lent count with the most lent GPU-hours that never leaves
/// fewer replicas than a minute of the trace needed.
pub fn best_window(need: &[u32], nodes: u32, cold_start_s: u64) -> Window {
    let peak = slot_peaks(need);
    let margin = cold_start_s.div_ceil(SLOT_S) as usize;
    let mut best = (
        0u64,
        Window {
            start_s: 0,
            end_s: 0,
            lent: 0,
        },
    );
    for start in 0..SLOTS {
        for len in 1..SLOTS {
            let lent = lendable(&peak, start, len, margin, nodes);
            let value = u64::from(lent) * len as u64;
            if value > best.0 {
                best = (
                    value,
                    Window {
                        start_s: start as u64 * SLOT_S,
                        end_s: ((start + len) % SLOTS) as u64 * SLOT_S,
                        lent,
                    },
                );
            }
        }
    }
    best.1
}

/// The literal 20:00–08:00 window, lending what it safely can.
pub fn night_window(need: &[u32], nodes: u32, cold_start_s: u64) -> Window {
    let peak = slot_peaks(need);
    let margin = cold_start_s.div_ceil(SLOT_S) as usize;
    let start = (20 * 3_600 / SLOT_S) as usize;
    let len = (12 * 3_600 / SLOT_S) as usize;
    Window {
        start_s: 20 * 3_600,
        end_s: 8 * 3_600,
        lent: lendable(&peak, start, len, margin, nodes),
    }
}
