//! The trace parsers on tiny texts in each format. Nothing is read from disk: the simulator
//! parses what its caller read (nightshift-cli's `traces` module tests the reading).

use std::path::{Path, PathBuf};

use nightshift_sim::trace::{
    self, FileFormat, Format, Gap, Interarrival, Trace, TraceData, TraceError, Window,
};

/// A ServeGen folder's files as `(path, text)`, as a caller that read them hands them over.
fn folder(dir: &str, files: &[(&str, &str)]) -> Vec<(PathBuf, String)> {
    files
        .iter()
        .map(|(name, text)| (Path::new(dir).join(name), (*text).to_owned()))
        .collect()
}

#[test]
fn servegen_folders_give_per_client_windows_with_their_laws() {
    let files = folder(
        "sg",
        &[
            (
                "chunk-1-trace.csv",
                "0,0,0,,0,0\n600,2.5,1.1,Gamma,0.8,0.5\n1200,4,3.0,Weibull,0.4,0.01\n",
            ),
            (
                "chunk-0-trace.csv",
                "0,1,1,Gamma,1.0,1.0\n600,0,0,,0,0\n1200,0,0,,0,0\n",
            ),
            ("notes.txt", "ignored"),
        ],
    );
    let t = trace::parse_servegen(Path::new("sg"), files).unwrap();
    assert_eq!(t.name, "servegen:sg");
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
    // Windows 1 and 2: nobody sends (a gap). Window 3: client 1 idle, client 0 busy (not a
    // gap). Windows 5 and 6: nobody sends, but nothing follows (the trace's end, not a gap).
    let files = folder(
        "gaps",
        &[
            (
                "chunk-0-trace.csv",
                "0,1,1,Gamma,1.0,1.0\n600,0,0,,0,0\n1200,0,0,,0,0\n1800,4,2,Weibull,0.5,0.1\n\
                 2400,5,1,Gamma,1.0,0.2\n3000,0,0,,0,0\n3600,0,0,,0,0\n",
            ),
            (
                "chunk-1-trace.csv",
                "0,2,1,Gamma,2.0,0.25\n600,0,0,,0,0\n1200,0,0,,0,0\n1800,0,0,,0,0\n\
                 2400,1,1,Gamma,1.0,1.0\n3000,0,0,,0,0\n3600,0,0,,0,0\n",
            ),
        ],
    );
    let mut t = trace::parse_servegen(Path::new("gaps"), files).unwrap();
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
    let csv = Trace::parse(FileFormat::Csv, Path::new("r.csv"), "0,5\n60,0\n120,7.5\n");
    assert_eq!(csv.unwrap().gaps(), vec![]);
}

#[test]
fn azure_csv_keeps_the_time_of_day() {
    let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n\
                2023-11-16 18:17:04.0319600,3180,8";
    let t = Trace::parse(FileFormat::Azure, Path::new("azure.csv"), text).unwrap();
    assert_eq!(t.name, "azure.csv");
    let TraceData::Requests(times) = &t.data else {
        panic!("expected requests");
    };
    assert_eq!(times.len(), 2);
    assert!((times[0] - (18.0 * 3_600.0 + 17.0 * 60.0 + 3.97996)).abs() < 1e-6);
}

#[test]
fn mooncake_jsonl_and_rate_csv_parse_and_bad_rows_name_their_file_and_line() {
    let text =
        "{\"timestamp\": 0, \"input_length\": 1}\n{\"timestamp\": 1500, \"input_length\": 2}\n";
    let t = Trace::parse(FileFormat::Mooncake, Path::new("m.jsonl"), text).unwrap();
    assert_eq!(t.data, TraceData::Requests(vec![0.0, 1.5]));

    let c = Path::new("dir/r.csv");
    let t = Trace::parse(FileFormat::Csv, c, "timestamp,rate\n0,5\n60,7.5\n").unwrap();
    assert_eq!(t.data, TraceData::Rates(vec![(0.0, 5.0), (60.0, 7.5)]));
    assert_eq!(t.span_s, 120);

    let err = Trace::parse(FileFormat::Csv, c, "0,5\n60,lots\n").unwrap_err();
    assert_eq!(
        err.to_string(),
        "dir/r.csv:2: rate: \"lots\" is not a number"
    );
    let err = Trace::parse(FileFormat::Csv, c, "# nothing\n").unwrap_err();
    assert_eq!(err.to_string(), "dir/r.csv: no data");
}

#[test]
fn a_servegen_error_names_the_file_and_line_and_an_empty_folder_has_no_data() {
    let files = folder(
        "sg",
        &[
            ("chunk-0-trace.csv", "0,1,1,Gamma,1.0,1.0\n"),
            (
                "chunk-7-trace.csv",
                "0,1,1,Gamma,1.0,1.0\n600,1,1,Pareto,1,1\n",
            ),
        ],
    );
    let err = trace::parse_servegen(Path::new("sg"), files).unwrap_err();
    assert_eq!(
        err.to_string(),
        "sg/chunk-7-trace.csv:2: unknown pattern \"Pareto\""
    );
    let files = folder("sg", &[("notes.txt", "0,1,1,Gamma,1.0,1.0\n")]);
    let err = trace::parse_servegen(Path::new("sg"), files).unwrap_err();
    assert_eq!(err.to_string(), "sg: no data");
}

#[test]
fn a_source_names_its_format_and_path() {
    let split = |s| trace::split_source(s).map(|(f, p)| (f, p.to_owned()));
    assert_eq!(
        split("servegen:data/m-small").unwrap(),
        (Format::ServeGen, PathBuf::from("data/m-small"))
    );
    assert_eq!(
        split("azure:a:b.csv").unwrap(),
        (Format::File(FileFormat::Azure), PathBuf::from("a:b.csv"))
    );
    assert_eq!(
        split("mooncake:m.jsonl").unwrap().0,
        Format::File(FileFormat::Mooncake)
    );
    assert_eq!(split("csv:r.csv").unwrap().0, Format::File(FileFormat::Csv));
    for bad in ["parquet:/x", "no-kind"] {
        assert!(
            matches!(split(bad), Err(TraceError::UnknownSource(s)) if s == bad),
            "{bad}"
        );
    }
}
