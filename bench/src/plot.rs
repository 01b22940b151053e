//! A hand-written SVG: the per-client update latency CDF of each target (log x axis) and the
//! relay's RSS versus connected clients.

use std::fmt::Write as _;

use crate::report::RunReport;

const W: f64 = 1100.0;
const H: f64 = 460.0;

fn color(target: &str) -> &'static str {
    match target {
        "relay" => "#d62728",
        "plain" => "#1f77b4",
        "demo" => "#7f7f7f",
        _ => "#2ca02c",
    }
}

struct Panel {
    x0: f64,
    y0: f64,
    w: f64,
    h: f64,
}

impl Panel {
    fn frame(&self, s: &mut String, title: &str, xlabel: &str, ylabel: &str) {
        let _ = write!(
            s,
            r##"<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#444"/>"##,
            self.x0, self.y0, self.w, self.h
        );
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle" font-size="15" font-weight="bold">{title}</text>"#,
            self.x0 + self.w / 2.0,
            self.y0 - 12.0
        );
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle" font-size="13">{xlabel}</text>"#,
            self.x0 + self.w / 2.0,
            self.y0 + self.h + 38.0
        );
        let _ = write!(
            s,
            r#"<text x="{x}" y="{y}" text-anchor="middle" font-size="13" transform="rotate(-90 {x} {y})">{ylabel}</text>"#,
            x = self.x0 - 48.0,
            y = self.y0 + self.h / 2.0
        );
    }

    fn xtick(&self, s: &mut String, px: f64, label: &str) {
        let y = self.y0 + self.h;
        let _ = write!(
            s,
            r##"<line x1="{px}" y1="{}" x2="{px}" y2="{y}" stroke="#ddd"/><text x="{px}" y="{}" text-anchor="middle" font-size="11">{label}</text>"##,
            self.y0,
            y + 16.0
        );
    }

    fn ytick(&self, s: &mut String, py: f64, label: &str) {
        let _ = write!(
            s,
            r##"<line x1="{}" y1="{py}" x2="{}" y2="{py}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end" font-size="11">{label}</text>"##,
            self.x0,
            self.x0 + self.w,
            self.x0 - 6.0,
            py + 4.0
        );
    }
}

fn nice_step(range: f64) -> f64 {
    let raw = range / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag)
}

fn fmt_ms(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

pub fn svg(r: &RunReport) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="DejaVu Sans, Arial, sans-serif"><rect width="100%" height="100%" fill="white"/>"#
    );
    let _ = write!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{} — {} clients, {} updates ({:?})</text>"#,
        W / 2.0,
        r.name,
        r.args.clients,
        r.args.updates,
        r.args.update_pattern
    );

    // Left: latency CDF, log10 x.
    let p = Panel {
        x0: 80.0,
        y0: 60.0,
        w: 440.0,
        h: 320.0,
    };
    p.frame(
        &mut s,
        "Update latency per client (CDF)",
        "ms from set_resources to client holding the version (log)",
        "fraction of clients",
    );
    let pts: Vec<f64> = r
        .phases
        .iter()
        .flat_map(|ph| ph.cdf.iter().map(|c| c.0))
        .filter(|v| *v > 0.0)
        .collect();
    if !pts.is_empty() {
        let lo = pts.iter().cloned().fold(f64::MAX, f64::min).log10().floor();
        let hi = pts
            .iter()
            .cloned()
            .fold(0.0, f64::max)
            .log10()
            .ceil()
            .max(lo + 1.0);
        let xp = |v: f64| p.x0 + (v.max(1e-9).log10() - lo) / (hi - lo) * p.w;
        let yp = |f: f64| p.y0 + p.h - f * p.h;
        let mut d = lo;
        while d <= hi {
            p.xtick(&mut s, xp(10f64.powf(d)), &fmt_ms(10f64.powf(d)));
            d += 1.0;
        }
        for f in [0.0, 0.25, 0.5, 0.75, 0.9, 1.0] {
            p.ytick(&mut s, yp(f), &format!("{f}"));
        }
        let _ = write!(
            s,
            r##"<rect x="{}" y="{}" width="270" height="{}" fill="white" fill-opacity="0.85" stroke="#ccc"/>"##,
            p.x0 + 4.0,
            p.y0 + p.h - 82.0,
            18.0 * r.phases.len() as f64 + 8.0
        );
        for (i, ph) in r.phases.iter().enumerate() {
            if ph.cdf.is_empty() {
                continue;
            }
            let path: Vec<String> = ph
                .cdf
                .iter()
                .map(|&(v, f)| format!("{:.1},{:.1}", xp(v), yp(f)))
                .collect();
            let _ = write!(
                s,
                r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"/>"#,
                path.join(" "),
                color(&ph.target)
            );
            let ly = p.y0 + p.h - 70.0 + 18.0 * i as f64;
            let _ = write!(
                s,
                r#"<line x1="{x}" y1="{ly}" x2="{x2}" y2="{ly}" stroke="{c}" stroke-width="3"/><text x="{tx}" y="{ty}" font-size="12">{t}: p50 {p50:.2} ms, p99 {p99:.2} ms</text>"#,
                x = p.x0 + 10.0,
                x2 = p.x0 + 30.0,
                c = color(&ph.target),
                tx = p.x0 + 36.0,
                ty = ly + 4.0,
                t = ph.target,
                p50 = ph.latency.p50_ms,
                p99 = ph.latency.p99_ms
            );
        }
    }

    // Right: relay RSS versus clients.
    let q = Panel {
        x0: 630.0,
        y0: 60.0,
        w: 440.0,
        h: 320.0,
    };
    q.frame(
        &mut s,
        "Relay RSS versus clients",
        "synced clients",
        "RSS (MiB)",
    );
    let ms = r
        .phases
        .iter()
        .filter(|ph| ph.target == "relay")
        .find_map(|ph| ph.server.as_ref())
        .map(|rf| {
            let mut v = vec![(0.0, rf.baseline.rss_kb as f64 / 1024.0)];
            v.extend(
                rf.milestones
                    .iter()
                    .map(|m| (m.synced as f64, m.rss_kb as f64 / 1024.0)),
            );
            v
        })
        .unwrap_or_default();
    if ms.len() > 1 {
        let xmax = ms.iter().map(|m| m.0).fold(1.0, f64::max);
        let ymax = ms.iter().map(|m| m.1).fold(1.0, f64::max) * 1.1;
        let xp = |v: f64| q.x0 + v / xmax * q.w;
        let yp = |v: f64| q.y0 + q.h - v / ymax * q.h;
        let xs = nice_step(xmax);
        let mut x = 0.0;
        while x <= xmax * 1.0001 {
            q.xtick(&mut s, xp(x), &format!("{x}"));
            x += xs;
        }
        let ys = nice_step(ymax);
        let mut y = 0.0;
        while y <= ymax {
            q.ytick(&mut s, yp(y), &format!("{y}"));
            y += ys;
        }
        let path: Vec<String> = ms
            .iter()
            .map(|&(c, m)| format!("{:.1},{:.1}", xp(c), yp(m)))
            .collect();
        let _ = write!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"/>"#,
            path.join(" "),
            color("relay")
        );
        for &(c, m) in &ms {
            let _ = write!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{}"/>"#,
                xp(c),
                yp(m),
                color("relay")
            );
        }
    } else {
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle" font-size="13">no relay samples (attach with --relay-pid to sample)</text>"#,
            q.x0 + q.w / 2.0,
            q.y0 + q.h / 2.0
        );
    }
    s.push_str("</svg>\n");
    s
}
