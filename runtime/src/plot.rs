//! Pictures of a policy's run: world size (and the capacity the cluster
//! offered) over the steps, with the job's throughput under it, as an SVG.

use crate::plugin::replay::Decision;
use plotters::prelude::*;
use std::path::Path;

/// Why a plot could not be drawn.
#[derive(Debug, thiserror::Error)]
#[error("{path}: cannot draw the plot: {detail}")]
pub struct PlotError {
    pub path: String,
    pub detail: String,
}

/// Draws `decisions` to `path` (SVG): the world size the policy chose and the
/// capacity on top, the throughput below; `recorded` also draws the world
/// size the trace itself had (for an open-loop replay).
// Long: one chart's drawing calls, top to bottom, in the order they paint.
pub fn policy_run(path: &Path, title: &str, decisions: &[Decision], recorded: bool) -> Result<(), PlotError> {
    let err =
        |e: &dyn std::fmt::Display| PlotError { path: path.display().to_string(), detail: e.to_string() };
    let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root.titled(title, ("sans-serif", 20)).map_err(|e| err(&e))?;
    let (top, bottom) = root.split_vertically(330);

    // From step 0: the world size before the first decision is drawn too.
    let last = decisions.last().map_or(1, |d| d.step).max(1) as f64;
    let x = 0f64..last;
    let kmax =
        decisions.iter().map(|d| d.capacity.max(d.chosen).max(d.world_size)).max().unwrap_or(1) as f64 + 1.5;

    let mut sizes = ChartBuilder::on(&top)
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(48)
        .build_cartesian_2d(x.clone(), 0f64..kmax)
        .map_err(|e| err(&e))?;
    sizes
        .configure_mesh()
        .y_desc("workers")
        .x_desc("step")
        .y_label_formatter(&|v| format!("{}", v.round() as i64))
        .x_label_formatter(&|v| format!("{}", v.round() as i64))
        .draw()
        .map_err(|e| err(&e))?;
    let step_line = |pick: fn(&Decision) -> u32| size_steps(decisions, pick, |d| d.world_size);
    sizes
        .draw_series(LineSeries::new(
            size_steps(decisions, |d| d.capacity, |d| d.capacity),
            ShapeStyle::from(&RGBColor(230, 140, 0)).stroke_width(2),
        ))
        .map_err(|e| err(&e))?
        .label("capacity offered")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], RGBColor(230, 140, 0)));
    if recorded {
        sizes
            .draw_series(LineSeries::new(
                step_line(|d| d.world_size),
                ShapeStyle::from(&GREEN).stroke_width(2),
            ))
            .map_err(|e| err(&e))?
            .label("world size in the trace")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], GREEN));
    }
    sizes
        .draw_series(LineSeries::new(step_line(|d| d.chosen), ShapeStyle::from(&BLUE).stroke_width(3)))
        .map_err(|e| err(&e))?
        .label(if recorded { "world size the policy asked for" } else { "world size chosen by the policy" })
        .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], BLUE));
    sizes
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;

    let tmax = decisions.iter().map(|d| d.throughput).fold(1.0, f64::max) * 1.1;
    let mut tput = ChartBuilder::on(&bottom)
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(48)
        .build_cartesian_2d(x, 0f64..tmax)
        .map_err(|e| err(&e))?;
    tput.configure_mesh()
        .y_desc("samples/s")
        .x_desc("step")
        .y_label_formatter(&|v| format!("{}", v.round() as i64))
        .x_label_formatter(&|v| format!("{}", v.round() as i64))
        .draw()
        .map_err(|e| err(&e))?;
    tput.draw_series(LineSeries::new(
        decisions.iter().map(|d| (d.step as f64, d.throughput)),
        ShapeStyle::from(&RED).stroke_width(2),
    ))
    .map_err(|e| err(&e))?
    .label("job throughput")
    .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], RED));
    tput.configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// A size over the steps as a staircase: what `pick` gives holds from a
/// decision to the next; before the first, `before` (the size the first
/// decision saw) holds from step 0.
fn size_steps(
    decisions: &[Decision],
    pick: fn(&Decision) -> u32,
    before: fn(&Decision) -> u32,
) -> Vec<(f64, f64)> {
    let mut pts = Vec::with_capacity(decisions.len() * 2 + 2);
    let Some(first) = decisions.first() else { return pts };
    let last = decisions.last().map_or(0, |d| d.step) as f64;
    let initial = before(first);
    pts.push((0.0, initial as f64));
    pts.push((first.step as f64, initial as f64));
    for (i, d) in decisions.iter().enumerate() {
        let y = pick(d) as f64;
        pts.push((d.step as f64, y));
        let next = decisions.get(i + 1).map_or(last, |n| n.step as f64);
        pts.push((next, y));
    }
    pts
}

