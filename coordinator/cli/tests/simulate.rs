//! `nightshift simulate` from the command line: the same seed prints identical JSON with the
//! documented keys, and bad input is refused with exit code 2.

use nightshift_cli::cli;
use serde_json::Value;

async fn simulate(args: &[&str]) -> (i32, String, String) {
    let mut argv = vec!["nightshift", "simulate"];
    argv.extend_from_slice(args);
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = cli::run(argv, &mut std::io::empty(), &mut out, &mut err).await;
    (
        code,
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
    )
}

fn trace_file(dir: &tempfile::TempDir) -> String {
    let path = dir.path().join("rates.csv");
    let mut csv = String::from("timestamp,rate\n");
    for h in 0..24 {
        let rate = if (8..22).contains(&h) { 60.0 } else { 15.0 };
        csv.push_str(&format!("{},{rate}\n", h * 3_600));
    }
    std::fs::write(&path, csv).unwrap();
    format!("csv:{}", path.display())
}

#[tokio::test]
async fn same_seed_prints_identical_json() {
    let dir = tempfile::tempdir().unwrap();
    let trace = trace_file(&dir);
    let args = [
        "--trace",
        &trace,
        "--days",
        "0.5",
        "--nodes",
        "4",
        "--peak-replicas",
        "3",
        "--faults",
        "default",
        "--seed",
        "9",
        "--cold-start-s",
        "60",
        "--output",
        "json",
    ];
    let (code, first, err) = simulate(&args).await;
    assert_eq!(code, 0, "{err}");
    let (_, second, _) = simulate(&args).await;
    assert_eq!(first, second);
    let v: Value = serde_json::from_str(&first).unwrap();
    let names: Vec<&str> = v["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "nightshift",
            "fixed-window",
            "night-20-08",
            "reactive",
            "oracle"
        ]
    );
    for p in v["policies"].as_array().unwrap() {
        for key in [
            "harvested_gpu_hours",
            "useful_gpu_hours",
            "oracle_gpu_hours",
            "harvest_ratio",
            "slo_violation_minutes",
            "preemptions",
            "lost_gpu_hours",
            "equivalent_gpus",
            "savings",
            "capacity_minutes",
            "queue_wait_minutes",
            "minute_p99_wait_ms",
        ] {
            assert!(p[key].is_number(), "{key} missing in {p}");
        }
        // The gate is the queue wait users feel.
        assert_eq!(p["slo_violation_minutes"], p["queue_wait_minutes"], "{p}");
        assert_eq!(p["worst_wait_s_per_day"].as_array().map(Vec::len), Some(1));
        assert_eq!(p["invariant_violations"], 0, "{p}");
    }
}

#[tokio::test]
async fn the_html_report_holds_one_chart_per_policy_and_nothing_from_outside() {
    let dir = tempfile::tempdir().unwrap();
    let trace = trace_file(&dir);
    let page = |name: &str, policies: &str| {
        let path = dir.path().join(name);
        let path_s = path.display().to_string();
        let trace = trace.clone();
        let policies = policies.to_owned();
        async move {
            let args = [
                "--trace",
                &trace,
                "--days",
                "0.5",
                "--nodes",
                "4",
                "--peak-replicas",
                "3",
                "--seed",
                "9",
                "--cold-start-s",
                "60",
                "--policies",
                &policies,
                "--html",
                &path_s,
            ];
            let (code, out, err) = simulate(&args).await;
            assert_eq!(code, 0, "{err}");
            (std::fs::read_to_string(&path).unwrap(), out)
        }
    };
    let all = "nightshift,fixed-window,night-20-08,reactive,oracle";
    let (html, table) = page("a.html", all).await;
    // The same seed draws the same page, byte for byte.
    assert_eq!(html, page("b.html", all).await.0);
    assert!(html.starts_with("<!DOCTYPE html>"), "{}", &html[..80]);
    assert_eq!(html.matches("<svg").count(), 5);
    assert_eq!(html.matches("<section class=\"policy\"").count(), 5);
    for name in all.split(',') {
        assert!(html.contains(&format!("<h2>{name}</h2>")), "{name}");
        assert!(table.contains(name));
    }
    // Each chart draws its series: five lines (load, up, ready, lent, preemptions) at least.
    assert!(html.matches("<polyline").count() >= 5 * 5, "too few lines");
    // Offline: no script and nothing loaded from elsewhere.
    for outside in ["<script", "src=", "href=", "@import", "url("] {
        assert!(!html.contains(outside), "the page holds {outside}");
    }
    // A subset of the policies gives a chart each.
    let (two, _) = page("c.html", "reactive,oracle").await;
    assert_eq!(two.matches("<svg").count(), 2);
}

#[tokio::test]
async fn bad_input_is_refused_with_exit_code_2() {
    let (code, _, err) = simulate(&["--trace", "nowhere:/x"]).await;
    assert_eq!(code, 2);
    assert!(err.contains("unknown trace source"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let trace = trace_file(&dir);
    let (code, _, err) =
        simulate(&["--trace", &trace, "--nodes", "4", "--peak-replicas", "5"]).await;
    assert_eq!(code, 2);
    assert!(err.contains("more than --nodes"), "{err}");
    let (code, _, err) = simulate(&["--trace", &trace, "--faults", "meteor=1"]).await;
    assert_eq!(code, 2);
    assert!(err.contains("--faults"), "{err}");
}

#[tokio::test]
async fn a_servegen_gap_is_reported_and_filled_only_on_request() {
    let dir = tempfile::tempdir().unwrap();
    // Two hours of 10-minute windows; the fourth is empty for the only client.
    let rows: String = (0..12)
        .map(|w| {
            if w == 3 {
                format!("{},0,0,,0,0\n", w * 600)
            } else {
                format!("{},20,1,Gamma,1.0,0.05\n", w * 600)
            }
        })
        .collect();
    std::fs::write(dir.path().join("chunk-0-trace.csv"), rows).unwrap();
    let trace = format!("servegen:{}", dir.path().display());
    let args = [
        "--trace",
        &trace,
        "--days",
        "0.08",
        "--nodes",
        "4",
        "--peak-replicas",
        "3",
        "--policies",
        "oracle",
        "--output",
        "json",
    ];
    let json = |(code, out, err): (i32, String, String)| {
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<Value>(&out).unwrap()
    };
    let kept = json(simulate(&args).await);
    let filled = json(simulate(&[&args[..], &["--fill-trace-gaps"]].concat()).await);
    let gaps = serde_json::json!([{"start_s": 1800, "windows": 1}]);
    assert_eq!(kept["run"]["trace_gaps"], gaps);
    assert_eq!(filled["run"]["trace_gaps"], gaps);
    assert_eq!(kept["run"]["trace_gaps_filled"], false);
    assert_eq!(filled["run"]["trace_gaps_filled"], true);
    let requests = |v: &Value| v["run"]["requests"].as_u64().unwrap();
    assert!(requests(&filled) > requests(&kept));
}
