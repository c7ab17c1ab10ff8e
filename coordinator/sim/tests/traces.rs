//! The trace loaders on tiny files in each format, written to a scratch folder.

use std::path::PathBuf;

use nightshift_sim::trace::{Gap, Interarrival, Trace, TraceData, Window};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nightshift-sim-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn servegen_folders_give_per_client_windows_with_their_laws() {
    let dir = scratch("servegen");
    std::fs::write(
        dir.join("chunk-1-trace.csv"),
        "0,0,0,,0,0\n600,2.5,1.1,Gamma,0.8,0.5\n1200,4,3.0,Weibull,0.4,0.01\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("chunk-0-trace.csv"),
        "0,1,1,Gamma,1.0,1.0\n600,0,0,,0,0\n1200,0,0,,0,0\n",
    )
    .unwrap();
    std::fs::write(dir.join("notes.txt"), "ignored").unwrap();
    let t = Trace::load(&format!("servegen:{}", dir.display())).unwrap();
    assert_eq!(t.span_s, 1_800);
    let TraceData::Windows { window_s, clients } = &t.data else {
        panic!("expected windows");
    };
    assert_eq!(*window_s, 600);
    assert_eq!(clients.len(), 2);
    // Client 0 first (sorted by number), idle windows dropped.
    assert_eq!(clients[0].len(), 1);
    assert_eq!(clients[1][0].law, Interarrival::Gamma { shape: 0.8 });
    assert_eq!(clients[1][1].law, Interarrival::Weibull { shape: 0.4 });
    assert_eq!(t.peak_rate(600), 4.0);
}

#[test]
fn a_servegen_gap_is_a_stretch_with_no_client_sending_between_busy_windows() {
    let dir = scratch("gaps");
    // Windows 1 and 2: nobody sends (a gap). Window 3: client 1 idle, client 0 busy (not a
    // gap). Windows 5 and 6: nobody sends, but nothing follows (the trace's end, not a gap).
    std::fs::write(
        dir.join("chunk-0-trace.csv"),
        "0,1,1,Gamma,1.0,1.0\n600,0,0,,0,0\n1200,0,0,,0,0\n1800,4,2,Weibull,0.5,0.1\n\
         2400,5,1,Gamma,1.0,0.2\n3000,0,0,,0,0\n3600,0,0,,0,0\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("chunk-1-trace.csv"),
        "0,2,1,Gamma,2.0,0.25\n600,0,0,,0,0\n1200,0,0,,0,0\n1800,0,0,,0,0\n\
         2400,1,1,Gamma,1.0,1.0\n3000,0,0,,0,0\n3600,0,0,,0,0\n",
    )
    .unwrap();
    let mut t = Trace::load(&format!("servegen:{}", dir.display())).unwrap();
    let gap = Gap {
        start_s: 600,
        windows: 2,
    };
    assert_eq!(t.gaps(), vec![gap]);
    let before = t.clone();
    assert_eq!(t.fill_gaps(), vec![gap]);
    assert_eq!(t.span_s, before.span_s);
    let TraceData::Windows { clients, .. } = &t.data else {
        panic!("expected windows");
    };
    let at = |c: usize, s: u64| clients[c].iter().find(|w| w.start_s == s).cloned();
    // Client 0 runs from 1 to 4 in a straight line, each window with its nearer law.
    let close = |w: Option<Window>, rate: f64, law: Interarrival| {
        let w = w.expect("a filled window");
        assert!((w.rate - rate).abs() < 1e-9, "rate {} vs {rate}", w.rate);
        assert_eq!(w.law, law);
    };
    close(at(0, 600), 2.0, Interarrival::Gamma { shape: 1.0 });
    close(at(0, 1200), 3.0, Interarrival::Weibull { shape: 0.5 });
    // Client 1 goes idle after the gap: it runs down to 0 with the law it had.
    close(at(1, 600), 4.0 / 3.0, Interarrival::Gamma { shape: 2.0 });
    close(at(1, 1200), 2.0 / 3.0, Interarrival::Gamma { shape: 2.0 });
    // Nothing else changed: window 3 of client 1 and the trailing windows stay idle.
    assert_eq!(at(1, 1800), None);
    assert_eq!(at(0, 3000), None);
    for (c, windows) in clients.iter().enumerate() {
        let starts: Vec<u64> = windows.iter().map(|w| w.start_s).collect();
        let mut sorted = starts.clone();
        sorted.sort_unstable();
        assert_eq!(starts, sorted, "client {c}'s windows stay in time order");
    }
    // A filled trace has no gaps left; other traces never have any.
    assert_eq!(t.gaps(), vec![]);
    let c = dir.join("r.csv");
    std::fs::write(&c, "0,5\n60,0\n120,7.5\n").unwrap();
    assert_eq!(
        Trace::load(&format!("csv:{}", c.display())).unwrap().gaps(),
        vec![]
    );
}

#[test]
fn azure_csv_keeps_the_time_of_day() {
    let dir = scratch("azure");
    let f = dir.join("azure.csv");
    std::fs::write(
        &f,
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:04.0319600,3180,8",
    )
    .unwrap();
    let t = Trace::load(&format!("azure:{}", f.display())).unwrap();
    let TraceData::Requests(times) = &t.data else {
        panic!("expected requests");
    };
    assert_eq!(times.len(), 2);
    assert!((times[0] - (18.0 * 3_600.0 + 17.0 * 60.0 + 3.97996)).abs() < 1e-6);
}

#[test]
fn mooncake_jsonl_and_rate_csv_load_and_bad_rows_name_their_line() {
    let dir = scratch("mooncake");
    let f = dir.join("m.jsonl");
    std::fs::write(
        &f,
        "{\"timestamp\": 0, \"input_length\": 1}\n{\"timestamp\": 1500, \"input_length\": 2}\n",
    )
    .unwrap();
    let t = Trace::load(&format!("mooncake:{}", f.display())).unwrap();
    assert_eq!(t.data, TraceData::Requests(vec![0.0, 1.5]));

    let c = dir.join("r.csv");
    std::fs::write(&c, "timestamp,rate\n0,5\n60,7.5\n").unwrap();
    let t = Trace::load(&format!("csv:{}", c.display())).unwrap();
    assert_eq!(t.data, TraceData::Rates(vec![(0.0, 5.0), (60.0, 7.5)]));
    assert_eq!(t.span_s, 120);

    std::fs::write(&c, "0,5\n60,lots\n").unwrap();
    let err = Trace::load(&format!("csv:{}", c.display()))
        .unwrap_err()
        .to_string();
    assert!(err.contains(":2:") && err.contains("lots"), "{err}");
    assert!(Trace::load("parquet:/x").is_err());
}