/// Draws a training run to `path` (SVG): world size, throughput and loss over
/// wall-clock time, one panel each, with a dashed line at each scale event;
/// the program's own metrics (`step.commit(loss=..., accuracy=...)`) are
/// drawn with the loss, each with its name in the legend.
pub fn training_run(
    path: &Path,
    title: &str,
    steps: &[crate::coordinator::StepRecord],
    events: &[crate::leader::record::ScaleEvent],
) -> Result<(), PlotError> {
    let err =
        |e: &dyn std::fmt::Display| PlotError { path: path.display().to_string(), detail: e.to_string() };
    let root = SVGBackend::new(path, (960, 820)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root.titled(title, ("sans-serif", 20)).map_err(|e| err(&e))?;
    let panels = root.split_evenly((3, 1));
    let t_end = steps.last().map_or(1.0, |s| s.secs).max(1e-3);
    let t0 = steps.first().map_or(0.0, |s| s.secs).min(t_end - 1e-3);
    type Pick = fn(&crate::coordinator::StepRecord) -> f64;
    let series: [(&str, Pick, RGBColor, bool); 3] = [
        ("workers", |s| s.world as f64, BLUE, true),
        ("samples/s", |s| s.samples_per_sec, RED, false),
        ("loss", |s| s.loss, RGBColor(0, 130, 0), false),
    ];
    let metrics: std::collections::BTreeSet<&str> =
        steps.iter().flat_map(|s| s.metrics.keys().map(String::as_str)).collect();
    let metric_max =
        steps.iter().flat_map(|s| s.metrics.values().copied()).filter(|v| v.is_finite()).fold(0.0, f64::max);
    for (area, (name, pick, color, integer)) in panels.iter().zip(series) {
        let own = name == "loss" && !metrics.is_empty();
        let ymax = steps
            .iter()
            .map(pick)
            .filter(|v| v.is_finite())
            .fold(if own { metric_max } else { 0.0 }, f64::max)
            .max(1e-6)
            * if integer { 1.0 } else { 1.1 }
            + if integer { 1.0 } else { 0.0 };
        let mut chart = ChartBuilder::on(area)
            .margin(10)
            .x_label_area_size(28)
            .y_label_area_size(56)
            .build_cartesian_2d(t0..t_end, 0f64..ymax)
            .map_err(|e| err(&e))?;
        chart.configure_mesh().y_desc(name).x_desc("seconds").draw().map_err(|e| err(&e))?;
        for e in events {
            chart
                .draw_series(DashedLineSeries::new(
                    [(e.at_secs, 0.0), (e.at_secs, ymax)],
                    4,
                    4,
                    ShapeStyle::from(&RGBColor(150, 150, 150)).stroke_width(1),
                ))
                .map_err(|e| err(&e))?;
        }
        let pts: Vec<(f64, f64)> = if integer {
            let mut v = Vec::new();
            for (i, s) in steps.iter().enumerate() {
                v.push((s.secs, pick(s)));
                let next = steps.get(i + 1).map_or(t_end, |n| n.secs);
                v.push((next, pick(s)));
            }
            v
        } else {
            steps.iter().map(|s| (s.secs, pick(s))).filter(|p| p.1.is_finite()).collect()
        };
        let line = chart
            .draw_series(LineSeries::new(pts, ShapeStyle::from(&color).stroke_width(2)))
            .map_err(|e| err(&e))?;
        if own {
            line.label(name).legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color));
            for (i, metric) in metrics.iter().enumerate() {
                let c = Palette99::pick(i + 1).to_rgba();
                let pts: Vec<(f64, f64)> = steps
                    .iter()
                    .filter_map(|s| Some((s.secs, *s.metrics.get(*metric)?)))
                    .filter(|p| p.1.is_finite())
                    .collect();
                chart
                    .draw_series(LineSeries::new(pts, ShapeStyle::from(&c).stroke_width(2)))
                    .map_err(|e| err(&e))?
                    .label(*metric)
                    .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], c));
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()
                .map_err(|e| err(&e))?;
        }
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_plugin_sdk::Action;

    fn decision(step: u64, world_size: u32, chosen: u32) -> Decision {
        Decision { step, world_size, chosen, throughput: 1.0, capacity: 8, actions: vec![Action::Hold] }
    }

    #[test]
    fn the_staircase_starts_at_step_0_with_the_initial_size() {
        let d = [decision(20, 1, 3), decision(40, 3, 2)];
        let pts = size_steps(&d, |d| d.chosen, |d| d.world_size);
        assert_eq!(pts, vec![(0.0, 1.0), (20.0, 1.0), (20.0, 3.0), (40.0, 3.0), (40.0, 2.0), (40.0, 2.0)]);
        assert!(size_steps(&[], |d| d.chosen, |d| d.world_size).is_empty());
    }
}
