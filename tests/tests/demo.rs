//! The acceptance check of the harvest loop: `nightshift demo --output json`, as a user runs
//! it, must exit 0 with the job succeeded after being preempted and resumed from its
//! checkpoint, and with no request lost.

use std::process::{Command, Stdio};

use nightshift_tests::{containers, require_images, workspace_bin};

#[test]
fn the_demo_runs_the_whole_harvest_loop_without_losing_a_request() {
    require_images();
    let child = Command::new(workspace_bin("nightshift"))
        .args(["demo", "--output", "json"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run nightshift demo");
    // The demo names its node after its process id.
    let node = format!("demo-{}", child.id());
    let out = child.wait_with_output().expect("wait for the demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "demo failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON object");
    println!(
        "{}",
        serde_json::to_string_pretty(&report["phases"]).unwrap()
    );
    println!("job {} load {}", report["job"], report["load"]);
    assert_eq!(report["ok"], true);
    assert_eq!(report["job"]["state"], "succeeded");
    assert!(
        report["job"]["attempts"].as_u64().unwrap() >= 2,
        "{}",
        report["job"]
    );
    assert!(
        report["job"]["resumed_from_step"].as_u64().unwrap() > 0,
        "{}",
        report["job"]
    );
    assert_eq!(report["load"]["errors"], 0, "{}", report["load"]);
    assert!(report["load"]["requests"].as_u64().unwrap() > 0);
    for phase in ["drain_s", "reclaim_s", "serving_ready_s"] {
        assert!(
            report["phases"][phase].as_f64().unwrap() > 0.0,
            "{phase}: {}",
            report["phases"]
        );
    }
    assert!(!report["timeline"].as_array().unwrap().is_empty());
    // The demo cleans up after itself.
    assert!(containers(&node, "replica").is_empty() && containers(&node, "job").is_empty());
}
