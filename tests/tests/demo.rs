//! The acceptance check of the harvest loop: `nightshift demo --output json`, as a user runs
//! it on the machine the README names (Docker and Rust, nothing installed from apt), must
//! exit 0 with the job succeeded after being preempted and resumed from its checkpoint, and
//! with no request lost.
//!
//! It runs as on a fresh machine: the stand-in images it runs are not there yet (a tag of the
//! test's own, `NIGHTSHIFT_STANDIN_TAG`, so that the images other tests run are left alone),
//! and busybox (Debian's busybox-static, which `tests/run.sh` installs) is hidden from it in a
//! mount namespace of its own. So the demo builds its images itself, and without busybox.

use std::os::unix::fs::MetadataExt;
use std::process::{Command, Stdio};

use nightshift_devcluster::cluster::{TOY_TRAINER, VLLM_STANDIN};
use nightshift_tests::{containers, workspace_bin};

/// The stand-ins the demo runs, by the names `tests/images/build.sh` builds them under.
const STANDINS: [&str; 2] = [VLLM_STANDIN, TOY_TRAINER];

/// Runs its arguments with every busybox of this machine (`/bin/busybox`, and any on `PATH`)
/// covered by the empty, non-executable file `$EMPTY`; run inside `unshare --mount`, so the
/// mounts are this process tree's alone. Exits 97 if a busybox can still be found. (`$EMPTY`
/// is the test's to remove once the namespace is gone: a kernel may refuse to unlink the
/// source of a bind mount while the mount lives.)
const HIDE_BUSYBOX: &str = r#"set -eu
for f in /bin/busybox /usr/bin/busybox $(type -ap busybox || true); do
    if [ -e "$f" ]; then mount --bind "$EMPTY" "$f"; fi
done
# `command -v` would name a file that is there but not executable: look for what can run.
visible=""
IFS=:
for d in /bin $PATH; do if [ -x "$d/busybox" ]; then visible="$d/busybox"; fi; done
unset IFS
if [ -n "$visible" ]; then
    echo "busybox is still visible: $visible" >&2
    exit 97
fi
exec "$@"
"#;

/// Removes the test's own tag of the stand-in images when dropped.
struct Untag(String);

impl Drop for Untag {
    fn drop(&mut self) {
        for name in STANDINS {
            let _ = Command::new("docker")
                .args(["rmi", &format!("nightshift/{name}:{}", self.0)])
                .output();
        }
    }
}

#[test]
fn the_demo_runs_the_whole_harvest_loop_without_losing_a_request() {
    let tag = format!("demo-test-{}", std::process::id());
    let _untag = Untag(tag.clone());
    for name in STANDINS {
        let image = format!("nightshift/{name}:{tag}");
        let present = Command::new("docker")
            .args(["image", "inspect", &image])
            .output()
            .expect("run docker")
            .status
            .success();
        assert!(!present, "{image} is there before the demo builds it");
    }
    // A mount namespace needs root; elsewhere a user namespace maps the user to root in it.
    let mut unshare = Command::new("unshare");
    unshare.arg("--mount");
    if std::fs::metadata("/proc/self")
        .expect("stat /proc/self")
        .uid()
        != 0
    {
        unshare.arg("--map-root-user");
    }
    let empty = tempfile::NamedTempFile::new().expect("an empty file");
    let child = unshare
        .args(["--", "bash", "-c", HIDE_BUSYBOX, "hide-busybox"])
        .arg(workspace_bin("nightshift"))
        .args(["demo", "--output", "json"])
        .env("NIGHTSHIFT_STANDIN_TAG", &tag)
        .env("EMPTY", empty.path())
        .env_remove("BUSYBOX")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run nightshift demo");
    // The demo names its node after its process id (unshare, bash and `nightshift demo`
    // each replace themselves with the next).
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
    // It built the images it ran.
    assert!(
        stderr.contains("building the stand-in images"),
        "the demo did not build its images:\n{stderr}"
    );
    // The demo cleans up after itself.
    assert!(containers(&node, "replica").is_empty() && containers(&node, "job").is_empty());
}
