//! Line charts as standalone SVG text: throughput against clients, one line per setup, in the
//! shape of the seeds' figures. Pure: data in, text out.

use std::fmt::Write as _;

pub struct Series {
    pub name: String,
    /// (x, y) points; non-finite y values (failed runs) are left out of the line.
    pub points: Vec<(f64, f64)>,
    pub dashed: bool,
}

pub struct LineChart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 460.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 200.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
const COLORS: &[&str] = &[
    "#222222", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e", "#17becf", "#8c564b",
    "#e377c2",
];

impl LineChart {
    pub fn render(&self) -> String {
        let points = || {
            self.series
                .iter()
                .flat_map(|s| s.points.iter())
                .filter(|(x, y)| x.is_finite() && y.is_finite())
        };
        let x_max = points().map(|p| p.0).fold(1.0, f64::max);
        let y_max = nice_ceiling(points().map(|p| p.1).fold(1.0, f64::max));
        let plot_w = WIDTH - LEFT - RIGHT;
        let plot_h = HEIGHT - TOP - BOTTOM;
        let sx = |x: f64| LEFT + x / x_max * plot_w;
        let sy = |y: f64| TOP + plot_h - y / y_max * plot_h;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
            LEFT + plot_w / 2.0,
            escape(&self.title)
        );
        for i in 0..=5 {
            let y = y_max * f64::from(i) / 5.0;
            let _ = writeln!(
                s,
                r##"<line x1="{LEFT}" x2="{}" y1="{y0:.1}" y2="{y0:.1}" stroke="#dddddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + plot_w,
                LEFT - 6.0,
                sy(y) + 4.0,
                y.round(),
                y0 = sy(y),
            );
        }
        // A short whole-number axis (replicas 0-3) gets a tick per number, not six rounded ones.
        let ticks: Vec<f64> = match x_max <= 6.0 && x_max.fract() == 0.0 {
            true => (0..=x_max as u32).map(f64::from).collect(),
            false => (0..=6).map(|i| x_max * f64::from(i) / 6.0).collect(),
        };
        for x in ticks {
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
                sx(x),
                TOP + plot_h + 16.0,
                x.round()
            );
        }
        let _ = writeln!(
            s,
            r##"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444444"/>"##
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            LEFT + plot_w / 2.0,
            HEIGHT - 12.0,
            escape(&self.x_label)
        );
        let _ = writeln!(
            s,
            r#"<text transform="translate(18 {}) rotate(-90)" text-anchor="middle">{}</text>"#,
            TOP + plot_h / 2.0,
            escape(&self.y_label)
        );
        for (i, series) in self.series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let dash = if series.dashed {
                r#" stroke-dasharray="6 4""#
            } else {
                ""
            };
            let path: Vec<String> = series
                .points
                .iter()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
                .collect();
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"/>"#,
                path.join(" ")
            );
            for point in &path {
                let (x, y) = point.split_once(',').unwrap_or(("0", "0"));
                let _ = writeln!(s, r#"<circle cx="{x}" cy="{y}" r="3" fill="{color}"/>"#);
            }
            let ly = TOP + 10.0 + 20.0 * i as f64;
            let lx = LEFT + plot_w + 14.0;
            let _ = writeln!(
                s,
                r#"<line x1="{lx}" x2="{}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/><text x="{}" y="{}">{}</text>"#,
                lx + 26.0,
                lx + 32.0,
                ly + 4.0,
                escape(&series.name)
            );
        }
        s.push_str("</svg>\n");
        s
    }
}

/// The smallest 1, 2 or 5 times a power of ten at or above `v`, so axis ticks are round.
fn nice_ceiling(v: f64) -> f64 {
    let magnitude = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|c| *c >= v)
        .unwrap_or(v)
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_polyline_per_series_and_failed_points_left_out() {
        let chart = LineChart {
            title: "index scan <pgherd>".into(),
            x_label: "clients".into(),
            y_label: "TPS".into(),
            series: vec![
                Series {
                    name: "direct".into(),
                    points: vec![(1.0, 100.0), (10.0, 900.0)],
                    dashed: true,
                },
                Series {
                    name: "pgherd 2 nodes".into(),
                    points: vec![(1.0, 90.0), (10.0, f64::NAN), (20.0, 1700.0)],
                    dashed: false,
                },
            ],
        };
        let svg = chart.render();
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("<circle").count(), 4);
        assert!(svg.contains("index scan &lt;pgherd&gt;"));
        assert!(svg.contains("stroke-dasharray"));
        assert!(svg.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn a_short_whole_number_axis_has_a_tick_per_number() {
        let chart = LineChart {
            title: "t".into(),
            x_label: "replicas".into(),
            y_label: "ms".into(),
            series: vec![Series {
                name: "async".into(),
                points: vec![(0.0, 10.0), (3.0, 11.0)],
                dashed: false,
            }],
        };
        let svg = chart.render();
        let x_ticks: Vec<&str> = svg
            .lines()
            .filter(|l| {
                l.starts_with("<text")
                    && l.contains("text-anchor=\"middle\">")
                    && !l.contains("font-size")
            })
            .filter_map(|l| l.split('>').nth(1)?.split('<').next())
            .filter(|t| t.parse::<f64>().is_ok())
            .collect();
        assert_eq!(x_ticks, vec!["0", "1", "2", "3"]);
    }

    #[test]
    fn axis_ceilings_are_round() {
        assert_eq!(nice_ceiling(1700.0), 2000.0);
        assert_eq!(nice_ceiling(4999.0), 5000.0);
        assert_eq!(nice_ceiling(5001.0), 10000.0);
        assert_eq!(nice_ceiling(1.0), 1.0);
    }
}
