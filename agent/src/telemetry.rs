//! The agent's own `/metrics`: per-GPU memory, utilisation, power, temperature and health,
//! whether vLLM scrapes succeed,
//! how long reconcile passes and drain/reclaim phases take, readiness, and how long the
//! coordinator has been silent. OpenMetrics text, from an explicit registry (no globals).

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use nightshift_common::{GpuStatus, SequenceKind};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabel {
    gpu: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    sequence: &'static str,
    phase: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

pub struct Telemetry {
    registry: Registry,
    gpu_memory_used: Family<GpuLabel, Gauge>,
    gpu_healthy: Family<GpuLabel, Gauge>,
    gpu_utilization: Family<GpuLabel, Gauge>,
    gpu_memory_utilization: Family<GpuLabel, Gauge>,
    gpu_power: Family<GpuLabel, FloatGauge>,
    gpu_temperature: Family<GpuLabel, Gauge>,
    gpu_processes: Family<GpuLabel, Gauge>,
    scrapes: Family<ResultLabel, Counter>,
    reconcile: Histogram,
    reconcile_errors: Counter,
    phases: Family<PhaseLabel, Histogram, fn() -> Histogram>,
    ready: Gauge,
    coordinator_silence: FloatGauge,
}

fn phase_histogram() -> Histogram {
    // 10 ms to about 45 min.
    Histogram::new(exponential_buckets(0.01, 2.0, 18))
}

impl Default for Telemetry {
    fn default() -> Self {
        Self::new()
    }
}

impl Telemetry {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("nightshift_agent");
        let t = Self {
            gpu_memory_used: Family::default(),
            gpu_healthy: Family::default(),
            gpu_utilization: Family::default(),
            gpu_memory_utilization: Family::default(),
            gpu_power: Family::default(),
            gpu_temperature: Family::default(),
            gpu_processes: Family::default(),
            scrapes: Family::default(),
            reconcile: Histogram::new(exponential_buckets(0.001, 2.0, 20)),
            reconcile_errors: Counter::default(),
            phases: Family::new_with_constructor(phase_histogram),
            ready: Gauge::default(),
            coordinator_silence: FloatGauge::default(),
            registry: Registry::default(),
        };
        registry.register(
            "gpu_memory_used_bytes",
            "GPU memory in use, as NVML (or the fake GPUs) report it",
            t.gpu_memory_used.clone(),
        );
        registry.register(
            "gpu_healthy",
            "1 when the GPU is healthy and may be leased",
            t.gpu_healthy.clone(),
        );
        registry.register(
            "gpu_utilization_percent",
            "share of the last sample period in which a kernel ran on the GPU, 0 to 100",
            t.gpu_utilization.clone(),
        );
        registry.register(
            "gpu_memory_utilization_percent",
            "share of the last sample period in which GPU memory was read or written, 0 to 100",
            t.gpu_memory_utilization.clone(),
        );
        registry.register("gpu_power_watts", "GPU power draw", t.gpu_power.clone());
        registry.register(
            "gpu_temperature_celsius",
            "GPU die temperature",
            t.gpu_temperature.clone(),
        );
        registry.register(
            "gpu_processes",
            "compute processes holding a context on the GPU",
            t.gpu_processes.clone(),
        );
        registry.register(
            "vllm_scrapes",
            "scrapes of the local vLLM's /metrics, by result (ok: a usable page)",
            t.scrapes.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "duration of one reconcile pass (a drain or reclaim included)",
            t.reconcile.clone(),
        );
        registry.register(
            "reconcile_errors",
            "reconcile passes that failed and will be retried",
            t.reconcile_errors.clone(),
        );
        registry.register(
            "phase_duration_seconds",
            "duration of each phase of drain and reclaim sequences",
            t.phases.clone(),
        );
        registry.register(
            "ready",
            "1 while the load balancer may send requests to the replica",
            t.ready.clone(),
        );
        registry.register(
            "coordinator_silence_seconds",
            "seconds since the coordinator last answered",
            t.coordinator_silence.clone(),
        );
        Self { registry, ..t }
    }

    /// Records one status reading per GPU. A reading the GPU does not support (or did not
    /// give this time) removes its series rather than leaving a stale or zero value.
    pub fn gpus(&self, status: &[GpuStatus]) {
        for s in status {
            let gpu = GpuLabel { gpu: s.index };
            self.gpu_memory_used
                .get_or_create(&gpu)
                .set(i64::try_from(s.memory_used_bytes).unwrap_or(i64::MAX));
            self.gpu_healthy
                .get_or_create(&gpu)
                .set(i64::from(s.healthy));
            set_or_remove(&self.gpu_utilization, &gpu, s.utilization_gpu_percent);
            set_or_remove(
                &self.gpu_memory_utilization,
                &gpu,
                s.utilization_memory_percent,
            );
            set_or_remove(&self.gpu_temperature, &gpu, s.temperature_celsius);
            let processes = s.processes.as_ref().map(|p| p.len() as u32);
            set_or_remove(&self.gpu_processes, &gpu, processes);
            match s.power_milliwatts {
                Some(mw) => {
                    self.gpu_power
                        .get_or_create(&gpu)
                        .set(f64::from(mw) / 1000.0);
                }
                None => {
                    self.gpu_power.remove(&gpu);
                }
            }
        }
    }

    pub fn scrape(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.scrapes.get_or_create(&ResultLabel { result }).inc();
    }

    pub fn reconcile(&self, took: Duration, ok: bool) {
        self.reconcile.observe(took.as_secs_f64());
        if !ok {
            self.reconcile_errors.inc();
        }
    }

    pub fn phase(&self, sequence: SequenceKind, phase: &str, took: Duration) {
        let sequence = match sequence {
            SequenceKind::Drain => "drain",
            SequenceKind::Reclaim => "reclaim",
        };
        self.phases
            .get_or_create(&PhaseLabel {
                sequence,
                phase: phase.to_owned(),
            })
            .observe(took.as_secs_f64());
    }

    pub fn ready(&self, ready: bool) {
        self.ready.set(i64::from(ready));
    }

    pub fn coordinator_silence(&self, silence: Option<Duration>) {
        self.coordinator_silence
            .set(silence.map_or(f64::NAN, |d| d.as_secs_f64()));
    }

    /// The OpenMetrics text of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "encoding the agent's metrics failed");
        }
        out
    }
}

