//! The two text formats of `/metrics`. The agent and the coordinator encode their metrics
//! with prometheus-client, which writes OpenMetrics 1.0; Prometheus asks for that (its
//! `Accept` header names it first). A client that does not (curl, `promtool check metrics`,
//! which reads the classic format only) gets the classic text format 0.0.4: OpenMetrics read
//! as classic text makes every counter two families, one of them without HELP or TYPE.

/// The `Content-Type` of OpenMetrics text.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The `Content-Type` of the classic text format.
pub const CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether an `Accept` header asks for OpenMetrics (with a non-zero quality).
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    accept.unwrap_or_default().split(',').any(|range| {
        let mut parts = range.split(';');
        let media = parts.next().unwrap_or_default().trim();
        let refused = parts.any(|p| {
            let p = p.trim();
            p.strip_prefix("q=")
                .and_then(|q| q.trim().parse::<f64>().ok())
                .is_some_and(|q| q <= 0.0)
        });
        media.eq_ignore_ascii_case("application/openmetrics-text") && !refused
    })
}

/// `/metrics` for a client whose `Accept` header is `accept`: the body and its
/// `Content-Type`, from prometheus-client's OpenMetrics text.
pub fn negotiate(openmetrics: String, accept: Option<&str>) -> (&'static str, String) {
    if wants_openmetrics(accept) {
        (OPENMETRICS, openmetrics)
    } else {
        (CLASSIC, to_classic(&openmetrics))
    }
}

/// prometheus-client's OpenMetrics text as the classic text format: a counter's HELP and
/// TYPE name its `_total` series, its `_created` series is dropped (the classic format has
/// none), `unknown` is `untyped`, and `# UNIT` and `# EOF` are dropped. Gauges, histograms
/// and summaries read the same in both. Exemplars, info, stateset and gauge histogram
/// families (which nightshift does not export) pass through unchanged.
pub fn to_classic(openmetrics: &str) -> String {
    let counters: Vec<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let is_counter = |name: &str| counters.contains(&name);
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            if is_counter(name) {
                out.push_str(&format!("# HELP {name}_total {help}\n"));
                continue;
            }
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            match rest.split_once(' ') {
                Some((name, "counter")) => {
                    out.push_str(&format!("# TYPE {name}_total counter\n"));
                    continue;
                }
                Some((name, "unknown")) => {
                    out.push_str(&format!("# TYPE {name} untyped\n"));
                    continue;
                }
                _ => {}
            }
        } else if !line.starts_with('#') {
            let name = line
                .split(|c: char| c == '{' || c.is_whitespace())
                .next()
                .unwrap_or_default();
            if name.strip_suffix("_created").is_some_and(is_counter) {
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_gets_openmetrics_and_others_the_classic_format() {
        // Prometheus 2.42's Accept header.
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(wants_openmetrics(Some(prometheus)));
        assert!(wants_openmetrics(Some("Application/OpenMetrics-Text")));
        for other in [
            None,
            Some("*/*"),
            Some("text/plain"),
            Some("text/plain;version=0.0.4, application/openmetrics-text;q=0"),
        ] {
            assert!(!wants_openmetrics(other), "{other:?}");
        }
        let (kind, body) = negotiate("# EOF\n".into(), Some(prometheus));
        assert_eq!((kind, body.as_str()), (OPENMETRICS, "# EOF\n"));
        let (kind, body) = negotiate("# EOF\n".into(), None);
        assert_eq!((kind, body.as_str()), (CLASSIC, ""));
    }

    #[test]
    fn counters_are_named_by_their_total_in_the_classic_format() {
        let openmetrics = "\
# HELP x_jobs_finished Jobs that finished.
# TYPE x_jobs_finished counter
x_jobs_finished_total{state=\"failed\"} 0
x_jobs_finished_created{state=\"failed\"} 1700000000.0
# HELP x_gpus GPUs.
# TYPE x_gpus gauge
x_gpus{state=\"lent\"} 2
# HELP x_phase_seconds Phases.
# TYPE x_phase_seconds histogram
# UNIT x_phase_seconds seconds
x_phase_seconds_sum 0.5
x_phase_seconds_count 1
x_phase_seconds_bucket{le=\"+Inf\"} 1
# HELP x_odd Odd.
# TYPE x_odd unknown
x_odd 3
# EOF
";
        assert_eq!(
            to_classic(openmetrics),
            "\
# HELP x_jobs_finished_total Jobs that finished.
# TYPE x_jobs_finished_total counter
x_jobs_finished_total{state=\"failed\"} 0
# HELP x_gpus GPUs.
# TYPE x_gpus gauge
x_gpus{state=\"lent\"} 2
# HELP x_phase_seconds Phases.
# TYPE x_phase_seconds histogram
x_phase_seconds_sum 0.5
x_phase_seconds_count 1
x_phase_seconds_bucket{le=\"+Inf\"} 1
# HELP x_odd Odd.
# TYPE x_odd untyped
x_odd 3
"
        );
    }
}
