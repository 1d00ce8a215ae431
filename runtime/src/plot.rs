//! Pictures of a policy's run: world size (and the capacity the cluster
//! offered) over the steps, with the job's throughput under it, as an SVG.

use crate::replay::Decision;
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
pub fn policy_run(path: &Path, title: &str, decisions: &[Decision], recorded: bool) -> Result<(), PlotError> {
    let err =
        |e: &dyn std::fmt::Display| PlotError { path: path.display().to_string(), detail: e.to_string() };
    let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root.titled(title, ("sans-serif", 20)).map_err(|e| err(&e))?;
    let (top, bottom) = root.split_vertically(330);

    let first = decisions.first().map_or(0, |d| d.step) as f64;
    let last = decisions.last().map_or(1, |d| d.step).max(1) as f64;
    let x = first..last.max(first + 1.0);
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
    let step_line = |pick: fn(&Decision) -> u32| {
        let mut pts = Vec::with_capacity(decisions.len() * 2);
        for (i, d) in decisions.iter().enumerate() {
            let y = pick(d) as f64;
            pts.push((d.step as f64, y));
            let next = decisions.get(i + 1).map_or(last, |n| n.step as f64);
            pts.push((next, y));
        }
        pts
    };
    sizes
        .draw_series(LineSeries::new(
            step_line(|d| d.capacity),
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
