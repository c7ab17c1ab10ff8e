//! The frame every page shares (navigation, who is logged in) and the small formatting
//! helpers of times, durations, sizes and states.

use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use maud::{DOCTYPE, Markup, html};
use nightshift_common::UnixMillis;
use nightshift_core::report::period_key;

use super::Viewer;

/// The pages of the navigation bar: path and title.
const NAV: [(&str, &str); 5] = [
    ("/ui/", "Overview"),
    ("/ui/jobs", "Jobs"),
    ("/ui/pipelines", "Pipelines"),
    ("/ui/nodes", "Nodes"),
    ("/ui/report", "Report"),
];

/// A whole page: `title`, the navigation with `current` marked, and `body`.
pub fn frame(title: &str, current: &str, viewer: &Viewer, body: Markup) -> Html<String> {
    Html(
        html! {
            (DOCTYPE)
            html lang="en" {
                (head(title, true))
                body {
                    header.top {
                        a.brand href="/ui/" { "nightshift" }
                        nav {
                            @for (path, name) in NAV {
                                a href=(path) class=[(path == current).then_some("current")] { (name) }
                            }
                        }
                        div.who {
                            @match &viewer.principal {
                                Some(p) => {
                                    span #who { (p.name) " · " (p.role.as_str())
                                        @if let Some(team) = &p.team { " · team " (team) } }
                                    form method="post" action="/ui/logout" {
                                        button.link type="submit" { "Log out" }
                                    }
                                }
                                None => span #who.muted { "open access (no API tokens)" },
                            }
                        }
                    }
                    main {
                        h1 { (title) }
                        (body)
                    }
                }
            }
        }
        .into_string(),
    )
}

/// A page without the navigation (the login page).
pub fn bare(title: &str, body: Markup) -> Html<String> {
    Html(
        html! {
            (DOCTYPE)
            html lang="en" {
                (head(title, false))
                body.bare { main { (body) } }
            }
        }
        .into_string(),
    )
}

/// Every page's `<head>`: its title and the stylesheet; the script where `live` (a page
/// with the navigation), none on the login and error pages.
fn head(title: &str, live: bool) -> Markup {
    html! {
        head {
            meta charset="utf-8";
            meta name="viewport" content="width=device-width, initial-scale=1";
            title { (title) " · nightshift" }
            link rel="stylesheet" href=(super::assets::CSS_PATH);
            @if live { script src=(super::assets::JS_PATH) defer {} }
        }
    }
}

/// An error as a small page with its status.
pub fn error(status: StatusCode, message: &str) -> Response {
    let body = html! {
        div.login {
            h1 { (status.as_u16()) " " (status.canonical_reason().unwrap_or("")) }
            p.error { (message) }
            p { a href="/ui/" { "Back to the overview" } }
        }
    };
    (status, bare("Error", body)).into_response()
}

/// `2026-12-05 17:40:12` (UTC).
pub fn time(t: UnixMillis) -> String {
    let s = (t % 86_400_000) / 1000;
    format!(
        "{} {:02}:{:02}:{:02}",
        period_key(t, false),
        s / 3600,
        s / 60 % 60,
        s % 60
    )
}

/// `17:40` (UTC), for chart axes.
pub fn clock(t: UnixMillis) -> String {
    let s = (t % 86_400_000) / 1000;
    format!("{:02}:{:02}", s / 3600, s / 60 % 60)
}

/// `1 h 12 min`, `45 s`, `850 ms`.
pub fn duration(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0 => format!("{ms} ms"),
        1..60 => format!("{s} s"),
        60..3600 => format!("{} min {} s", s / 60, s % 60),
        3600..86_400 => format!("{} h {} min", s / 3600, s / 60 % 60),
        _ => format!("{} d {} h", s / 86_400, s / 3600 % 24),
    }
}

/// How long ago `t` was: `3 min 5 s ago`.
pub fn ago(now: UnixMillis, t: UnixMillis) -> String {
    if t > now {
        return format!("in {}", duration(t - now));
    }
    format!("{} ago", duration(now - t))
}

/// `12.5 GiB`.
pub fn bytes(b: u64) -> String {
    let gib = b as f64 / (1u64 << 30) as f64;
    if gib >= 1.0 {
        format!("{gib:.1} GiB")
    } else {
        format!("{:.0} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

/// A number kept short with its first significant digits: `12`, `3.5`, `0.25`, `0.0042`.
pub fn num(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return "0".to_owned();
    }
    if v == v.trunc() && v.abs() < 1e12 {
        return format!("{v:.0}");
    }
    // Two significant digits below 10, one decimal above.
    let decimals = if v.abs() >= 10.0 {
        1
    } else {
        (1 - v.abs().log10().floor() as i64).clamp(1, 6) as usize
    };
    let s = format!("{v:.decimals$}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_owned()
}

/// A state as a coloured badge; the class is the state's own name.
pub fn badge(state: &str) -> Markup {
    let class = format!("badge s-{}", state.to_lowercase().replace(' ', "-"));
    html! { span class=(class) { (state) } }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_and_durations_read_well() {
        // 2026-12-05 17:40:12 UTC
        let t = 1_796_492_412_000;
        assert_eq!(time(t), "2026-12-05 17:40:12");
        assert_eq!(clock(t), "17:40");
        assert_eq!(duration(850), "850 ms");
        assert_eq!(duration(45_000), "45 s");
        assert_eq!(duration(4_320_000), "1 h 12 min");
        assert_eq!(ago(t, t - 65_000), "1 min 5 s ago");
        assert_eq!(bytes(80 << 30), "80.0 GiB");
        assert_eq!(num(3.0), "3");
        assert_eq!(num(0.254), "0.25");
        assert_eq!(num(0.0042), "0.0042");
        assert_eq!(num(0.0025), "0.0025");
        assert_eq!(num(12.345), "12.3");
        assert_eq!(num(2.5), "2.5");
    }
}