fn set_or_remove(family: &Family<GpuLabel, Gauge>, gpu: &GpuLabel, value: Option<u32>) {
    match value {
        Some(v) => {
            family.get_or_create(gpu).set(i64::from(v));
        }
        None => {
            family.remove(gpu);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_what_was_recorded() {
        let t = Telemetry::new();
        t.gpus(&[
            GpuStatus::unhealthy(2, 1234, "xid 79: the gpu has fallen off the bus"),
            GpuStatus {
                utilization_gpu_percent: Some(87),
                utilization_memory_percent: Some(41),
                power_milliwatts: Some(312_500),
                temperature_celsius: Some(64),
                processes: Some(vec![nightshift_common::GpuProcess {
                    pid: 4242,
                    used_memory_bytes: Some(70 << 30),
                }]),
                ..GpuStatus::healthy(3, 70 << 30)
            },
        ]);
        t.scrape(true);
        t.scrape(false);
        t.scrape(false);
        t.reconcile(Duration::from_millis(3), false);
        t.phase(
            SequenceKind::Drain,
            "stop_replica",
            Duration::from_millis(250),
        );
        t.ready(true);
        let text = t.render();
        for line in [
            "nightshift_agent_gpu_memory_used_bytes{gpu=\"2\"} 1234",
            "nightshift_agent_gpu_healthy{gpu=\"2\"} 0",
            "nightshift_agent_gpu_healthy{gpu=\"3\"} 1",
            "nightshift_agent_gpu_utilization_percent{gpu=\"3\"} 87",
            "nightshift_agent_gpu_memory_utilization_percent{gpu=\"3\"} 41",
            "nightshift_agent_gpu_power_watts{gpu=\"3\"} 312.5",
            "nightshift_agent_gpu_temperature_celsius{gpu=\"3\"} 64",
            "nightshift_agent_gpu_processes{gpu=\"3\"} 1",
            "nightshift_agent_vllm_scrapes_total{result=\"ok\"} 1",
            "nightshift_agent_vllm_scrapes_total{result=\"error\"} 2",
            "nightshift_agent_reconcile_errors_total 1",
            "nightshift_agent_reconcile_duration_seconds_count 1",
            "nightshift_agent_phase_duration_seconds_count{sequence=\"drain\",phase=\"stop_replica\"} 1",
            "nightshift_agent_ready 1",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
        // GPU 2 reports no utilisation, power or temperature: those series are absent.
        for name in [
            "gpu_utilization_percent",
            "gpu_power_watts",
            "gpu_temperature_celsius",
            "gpu_processes",
        ] {
            let series = format!("nightshift_agent_{name}{{gpu=\"2\"}}");
            assert!(!text.contains(&series), "{series} in\n{text}");
        }
    }

    #[test]
    fn a_reading_that_goes_away_removes_its_series() {
        let t = Telemetry::new();
        let reading = GpuStatus {
            temperature_celsius: Some(70),
            power_milliwatts: Some(100_000),
            ..GpuStatus::healthy(0, 0)
        };
        t.gpus(std::slice::from_ref(&reading));
        assert!(
            t.render()
                .contains("nightshift_agent_gpu_temperature_celsius{gpu=\"0\"} 70")
        );
        t.gpus(&[GpuStatus::healthy(0, 0)]);
        let text = t.render();
        assert!(!text.contains("gpu_temperature_celsius{"), "{text}");
        assert!(!text.contains("gpu_power_watts{"), "{text}");
    }
}
