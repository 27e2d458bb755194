//! The PNG chart of `pagoda eval`, in the style of the papers' accuracy-vs-budget figures: one panel per metric
//! (synthetic-task score, prose top-1 agreement, prose KL, prose accuracy on the real text), a line per policy over
//! the budgets, and the full cache on the same items as a dashed horizontal reference.

use std::path::Path;

use anyhow::{Context, Result, anyhow};
use pagoda_worker::eval::runner::{Cell, EvalReport, PROSE, PROSE_NEXT_TOKEN};
use plotters::prelude::*;

use crate::bench_plot::{FONT, draw_legend, register_font};

struct Metric {
    title: &'static str,
    y_label: &'static str,
    /// Which cells feed it: `Some(task)`, or `None` for the synthetic tasks pooled.
    task: Option<&'static str>,
    value: fn(&Cell) -> Option<f64>,
    /// The full cache's value on the same items.
    full: fn(&Cell) -> Option<f64>,
    /// The standard error of `value`, drawn as a whisker: for the scores, not for KL.
    se: fn(&Cell) -> Option<f64>,
}

impl Metric {
    fn feeds(&self, cell: &Cell) -> bool {
        match self.task {
            Some(task) => cell.task == task,
            None => !cell.task.starts_with(PROSE),
        }
    }
}

/// Draws the panels that have data into a PNG at `path`.
pub fn draw_eval(report: &EvalReport, path: &Path) -> Result<()> {
    register_font()?;
    let metrics = [
        Metric {
            title: "Synthetic tasks: mean score",
            y_label: "score",
            task: None,
            value: |c| Some(c.score),
            full: |c| Some(c.full_score),
            se: |c| Some(c.score_se),
        },
        Metric {
            title: "Prose: top-1 agreement with full cache",
            y_label: "agreement",
            task: Some(PROSE),
            value: |c| Some(c.score),
            full: |_| Some(1.0),
            se: |c| Some(c.score_se),
        },
        Metric {
            title: "Prose: KL(full || policy), nats",
            y_label: "KL",
            task: Some(PROSE),
            value: |c| c.kl,
            full: |_| Some(0.0),
            se: |_| None,
        },
        Metric {
            title: "Prose: top-1 accuracy on the real text",
            y_label: "accuracy",
            task: Some(PROSE_NEXT_TOKEN),
            value: |c| Some(c.score),
            full: |c| Some(c.full_score),
            se: |c| Some(c.score_se),
        },
    ];
    let shown: Vec<&Metric> =
        metrics.iter().filter(|m| report.cells.iter().any(|c| m.feeds(c) && c.policy != "full")).collect();
    if shown.is_empty() {
        return Err(anyhow!("nothing to plot: the report has no policy cells"));
    }
    // Four panels read better as a 2 × 2 grid than as one wide row.
    let rows = if shown.len() == 4 { 2 } else { 1 };
    let cols = shown.len() / rows;
    let root = BitMapBackend::new(path, (560 * cols as u32, 560 * rows as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let root = root
        .titled("KV eviction policies against the full cache (SmolLM2-135M-Instruct)", (FONT, 22))
        .map_err(|e| anyhow!("{e}"))?;
    for (area, m) in root.split_evenly((rows, cols)).iter().zip(shown) {
        draw_metric(area, report, m)?;
    }
    root.present().with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// The cells of one policy and budget that feed the metric (one per task for the pooled synthetic tasks).
fn cells<'a>(report: &'a EvalReport, m: &'a Metric, policy: &'a str, budget: usize) -> impl Iterator<Item = &'a Cell> {
    report.cells.iter().filter(move |c| m.feeds(c) && c.policy == policy && c.budget == budget)
}

/// Averages `value` over the cells of one policy and budget (tasks pooled), for the metric's kind of cell.
fn mean(report: &EvalReport, m: &Metric, policy: &str, budget: usize, f: fn(&Cell) -> Option<f64>) -> Option<f64> {
    let vals: Vec<f64> = cells(report, m, policy, budget).filter_map(f).collect();
    (!vals.is_empty()).then(|| vals.iter().sum::<f64>() / vals.len() as f64)
}

/// The standard error of [`mean`]: the mean of `k` cells' means has `√(Σ seᵢ²) / k`.
fn mean_se(report: &EvalReport, m: &Metric, policy: &str, budget: usize) -> Option<f64> {
    let ses: Vec<f64> = cells(report, m, policy, budget).filter_map(m.se).collect();
    (!ses.is_empty()).then(|| ses.iter().map(|s| s * s).sum::<f64>().sqrt() / ses.len() as f64)
}

/// One plotted point: the budget (dodged), the value and its standard error.
type Point = (f64, f64, f64);

/// Policies' points at one budget sit this factor apart on the log axis, so that their whiskers do not overlap.
const DODGE: f64 = 1.025;

fn draw_metric<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    report: &EvalReport,
    m: &Metric,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{e:?}");
    let budgets: Vec<f64> = report.options.budgets.iter().map(|&b| b as f64).collect();
    let (x_min, x_max) = match (budgets.first(), budgets.last()) {
        (Some(&a), Some(&b)) if b > a => (a / 1.3, b * 1.3),
        (Some(&a), _) => (a / 2.0, a * 2.0),
        _ => (64.0, 4096.0),
    };
    let mut policies: Vec<&str> = Vec::new();
    for c in report.cells.iter().filter(|c| c.policy != "full") {
        if !policies.contains(&c.policy.as_str()) {
            policies.push(&c.policy);
        }
    }
    let centre = (policies.len() as f64 - 1.0) / 2.0;
    let series: Vec<(&str, Vec<Point>)> = policies
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            let dodge = DODGE.powf(i as f64 - centre);
            let pts = report
                .options
                .budgets
                .iter()
                .filter_map(|&b| {
                    let v = mean(report, m, p, b, m.value)?;
                    Some((b as f64 * dodge, v, mean_se(report, m, p, b).unwrap_or(0.0)))
                })
                .collect();
            (p, pts)
        })
        .collect();
    // The full cache: its value on the items of any cell (all cells of a metric share the item set per task).
    let full =
        report.options.budgets.first().and_then(|&b| policies.first().and_then(|&p| mean(report, m, p, b, m.full)));
    let y_top =
        series.iter().flat_map(|(_, pts)| pts.iter().map(|p| p.1 + p.2)).chain(full).fold(0.0, f64::max).max(0.05)
            * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption(m.title, (FONT, 18))
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d((x_min..x_max).log_scale().with_key_points(budgets.clone()), 0.0..y_top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("KV budget (tokens per layer and kv-head)")
        .y_desc(m.y_label)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.2}"))
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 14))
        .draw()
        .map_err(err)?;
    if let Some(f) = full {
        chart
            .draw_series(DashedLineSeries::new([(x_min, f), (x_max, f)], 6, 4, BLACK.stroke_width(2)))
            .map_err(err)?
            .label("full cache")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], BLACK.stroke_width(2)));
    }
    for (i, (p, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart.draw_series(LineSeries::new(pts.iter().map(|&(x, y, _)| (x, y)), color.stroke_width(2))).map_err(err)?;
        chart
            .draw_series(
                pts.iter()
                    .filter(|p| p.2 > 0.0)
                    .map(|&(x, y, se)| PathElement::new([(x, (y - se).max(0.0)), (x, y + se)], color.stroke_width(1))),
            )
            .map_err(err)?;
        chart
            .draw_series(pts.iter().map(|&(x, y, _)| Circle::new((x, y), 4, color.filled())))
            .map_err(err)?
            .label(*p)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    draw_legend(&mut chart, 13)
}
