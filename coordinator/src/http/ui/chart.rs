//! Charts as inline SVG, drawn here: bars (the report), the 24-hour timeline (the
//! overview) and a pipeline run's graph. Nothing to load, nothing drawn by script.

use std::collections::BTreeMap;

use maud::{Markup, html};
use nightshift_common::{PipelineNodeView, UnixMillis};

use super::page;
use crate::timeline::Sample;

/// A vertical bar per `(label, value)`, labelled under it, its value over it.
pub fn bars(items: &[(String, f64)], unit: &str) -> Markup {
    let (w, h, left, bottom, top) = (1140.0, 240.0, 56.0, 30.0, 22.0);
    let max = items.iter().map(|i| i.1).fold(0.0_f64, f64::max);
    let max = if max > 0.0 { nice(max) } else { 1.0 };
    let n = items.len().max(1) as f64;
    let slot = (w - left - 8.0) / n;
    let bar = (slot * 0.7).min(56.0);
    let y = |v: f64| top + (h - top - bottom) * (1.0 - v / max);
    // Long series label every few bars so that the labels do not collide.
    let every = (items.len() / 12).max(1);
    html! {
        svg.chart viewBox=(format!("0 0 {w} {h}")) role="img" aria-label=(format!("{unit} per bar")) {
            @for k in 0..=4 {
                @let v = max * f64::from(k) / 4.0;
                line.axis x1=(left) x2=(w - 4.0) y1=(y(v)) y2=(y(v)) {}
                text x=(left - 6.0) y=(y(v) + 4.0) text-anchor="end" { (page::num(v)) }
            }
            @for (i, (label, v)) in items.iter().enumerate() {
                @let x = left + slot * i as f64 + (slot - bar) / 2.0;
                rect.bar x=(x) y=(y(*v)) width=(bar) height=((y(0.0) - y(*v)).max(0.0)) rx="2" {
                    title { (label) ": " (page::num(*v)) " " (unit) }
                }
                @if *v > 0.0 && items.len() <= 31 {
                    text x=(x + bar / 2.0) y=(y(*v) - 4.0) text-anchor="middle" { (page::num(*v)) }
                }
                @if i % every == 0 {
                    text x=(x + bar / 2.0) y=(h - bottom + 16.0) text-anchor="middle" { (label) }
                }
            }
            text x=(left) y="11" { (unit) }
        }
    }
}

/// A round top for an axis: 1, 2, 5 × 10ⁿ at or above `v`.
fn nice(v: f64) -> f64 {
    let p = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|t| *t >= v)
        .unwrap_or(10.0 * p)
}

