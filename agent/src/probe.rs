//! `nightshift-agent probe`: what the agent sees on this host right now, without the
//! coordinator: the GPUs (or why NVML is unavailable), the container engine's version, the
//! containers the agent manages, and the local vLLM's signals.
//!
//! Nothing here changes the host. Each part is gathered on its own: one that fails says why
//! and the others are still reported.

use std::collections::BTreeMap;
use std::time::Duration;

use nightshift_common::labels;
use serde_json::{Value, json};

use crate::engine::{Container, ContainerState, Engine};
use crate::gpus::Gpus;
use crate::serving::http::HttpServing;
use crate::serving::vllm::VllmSnapshot;
use crate::serving::{Health, ServingMetrics};

/// The longest any one part of the probe may take.
const PART_TIMEOUT: Duration = Duration::from_secs(5);

/// The GPUs as the probe found them: the inventory and status, or why they could not be read.
pub fn gpus_part<G: Gpus>(gpus: Result<G, String>) -> Value {
    let gpus = match gpus {
        Ok(gpus) => gpus,
        Err(reason) => return json!({"available": false, "reason": reason, "devices": []}),
    };
    let (inventory, status) = match (gpus.inventory(), gpus.status()) {
        (Ok(i), Ok(s)) => (i, s),
        (Err(e), _) | (_, Err(e)) => {
            return json!({"available": false, "reason": e.to_string(), "devices": []});
        }
    };
    let devices: Vec<Value> = inventory
        .iter()
        .map(|g| {
            let s = status.iter().find(|s| s.index == g.index);
            json!({
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "memory_total_bytes": g.memory_total_bytes,
                "memory_used_bytes": s.map(|s| s.memory_used_bytes),
                "healthy": s.map(|s| s.healthy),
                "unhealthy_reason": s.and_then(|s| s.unhealthy_reason.as_deref()),
                "utilization_gpu_percent": s.and_then(|s| s.utilization_gpu_percent),
                "utilization_memory_percent": s.and_then(|s| s.utilization_memory_percent),
                "power_watts": s.and_then(|s| s.power_milliwatts).map(|mw| f64::from(mw) / 1000.0),
                "temperature_celsius": s.and_then(|s| s.temperature_celsius),
                "processes": s.and_then(|s| s.processes.as_ref()),
            })
        })
        .collect();
    json!({"available": true, "reason": null, "devices": devices})
}

/// The engine's version and the containers managed for `node`.
pub async fn engine_part<E: Engine>(engine: Result<E, String>, node: &str) -> (Value, Value) {
    let engine = match engine {
        Ok(e) => e,
        Err(reason) => return (json!({"version": null, "error": reason}), json!([])),
    };
    let version = match tokio::time::timeout(PART_TIMEOUT, engine.version()).await {
        Ok(Ok(v)) => json!({"version": v, "error": null}),
        Ok(Err(e)) => json!({"version": null, "error": e.to_string()}),
        Err(_) => json!({"version": null, "error": "no answer within 5 s"}),
    };
    let filter = BTreeMap::from([(labels::MANAGED_BY.to_owned(), node.to_owned())]);
    let containers = match tokio::time::timeout(PART_TIMEOUT, engine.list(&filter)).await {
        Ok(Ok(list)) => Value::Array(list.iter().map(container).collect()),
        _ => json!([]),
    };
    (version, containers)
}

fn container(c: &Container) -> Value {
    let state = match c.state {
        ContainerState::Created => "created".to_owned(),
        ContainerState::Running => "running".to_owned(),
        ContainerState::Transitioning => "transitioning".to_owned(),
        ContainerState::Exited { exit_code } => format!("exited ({exit_code})"),
    };
    json!({
        "name": c.name,
        "image": c.image,
        "role": c.labels.get(labels::ROLE),
        "state": state,
        "job_id": c.labels.get(labels::JOB_ID),
        "lease_id": c.labels.get(labels::LEASE_ID),
        "gpus": c.labels.get(labels::GPUS),
    })
}

/// The vLLM part: `vllm` is an object with every field null when the page lacks it, or null
/// with `error` set when no page could be read.
pub async fn vllm_part(serving: &HttpServing, url: &str) -> (Value, Value) {
    let health = match serving.health(url).await {
        Health::Healthy => "healthy".to_owned(),
        Health::Unreachable => "unreachable".to_owned(),
        Health::Unhealthy(code) => format!("unhealthy ({code})"),
    };
    match serving.scrape(url).await {
        Ok(page) => {
            let scrape = page.parse();
            let s = VllmSnapshot::from_scrape(&scrape);
            let vllm = json!({
                "url": url,
                "health": health,
                "requests_running": s.requests_running,
                "requests_waiting": s.requests_waiting,
                "kv_cache_usage": s.kv_cache_usage,
                "prompt_tokens_total": s.prompt_tokens_total,
                "generation_tokens_total": s.generation_tokens_total,
                "engines": s.engines,
                "sleep_state": s.sleep_state,
                "unreadable_lines": scrape.errors.len(),
            });
            (vllm, Value::Null)
        }
        Err(e) => (
            Value::Null,
            json!(format!("{} ({health})", crate::serving::http::chain(&e))),
        ),
    }
}

