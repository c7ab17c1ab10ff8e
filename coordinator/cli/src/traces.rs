//! Reading traffic traces from disk. The simulator (`nightshift-sim`) parses text and reads
//! nothing itself; this is where its files are read, once for every caller: `nightshift
//! simulate`, and the simulator's examples (through a dev-dependency on this crate).

use std::path::{Path, PathBuf};

use nightshift_sim::trace::{self, Format, Trace, TraceError};

/// Reads and parses the trace at `source`, `KIND:PATH`: `servegen:DIR` (a ServeGen folder),
/// `azure:FILE`, `mooncake:FILE` or `csv:FILE`.
pub fn load(source: &str) -> Result<Trace, TraceError> {
    let (format, path) = trace::split_source(source)?;
    match format {
        Format::ServeGen => trace::parse_servegen(path, read_servegen(path)?),
        Format::File(format) => Trace::parse(format, path, &read(path)?),
    }
}

/// The `(path, text)` of the files of a ServeGen folder that hold clients' windows (those
/// [`trace::is_servegen_file`] picks; the others are not read), in the order of their names.
pub fn read_servegen(dir: &Path) -> Result<Vec<(PathBuf, String)>, TraceError> {
    let entries = std::fs::read_dir(dir).map_err(|source| TraceError::Read {
        path: dir.to_owned(),
        source,
    })?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(trace::is_servegen_file)
        })
        .collect();
    // So that which unreadable file an error names does not depend on directory order.
    paths.sort();
    paths
        .into_iter()
        .map(|p| read(&p).map(|text| (p, text)))
        .collect()
}

fn read(path: &Path) -> Result<String, TraceError> {
    std::fs::read_to_string(path).map_err(|source| TraceError::Read {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use nightshift_sim::trace::{Interarrival, TraceData};

    use super::*;

    fn servegen_folder() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        write(
            "chunk-10-trace.csv",
            "0,3,1,Weibull,0.5,0.1\n600,0,0,,0,0\n",
        );
        write(
            "chunk-2-trace.csv",
            "0,1,1,Gamma,1.0,1.0\n600,2,1,Gamma,2.0,0.5\n",
        );
        write("notes.txt", "not a trace, not even read as one");
        dir
    }

    #[test]
    fn a_servegen_folder_loads_its_chunks_in_client_order_and_nothing_else() {
        let dir = servegen_folder();
        let read = read_servegen(dir.path()).unwrap();
        let names: Vec<_> = read
            .iter()
            .map(|(p, _)| p.file_name().unwrap().to_str().unwrap())
            .collect();
        assert_eq!(names, ["chunk-10-trace.csv", "chunk-2-trace.csv"]);

        let source = format!("servegen:{}", dir.path().display());
        let t = load(&source).unwrap();
        assert_eq!(t.name, source);
        assert_eq!(t.span_s, 1_200);
        let TraceData::Windows { window_s, clients } = &t.data else {
            panic!("expected windows");
        };
        assert_eq!(*window_s, 600);
        // Client 2 before client 10: by number, not by name.
        assert_eq!(clients.len(), 2);
        assert_eq!(clients[0].len(), 2);
        assert_eq!(clients[1][0].law, Interarrival::Weibull { shape: 0.5 });
        // The same trace as parsing the texts directly, whatever their order.
        let mut reversed = read;
        reversed.reverse();
        assert_eq!(t, trace::parse_servegen(dir.path(), reversed).unwrap());
    }

    #[test]
    fn errors_name_the_file_and_line_or_what_could_not_be_read() {
        let dir = servegen_folder();
        let bad = dir.path().join("chunk-3-trace.csv");
        std::fs::write(&bad, "0,1,1,Gamma,1.0,1.0\n600,lots,1,Gamma,1.0,1.0\n").unwrap();
        let err = load(&format!("servegen:{}", dir.path().display()))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!("{}:2: rate: \"lots\" is not a number", bad.display())
        );

        let missing = dir.path().join("missing");
        let err = load(&format!("servegen:{}", missing.display())).unwrap_err();
        assert!(
            matches!(&err, TraceError::Read { path, .. } if *path == missing),
            "{err}"
        );
        let err = load(&format!("csv:{}", missing.display())).unwrap_err();
        assert!(
            matches!(&err, TraceError::Read { path, .. } if *path == missing),
            "{err}"
        );

        let empty = tempfile::tempdir().unwrap();
        std::fs::write(empty.path().join("README"), "no chunks").unwrap();
        let err = load(&format!("servegen:{}", empty.path().display())).unwrap_err();
        assert!(matches!(err, TraceError::Empty(_)), "{err}");

        assert!(matches!(
            load("parquet:/x"),
            Err(TraceError::UnknownSource(_))
        ));
    }

    #[test]
    fn one_file_traces_load_by_their_kind() {
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("r.csv");
        std::fs::write(&csv, "timestamp,rate\n0,5\n60,7.5\n").unwrap();
        let t = load(&format!("csv:{}", csv.display())).unwrap();
        assert_eq!(t.data, TraceData::Rates(vec![(0.0, 5.0), (60.0, 7.5)]));
        assert_eq!(t.name, csv.display().to_string());

        let jsonl = dir.path().join("m.jsonl");
        std::fs::write(&jsonl, "{\"timestamp\": 0}\n{\"timestamp\": 1500}\n").unwrap();
        let t = load(&format!("mooncake:{}", jsonl.display())).unwrap();
        assert_eq!(t.data, TraceData::Requests(vec![0.0, 1.5]));
    }
}