/// The last 24 hours of one service: replicas serving and GPUs lent as steps (left
/// axis), its load (requests running and waiting) as a shaded area (right axis).
pub fn timeline(samples: &[Sample], now: UnixMillis) -> Markup {
    let (w, h, left, right, bottom, top) = (1140.0, 220.0, 40.0, 48.0, 26.0, 12.0);
    let since = now.saturating_sub(crate::timeline::SPAN_MS);
    let x = |t: UnixMillis| {
        left + (w - left - right) * (t.saturating_sub(since)) as f64
            / crate::timeline::SPAN_MS as f64
    };
    let count_max = samples
        .iter()
        .map(|s| s.serving.max(s.lent_gpus))
        .max()
        .unwrap_or(0)
        .max(1);
    let count_max = nice(f64::from(count_max));
    let load_max = samples
        .iter()
        .filter_map(|s| s.load)
        .fold(0.0_f64, f64::max);
    let load_max = if load_max > 0.0 { nice(load_max) } else { 1.0 };
    let yc = |v: f64| top + (h - top - bottom) * (1.0 - v / count_max);
    let yl = |v: f64| top + (h - top - bottom) * (1.0 - v / load_max);
    let steps = |value: &dyn Fn(&Sample) -> f64| -> String {
        let mut d = String::new();
        for (i, s) in samples.iter().enumerate() {
            let (px, py) = (x(s.at), yc(value(s)));
            if i == 0 {
                d.push_str(&format!("M{px:.1},{py:.1}"));
            } else {
                d.push_str(&format!(" H{px:.1} V{py:.1}"));
            }
        }
        if !samples.is_empty() {
            d.push_str(&format!(" H{:.1}", x(now)));
        }
        d
    };
    let load_area = {
        let points: Vec<(f64, f64)> = samples
            .iter()
            .filter_map(|s| Some((x(s.at), yl(s.load?))))
            .collect();
        match (points.first(), points.last()) {
            (Some(first), Some(last)) => {
                let mut d = format!("M{:.1},{:.1}", first.0, yl(0.0));
                for (px, py) in &points {
                    d.push_str(&format!(" L{px:.1},{py:.1}"));
                }
                d.push_str(&format!(" L{:.1},{:.1} Z", last.0, yl(0.0)));
                Some(d)
            }
            _ => None,
        }
    };
    let hours: Vec<UnixMillis> = (0..=24).step_by(3).map(|k| since + k * 3_600_000).collect();
    html! {
        svg.chart viewBox=(format!("0 0 {w} {h}")) role="img" aria-label="the last 24 hours" {
            @for k in 0..=4 {
                @let v = count_max * f64::from(k) / 4.0;
                line.axis x1=(left) x2=(w - right) y1=(yc(v)) y2=(yc(v)) {}
                text x=(left - 6.0) y=(yc(v) + 4.0) text-anchor="end" { (page::num(v)) }
                text x=(w - right + 6.0) y=(yl(load_max * f64::from(k) / 4.0) + 4.0) { (page::num(load_max * f64::from(k) / 4.0)) }
            }
            @for t in &hours {
                text x=(x(*t)) y=(h - 8.0) text-anchor="middle" { (page::clock(*t)) }
            }
            @if let Some(d) = &load_area { path.load d=(d) {} }
            @if !samples.is_empty() {
                path.lend d=(steps(&|s| f64::from(s.lent_gpus))) {}
                path.serve d=(steps(&|s| f64::from(s.serving))) {}
                @if let Some(last) = samples.last() {
                    circle.lend cx=(x(last.at)) cy=(yc(f64::from(last.lent_gpus))) r="3.5" {}
                    circle.serve cx=(x(last.at)) cy=(yc(f64::from(last.serving))) r="3.5" {}
                }
            } @else {
                text x=(w / 2.0) y=(h / 2.0) text-anchor="middle" { "no samples yet: one is taken each minute" }
            }
        }
        div.legend {
            span { i.serve {} "replicas serving" }
            span { i.lend {} "GPUs lent" }
            span { i.load {} "load (requests running + waiting, right axis)" }
        }
    }
}

/// Where each node of a run's graph sits: its column (longest path from a root) and row.
pub fn layout(
    nodes: &[PipelineNodeView],
    edges: &[(usize, usize)],
) -> BTreeMap<usize, (usize, usize)> {
    let mut depth: BTreeMap<usize, usize> = nodes.iter().map(|n| (n.id, 0)).collect();
    // Node ids grow as the run creates nodes, and a node is created after those before it:
    // one pass in id order settles every depth. A backward edge (none expected) is ignored.
    let mut sorted = edges.to_vec();
    sorted.sort_by_key(|e| e.1);
    for (a, b) in sorted {
        if a < b
            && let Some(&da) = depth.get(&a)
            && let Some(db) = depth.get_mut(&b)
        {
            *db = (*db).max(da + 1);
        }
    }
    let mut rows: BTreeMap<usize, usize> = BTreeMap::new();
    nodes
        .iter()
        .map(|n| {
            let col = depth[&n.id];
            let row = rows.entry(col).or_default();
            *row += 1;
            (n.id, (col, *row - 1))
        })
        .collect()
}