/// The probe as text for a terminal.
pub fn render_text(report: &Value) -> String {
    let mut out = String::new();
    let line = |out: &mut String, s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    line(
        &mut out,
        format!("node     {}", report["node"].as_str().unwrap_or("?")),
    );
    let gpus = &report["gpus"];
    if gpus["available"] == true {
        for d in gpus["devices"].as_array().into_iter().flatten() {
            line(
                &mut out,
                format!(
                    "gpu {}    {} {} used {} of {} bytes, healthy {}",
                    d["index"],
                    d["uuid"],
                    d["name"],
                    d["memory_used_bytes"],
                    d["memory_total_bytes"],
                    d["healthy"]
                ),
            );
            line(&mut out, format!("         {}", readings(d)));
            if let Some(reason) = d["unhealthy_reason"].as_str() {
                line(&mut out, format!("         unhealthy: {reason}"));
            }
        }
    } else {
        line(
            &mut out,
            format!("gpus     unavailable: {}", gpus["reason"]),
        );
    }
    let docker = &report["docker"];
    match docker["version"].as_str() {
        Some(v) => line(&mut out, format!("engine   {v}")),
        None => line(
            &mut out,
            format!("engine   unavailable: {}", docker["error"]),
        ),
    }
    for c in report["containers"].as_array().into_iter().flatten() {
        line(
            &mut out,
            format!(
                "managed  {} ({}) {} {}",
                c["name"], c["role"], c["state"], c["image"]
            ),
        );
    }
    let vllm = &report["vllm"];
    if vllm.is_null() {
        line(
            &mut out,
            format!("vllm     unavailable: {}", report["vllm_error"]),
        );
    } else {
        for key in [
            "url",
            "health",
            "requests_running",
            "requests_waiting",
            "kv_cache_usage",
            "prompt_tokens_total",
            "generation_tokens_total",
            "engines",
            "sleep_state",
        ] {
            line(&mut out, format!("vllm     {key} = {}", vllm[key]));
        }
    }
    out
}

/// One GPU's utilisation, power, temperature and processes; `-` for what it did not report.
fn readings(d: &Value) -> String {
    let shown = |v: &Value, unit: &str| {
        if v.is_null() {
            "-".to_owned()
        } else {
            format!("{v}{unit}")
        }
    };
    let processes = match d["processes"].as_array() {
        Some(list) => {
            let pids: Vec<String> = list.iter().map(|p| p["pid"].to_string()).collect();
            format!("{} [{}]", list.len(), pids.join(" "))
        }
        None => "-".to_owned(),
    };
    format!(
        "utilisation {} (memory {}), power {}, temperature {}, processes {processes}",
        shown(&d["utilization_gpu_percent"], "%"),
        shown(&d["utilization_memory_percent"], "%"),
        shown(&d["power_watts"], " W"),
        shown(&d["temperature_celsius"], " °C"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpus::fake::FakeGpus;

    #[test]
    fn gpus_unavailable_says_why() {
        let part = gpus_part::<FakeGpus>(Err("libnvidia-ml.so.1 not found".into()));
        assert_eq!(part["available"], false);
        assert_eq!(part["reason"], "libnvidia-ml.so.1 not found");
    }

    #[test]
    fn fake_gpus_are_listed() {
        let fake = FakeGpus::new("n", 2);
        fake.set_memory_used(1, 42).expect("gpu 1");
        let part = gpus_part(Ok(fake));
        assert_eq!(part["available"], true);
        assert_eq!(part["devices"][1]["memory_used_bytes"], 42);
        assert_eq!(part["devices"].as_array().map(Vec::len), Some(2));
        let text = render_text(
            &json!({"node": "n", "gpus": part, "docker": {"version": "D"}, "containers": [], "vllm": null, "vllm_error": "x"}),
        );
        assert!(
            text.contains("gpu 1") && text.contains("engine   D"),
            "{text}"
        );
        assert!(
            text.contains("utilisation - (memory -), power -, temperature -, processes -"),
            "unknown readings: {text}"
        );
    }

    #[test]
    fn readings_and_unhealthy_reasons_are_shown() {
        let fake = FakeGpus::new("n", 2);
        fake.set_utilization(0, 97, 45).expect("gpu 0");
        fake.set_power_and_temperature(0, 312_500, 66)
            .expect("gpu 0");
        fake.set_processes(
            0,
            vec![nightshift_common::GpuProcess {
                pid: 3117,
                used_memory_bytes: Some(70 << 30),
            }],
        )
        .expect("gpu 0");
        fake.inject_xid(1, 79).expect("gpu 1");
        let part = gpus_part(Ok(fake));
        let d0 = &part["devices"][0];
        assert_eq!(
            (
                &d0["utilization_gpu_percent"],
                &d0["utilization_memory_percent"],
                &d0["power_watts"],
                &d0["temperature_celsius"],
                &d0["processes"],
                &d0["healthy"],
                &d0["unhealthy_reason"],
            ),
            (
                &json!(97),
                &json!(45),
                &json!(312.5),
                &json!(66),
                &json!([{"pid": 3117, "used_memory_bytes": 70_u64 << 30}]),
                &json!(true),
                &Value::Null,
            )
        );
        let d1 = &part["devices"][1];
        assert_eq!(d1["healthy"], false);
        assert_eq!(
            d1["unhealthy_reason"],
            "xid 79: the gpu has fallen off the bus"
        );
        assert_eq!(d1["power_watts"], Value::Null);
        let text = render_text(
            &json!({"node": "n", "gpus": part, "docker": {"version": "D"}, "containers": [], "vllm": null, "vllm_error": "x"}),
        );
        assert!(
            text.contains(
                "utilisation 97% (memory 45%), power 312.5 W, temperature 66 °C, processes 1 [3117]"
            ),
            "{text}"
        );
        assert!(
            text.contains("unhealthy: xid 79: the gpu has fallen off the bus"),
            "{text}"
        );
    }
}
