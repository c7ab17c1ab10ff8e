//! The page `nightshift simulate --html FILE` writes: the run's figures and, per policy, one
//! chart of the run over time (the load in replicas needed, the replicas serving or starting
//! and ready, the hosts lent, the SLO and capacity minutes and the preemptions), drawn as
//! inline SVG with plotters. One self-contained file: no script, nothing fetched.

use nightshift_sim::report::{PolicyResult, Report};
use plotters::prelude::*;

/// Points across a chart at most: minutes are grouped into buckets to stay under it.
const MAX_POINTS: usize = 1_000;
const WIDTH: u32 = 1_200;
const TOP_H: u32 = 300;
const BOTTOM_H: u32 = 140;

const NEED: RGBColor = RGBColor(110, 110, 110);
const UP: RGBColor = RGBColor(31, 119, 180);
const READY: RGBColor = RGBColor(44, 160, 44);
const LENT: RGBColor = RGBColor(255, 127, 14);
const SLO: RGBColor = RGBColor(214, 39, 40);
const CAPACITY: RGBColor = RGBColor(250, 180, 180);
const PREEMPT: RGBColor = RGBColor(148, 103, 189);

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// One bucket of consecutive minutes, as the chart draws it.
#[derive(Default, Clone, Copy)]
struct Bucket {
    /// Start, in days from the run's start.
    day: f64,
    need: u32,
    up: u32,
    ready: u32,
    lent: u32,
    slo_minutes: u32,
    capacity_minutes: u32,
    preemptions: u32,
}

/// The policy's minutes grouped `per` to a bucket: the highest need, replicas up and hosts
/// lent, the fewest ready, and the sums of the counts.
fn buckets(p: &PolicyResult, need: &[u32], per: usize) -> Vec<Bucket> {
    p.timeline
        .minutes
        .chunks(per)
        .enumerate()
        .map(|(i, ms)| {
            let first = i * per;
            let need = need
                .get(first..(first + ms.len()).min(need.len()))
                .and_then(|n| n.iter().copied().max())
                .unwrap_or(0);
            Bucket {
                day: first as f64 / 1_440.0,
                need,
                up: ms.iter().map(|m| m.max_up).max().unwrap_or(0),
                ready: ms.iter().map(|m| m.min_ready).min().unwrap_or(0),
                lent: ms.iter().map(|m| m.max_lent).max().unwrap_or(0),
                slo_minutes: ms.iter().filter(|m| m.slo_violated).count() as u32,
                capacity_minutes: ms.iter().filter(|m| m.capacity_short).count() as u32,
                preemptions: ms.iter().map(|m| m.preemptions).sum(),
            }
        })
        .collect()
}

/// "day N" at the start of day N, nothing at the run's end.
fn day_label(d: f64, days: f64) -> String {
    if d + 1e-9 >= days {
        String::new()
    } else {
        format!("day {:.0}", d.floor() + 1.0)
    }
}

/// A series of the chart: its label, its colour and its value in a bucket.
type Series = (&'static str, RGBColor, fn(&Bucket) -> u32);

type DrawResult = Result<(), String>;

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// One policy's chart, an SVG element.
fn chart(p: &PolicyResult, need: &[u32], nodes: u32) -> Result<String, String> {
    let minutes = p.timeline.minutes.len().max(1);
    let per = minutes.div_ceil(MAX_POINTS).max(1);
    let bs = buckets(p, need, per);
    let days = minutes as f64 / 1_440.0;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, TOP_H + BOTTOM_H)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let (top, bottom) = root.split_vertically(TOP_H);
        draw_fleet(&top, p, &bs, days, nodes)?;
        draw_counts(&bottom, &bs, days, per)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

fn draw_fleet(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    p: &PolicyResult,
    bs: &[Bucket],
    days: f64,
    nodes: u32,
) -> DrawResult {
    let caption = format!(
        "{}: harvest ratio {:.3}, {} SLO minutes, {} capacity minutes, {} preemptions",
        p.name, p.harvest_ratio, p.slo_violation_minutes, p.capacity_minutes, p.preemptions
    );
    let mut c = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(6)
        .x_label_area_size(22)
        .y_label_area_size(44)
        .build_cartesian_2d(0f64..days, 0f64..f64::from(nodes) + 1.0)
        .map_err(err)?;
    c.configure_mesh()
        .y_desc("replicas / hosts")
        .x_labels(15)
        .x_label_formatter(&|d| day_label(*d, days))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(err)?;
    let series: [Series; 4] = [
        ("load (replicas needed)", NEED, |b| b.need),
        ("replicas serving or starting (max)", UP, |b| b.up),
        ("replicas ready (min)", READY, |b| b.ready),
        ("hosts lent (max)", LENT, |b| b.lent),
    ];
    for (label, color, value) in series {
        c.draw_series(LineSeries::new(
            bs.iter().map(|b| (b.day, f64::from(value(b)))),
            color.stroke_width(1),
        ))
        .map_err(err)?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", 12))
        .draw()
        .map_err(err)
}

fn draw_counts(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    bs: &[Bucket],
    days: f64,
    per: usize,
) -> DrawResult {
    let top = bs
        .iter()
        .map(|b| b.preemptions.max(b.slo_minutes).max(b.capacity_minutes))
        .max()
        .unwrap_or(0)
        .max(1);
    let mut c = ChartBuilder::on(area)
        .margin(6)
        .x_label_area_size(22)
        .y_label_area_size(44)
        .build_cartesian_2d(0f64..days, 0f64..f64::from(top) * 1.1)
        .map_err(err)?;
    c.configure_mesh()
        .y_desc(format!("per {per} min"))
        .x_labels(15)
        .x_label_formatter(&|d| day_label(*d, days))
        .y_labels(4)
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(err)?;
    let width = per as f64 / 1_440.0;
    let bars: [Series; 2] = [
        ("capacity minutes (planning)", CAPACITY, |b| {
            b.capacity_minutes
        }),
        ("SLO minutes (queue wait)", SLO, |b| b.slo_minutes),
    ];
    for (label, color, value) in bars {
        c.draw_series(bs.iter().filter(|b| value(b) > 0).map(|b| {
            Rectangle::new(
                [(b.day, 0.0), (b.day + width, f64::from(value(b)))],
                color.filled(),
            )
        }))
        .map_err(err)?
        .label(label)
        .legend(move |(x, y)| Rectangle::new([(x, y - 4), (x + 12, y + 4)], color.filled()));
    }
    c.draw_series(LineSeries::new(
        bs.iter().map(|b| (b.day, f64::from(b.preemptions))),
        PREEMPT.stroke_width(1),
    ))
    .map_err(err)?
    .label("preemptions")
    .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], PREEMPT.stroke_width(2)));
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", 12))
        .draw()
        .map_err(err)
}