/// A run's graph, left to right: each step a box (its name and phase) linking to its
/// details, each edge a curve from a step to the one after it.
pub fn dag(
    run: u64,
    nodes: &[PipelineNodeView],
    edges: &[(usize, usize)],
    selected: Option<usize>,
) -> Markup {
    let (bw, bh, gx, gy, pad) = (168.0, 44.0, 56.0, 18.0, 12.0);
    let at = layout(nodes, edges);
    let cols = at.values().map(|p| p.0).max().map_or(1, |c| c + 1);
    let rows = at.values().map(|p| p.1).max().map_or(1, |r| r + 1);
    let w = pad * 2.0 + cols as f64 * bw + (cols.saturating_sub(1)) as f64 * gx;
    let h = pad * 2.0 + rows as f64 * bh + (rows.saturating_sub(1)) as f64 * gy;
    let pos = |id: usize| {
        let (c, r) = at.get(&id).copied().unwrap_or((0, 0));
        (pad + c as f64 * (bw + gx), pad + r as f64 * (bh + gy))
    };
    let root = nodes.first().map(|n| n.name.as_str()).unwrap_or("");
    let short = |n: &PipelineNodeView| -> String {
        if n.parent.is_none() {
            return n.name.clone();
        }
        n.name
            .strip_prefix(root)
            .map(|s| s.trim_start_matches('.'))
            .unwrap_or(&n.name)
            .to_owned()
    };
    html! {
        svg #dag.dag viewBox=(format!("0 0 {w} {h}")) width=(w) role="img" aria-label="the run's steps" {
            @for (a, b) in edges {
                @let (ax, ay) = pos(*a);
                @let (bx, by) = pos(*b);
                @let (x1, y1, x2, y2) = (ax + bw, ay + bh / 2.0, bx, by + bh / 2.0);
                path.edge d=(format!("M{x1:.1},{y1:.1} C{:.1},{y1:.1} {:.1},{y2:.1} {x2:.1},{y2:.1}", x1 + gx / 2.0, x2 - gx / 2.0)) {}
            }
            @for n in nodes {
                @let (x, y) = pos(n.id);
                @let class = format!("step p-{}{}", n.phase, if selected == Some(n.id) { " selected" } else { "" });
                a href=(format!("/ui/pipelines/{run}?step={}", n.id)) {
                    g class=(class) data-step=(short(n)) data-phase=(n.phase) {
                        title { (n.name) ": " (n.phase) }
                        rect x=(x) y=(y) width=(bw) height=(bh) rx="7" {}
                        text x=(x + 10.0) y=(y + 18.0) { (clip(&short(n), 22)) }
                        text.sub x=(x + 10.0) y=(y + 34.0) { (n.phase) " · " (clip(&n.template, 16)) }
                    }
                }
            }
        }
    }
}

fn clip(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        return s.to_owned();
    }
    let mut out: String = s.chars().take(n - 1).collect();
    out.push('…');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: usize, parent: Option<usize>, name: &str) -> PipelineNodeView {
        PipelineNodeView {
            id,
            parent,
            name: name.into(),
            template: "t".into(),
            phase: "Succeeded".into(),
            message: None,
            retries: 0,
            jobs: vec![],
            attempt: None,
            preemptions: 0,
            started_at: None,
            finished_at: None,
            outputs: Default::default(),
            image_id: None,
        }
    }

    #[test]
    fn a_diamond_is_laid_out_in_three_columns_after_its_root() {
        let nodes = [
            node(0, None, "d"),
            node(1, Some(0), "d.A"),
            node(2, Some(0), "d.B"),
            node(3, Some(0), "d.C"),
            node(4, Some(0), "d.D"),
        ];
        let edges = [(0, 1), (1, 2), (1, 3), (2, 4), (3, 4)];
        let at = layout(&nodes, &edges);
        let cols: Vec<(usize, usize)> = (0..5).map(|i| at[&i]).collect();
        assert_eq!(cols, [(0, 0), (1, 0), (2, 0), (2, 1), (3, 0)]);
        let svg = dag(9, &nodes, &edges, Some(2)).into_string();
        assert_eq!(svg.matches("class=\"edge\"").count(), 5);
        assert!(svg.contains("data-step=\"B\""), "{svg}");
        assert!(svg.contains("href=\"/ui/pipelines/9?step=2\""));
        assert!(svg.contains("step p-Succeeded selected"));
    }

    #[test]
    fn bars_scale_to_a_round_top() {
        assert_eq!(nice(7.0), 10.0);
        assert_eq!(nice(12.0), 20.0);
        assert_eq!(nice(0.3), 0.5);
        let svg = bars(&[("nlp".into(), 8.0), ("cv".into(), 3.0)], "GPU-hours").into_string();
        assert_eq!(svg.matches("class=\"bar\"").count(), 2);
        assert!(svg.contains("nlp: 8 GPU-hours"));
    }

    #[test]
    fn the_timeline_draws_both_lines_and_the_load() {
        let now = 100 * 3_600_000;
        let s = |at, serving, lent, load| Sample {
            at,
            service: "llm".into(),
            serving,
            lent_gpus: lent,
            load,
        };
        let samples = [
            s(now - 7_200_000, 2, 0, Some(30.0)),
            s(now - 3_600_000, 1, 4, Some(2.0)),
        ];
        let svg = timeline(&samples, now).into_string();
        assert!(svg.contains("class=\"serve\""));
        assert!(svg.contains("class=\"lend\""));
        assert!(svg.contains("class=\"load\""));
        assert!(timeline(&[], now).into_string().contains("no samples yet"));
    }
}