/// The whole page: the run, the figures' table, and one chart per policy.
pub fn page(report: &Report) -> Result<String, String> {
    let r = &report.run;
    let mut html = String::from(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>nightshift simulate</title>\n<style>\n\
         body { font-family: sans-serif; margin: 1.5em; color: #222; }\n\
         table { border-collapse: collapse; margin: 1em 0; }\n\
         td, th { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; }\n\
         th:first-child, td:first-child { text-align: left; }\n\
         section { margin: 1.5em 0; }\n\
         svg { max-width: 100%; height: auto; }\n\
         </style>\n</head>\n<body>\n",
    );
    html.push_str(&format!(
        "<h1>nightshift simulate</h1>\n<p>trace {} · {} days · {} hosts × {} GPUs · peak {} replicas (scale {}, {} requests) · seed {} · {} faults</p>\n",
        escape(&r.trace),
        r.days,
        r.nodes,
        r.gpus_per_node,
        r.peak_replicas,
        r.scale,
        r.requests,
        r.seed,
        r.faults
    ));
    if let Some(gaps) = report.gaps_summary() {
        html.push_str(&format!("<p>trace gaps: {}</p>\n", escape(&gaps)));
    }
    html.push_str(
        "<table>\n<tr><th>policy</th><th>useful GPU-h</th><th>harvest ratio</th>\
         <th>SLO minutes</th><th>capacity minutes</th><th>worst wait, s</th>\
         <th>minutes' p99 wait, ms</th><th>preemptions</th><th>lost GPU-h</th></tr>\n",
    );
    for p in &report.policies {
        html.push_str(&format!(
            "<tr><td>{}</td><td>{:.1}</td><td>{:.4}</td><td>{}</td><td>{}</td><td>{:.1}</td><td>{:.0}</td><td>{}</td><td>{:.1}</td></tr>\n",
            escape(&p.name),
            p.useful_gpu_hours,
            p.harvest_ratio,
            p.slo_violation_minutes,
            p.capacity_minutes,
            p.worst_wait_s_per_day.iter().copied().fold(0.0, f64::max),
            p.minute_p99_wait_ms,
            p.preemptions,
            p.lost_gpu_hours
        ));
    }
    html.push_str("</table>\n");
    for line in report.references() {
        html.push_str(&format!("<p>{}</p>\n", escape(&line)));
    }
    html.push_str(
        "<p>SLO minutes: requests waited over 2 s on average, or one found no ready replica (the gate). \
         Capacity minutes: fewer replicas ready than the minute's need at some second (planning). \
         Each chart groups minutes into buckets: the highest load, replicas up and hosts lent, \
         the fewest replicas ready, and the counts summed per bucket.</p>\n",
    );
    for p in &report.policies {
        html.push_str(&format!(
            "<section class=\"policy\" id=\"{0}\">\n<h2>{0}</h2>\n",
            escape(&p.name)
        ));
        html.push_str(&chart(p, &report.need, r.nodes)?);
        html.push_str("\n</section>\n");
    }
    html.push_str("</body>\n</html>\n");
    Ok(html)
}
