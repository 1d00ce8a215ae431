//! Pictures of a policy's run: world size (and the capacity the cluster
//! offered) over the steps, with the job's throughput under it, as an SVG.

use crate::plugin::replay::Decision;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

/// Why a plot could not be drawn.
#[derive(Debug, thiserror::Error)]
#[error("{path}: cannot draw the plot: {detail}")]
pub struct PlotError {
    pub path: String,
    pub detail: String,
}

/// A drawing call's failure on an SVG chart.
type DrawError = DrawingAreaErrorKind<<SVGBackend<'static> as DrawingBackend>::ErrorType>;
/// A part of an SVG picture.
type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// Turns a drawing call's failure into the error of the plot at `path`.
fn failed<E: std::fmt::Display>(path: &Path) -> impl FnOnce(E) -> PlotError {
    let path = path.display().to_string();
    move |e| PlotError { path, detail: e.to_string() }
}

/// A white SVG picture at `path` of `size` pixels, titled `title`.
fn titled_canvas<'a>(path: &'a Path, size: (u32, u32), title: &str) -> Result<Area<'a>, PlotError> {
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(failed(path))?;
    root.titled(title, ("sans-serif", 20)).map_err(failed(path))
}

/// A legend's sample of a line of `color`, `width` pixels long.
fn legend_line(color: impl Into<ShapeStyle>, width: i32) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    let style = color.into();
    move |(x, y)| PathElement::new([(x, y), (x + width, y)], style)
}

/// Draws `decisions` to `path` (SVG): the world size the policy chose and the
/// capacity on top, the throughput below; `recorded` also draws the world
/// size the trace itself had (for an open-loop replay).
pub fn policy_run(path: &Path, title: &str, decisions: &[Decision], recorded: bool) -> Result<(), PlotError> {
    let root = titled_canvas(path, (960, 640), title)?;
    let (top, bottom) = root.split_vertically(330);
    // From step 0: the world size before the first decision is drawn too.
    let steps = 0f64..decisions.last().map_or(1, |d| d.step).max(1) as f64;
    draw_world_sizes(&top, steps.clone(), decisions, recorded).map_err(failed(path))?;
    draw_throughput(&bottom, steps, decisions).map_err(failed(path))?;
    root.present().map_err(failed(path))
}

/// The world sizes over the steps: the capacity offered, the size the
/// policy chose, and with `recorded` the size the trace had.
fn draw_world_sizes(
    area: &Area<'_>,
    steps: std::ops::Range<f64>,
    decisions: &[Decision],
    recorded: bool,
) -> Result<(), DrawError> {
    let kmax =
        decisions.iter().map(|d| d.capacity.max(d.chosen).max(d.world_size)).max().unwrap_or(1) as f64 + 1.5;
    let mut sizes = ChartBuilder::on(area)
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(48)
        .build_cartesian_2d(steps, 0f64..kmax)?;
    sizes
        .configure_mesh()
        .y_desc("workers")
        .x_desc("step")
        .y_label_formatter(&|v| format!("{}", v.round() as i64))
        .x_label_formatter(&|v| format!("{}", v.round() as i64))
        .draw()?;
    let step_line = |pick: fn(&Decision) -> u32| size_steps(decisions, pick, |d| d.world_size);
    let orange = RGBColor(230, 140, 0);
    sizes
        .draw_series(LineSeries::new(
            size_steps(decisions, |d| d.capacity, |d| d.capacity),
            ShapeStyle::from(&orange).stroke_width(2),
        ))?
        .label("capacity offered")
        .legend(legend_line(orange, 18));
    if recorded {
        sizes
            .draw_series(LineSeries::new(
                step_line(|d| d.world_size),
                ShapeStyle::from(&GREEN).stroke_width(2),
            ))?
            .label("world size in the trace")
            .legend(legend_line(GREEN, 18));
    }
    sizes
        .draw_series(LineSeries::new(step_line(|d| d.chosen), ShapeStyle::from(&BLUE).stroke_width(3)))?
        .label(if recorded { "world size the policy asked for" } else { "world size chosen by the policy" })
        .legend(legend_line(BLUE, 18));
    sizes
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
}

/// The job's throughput over the steps.
fn draw_throughput(
    area: &Area<'_>,
    steps: std::ops::Range<f64>,
    decisions: &[Decision],
) -> Result<(), DrawError> {
    let tmax = decisions.iter().map(|d| d.throughput).fold(1.0, f64::max) * 1.1;
    let mut tput = ChartBuilder::on(area)
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(48)
        .build_cartesian_2d(steps, 0f64..tmax)?;
    tput.configure_mesh()
        .y_desc("samples/s")
        .x_desc("step")
        .y_label_formatter(&|v| format!("{}", v.round() as i64))
        .x_label_formatter(&|v| format!("{}", v.round() as i64))
        .draw()?;
    tput.draw_series(LineSeries::new(
        decisions.iter().map(|d| (d.step as f64, d.throughput)),
        ShapeStyle::from(&RED).stroke_width(2),
    ))?
    .label("job throughput")
    .legend(legend_line(RED, 18));
    tput.configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
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
/// drawn with the loss, each with its name in the legend; the teacher
/// pool's size (from its changes) is drawn with the workers.
pub fn training_run(
    path: &Path,
    title: &str,
    steps: &[crate::coordinator::StepRecord],
    events: &[crate::leader::record::ScaleEvent],
    teachers: &[crate::coordinator::pool::TeacherEvent],
) -> Result<(), PlotError> {
    let root = titled_canvas(path, (960, 820), title)?;
    let mut run = TrainingRun::new(steps, events);
    run.teachers = teacher_sizes(teachers, run.t0, run.t_end);
    for (area, panel) in root.split_evenly((3, 1)).iter().zip(Panel::all()) {
        run.draw(area, &panel).map_err(failed(path))?;
    }
    root.present().map_err(failed(path))
}

/// One panel of a training run's picture: a value of each step over time.
struct Panel {
    name: &'static str,
    pick: fn(&crate::coordinator::StepRecord) -> f64,
    color: RGBColor,
    /// A count, drawn as a staircase (it holds until the next step).
    integer: bool,
}

impl Panel {
    /// The panels, top to bottom.
    fn all() -> [Panel; 3] {
        [
            Panel { name: "workers", pick: |s| s.world as f64, color: BLUE, integer: true },
            Panel { name: "samples/s", pick: |s| s.samples_per_sec, color: RED, integer: false },
            Panel { name: "loss", pick: |s| s.loss, color: RGBColor(0, 130, 0), integer: false },
        ]
    }
}

/// A training run's steps and scale events, with the ranges its panels share.
struct TrainingRun<'a> {
    steps: &'a [crate::coordinator::StepRecord],
    events: &'a [crate::leader::record::ScaleEvent],
    /// The time axis, in seconds.
    t0: f64,
    t_end: f64,
    /// The names of the program's own metrics, and their largest finite value.
    metrics: std::collections::BTreeSet<&'a str>,
    metric_max: f64,
    /// The teacher pool's size as a staircase (empty: no pool changes).
    teachers: Vec<(f64, f64)>,
}

/// The teacher pool's size over `t0..t_end` as a staircase, from its
/// changes (the size before the first holds from `t0`).
fn teacher_sizes(events: &[crate::coordinator::pool::TeacherEvent], t0: f64, t_end: f64) -> Vec<(f64, f64)> {
    let Some(first) = events.first() else { return Vec::new() };
    let mut pts = vec![(t0, first.from as f64)];
    for e in events {
        let at = e.secs.clamp(t0, t_end);
        let was = pts.last().map_or(0.0, |p| p.1);
        pts.push((at, was));
        pts.push((at, e.to as f64));
    }
    let last = pts.last().map_or(0.0, |p| p.1);
    pts.push((t_end, last));
    pts
}

impl<'a> TrainingRun<'a> {
    fn new(
        steps: &'a [crate::coordinator::StepRecord],
        events: &'a [crate::leader::record::ScaleEvent],
    ) -> Self {
        let t_end = steps.last().map_or(1.0, |s| s.secs).max(1e-3);
        let t0 = steps.first().map_or(0.0, |s| s.secs).min(t_end - 1e-3);
        let metrics = steps.iter().flat_map(|s| s.metrics.keys().map(String::as_str)).collect();
        let metric_max = steps
            .iter()
            .flat_map(|s| s.metrics.values().copied())
            .filter(|v| v.is_finite())
            .fold(0.0, f64::max);
        TrainingRun { steps, events, t0, t_end, metrics, metric_max, teachers: Vec::new() }
    }

    /// Whether `panel` also holds the program's metrics (the loss's does).
    fn holds_metrics(&self, panel: &Panel) -> bool {
        panel.name == "loss" && !self.metrics.is_empty()
    }

    fn draw(&self, area: &Area<'_>, panel: &Panel) -> Result<(), DrawError> {
        let ymax = self.top_of(panel);
        let mut chart = ChartBuilder::on(area)
            .margin(10)
            .x_label_area_size(28)
            .y_label_area_size(56)
            .build_cartesian_2d(self.t0..self.t_end, 0f64..ymax)?;
        chart.configure_mesh().y_desc(panel.name).x_desc("seconds").draw()?;
        for e in self.events {
            chart.draw_series(DashedLineSeries::new(
                [(e.at_secs, 0.0), (e.at_secs, ymax)],
                4,
                4,
                ShapeStyle::from(&RGBColor(150, 150, 150)).stroke_width(1),
            ))?;
        }
        let line = chart.draw_series(LineSeries::new(
            self.points(panel),
            ShapeStyle::from(&panel.color).stroke_width(2),
        ))?;
        if panel.name == "workers" && !self.teachers.is_empty() {
            line.label("workers").legend(legend_line(panel.color, 16));
            let orange = RGBColor(230, 120, 0);
            chart
                .draw_series(LineSeries::new(
                    self.teachers.clone(),
                    ShapeStyle::from(&orange).stroke_width(2),
                ))?
                .label("teachers")
                .legend(legend_line(orange, 16));
            return chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw();
        }
        if !self.holds_metrics(panel) {
            return Ok(());
        }
        line.label(panel.name).legend(legend_line(panel.color, 16));
        for (i, metric) in self.metrics.iter().enumerate() {
            let c = Palette99::pick(i + 1).to_rgba();
            let pts: Vec<(f64, f64)> = self
                .steps
                .iter()
                .filter_map(|s| Some((s.secs, *s.metrics.get(*metric)?)))
                .filter(|p| p.1.is_finite())
                .collect();
            chart
                .draw_series(LineSeries::new(pts, ShapeStyle::from(&c).stroke_width(2)))?
                .label(*metric)
                .legend(legend_line(c, 16));
        }
        chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()
    }

    /// The top of `panel`'s value axis: above its largest finite value
    /// (and the metrics' where it holds them).
    fn top_of(&self, panel: &Panel) -> f64 {
        let floor = if self.holds_metrics(panel) {
            self.metric_max
        } else if panel.name == "workers" {
            self.teachers.iter().map(|p| p.1).fold(0.0, f64::max)
        } else {
            0.0
        };
        let max = self.steps.iter().map(panel.pick).filter(|v| v.is_finite()).fold(floor, f64::max).max(1e-6);
        if panel.integer { max + 1.0 } else { max * 1.1 }
    }

    /// `panel`'s line: a staircase for a count, else its finite values.
    fn points(&self, panel: &Panel) -> Vec<(f64, f64)> {
        let pick = panel.pick;
        if !panel.integer {
            return self.steps.iter().map(|s| (s.secs, pick(s))).filter(|p| p.1.is_finite()).collect();
        }
        let mut v = Vec::new();
        for (i, s) in self.steps.iter().enumerate() {
            v.push((s.secs, pick(s)));
            let next = self.steps.get(i + 1).map_or(self.t_end, |n| n.secs);
            v.push((next, pick(s)));
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_plugin_sdk::Action;

    fn decision(step: u64, world_size: u32, chosen: u32) -> Decision {
        Decision { step, world_size, chosen, throughput: 1.0, capacity: 8, actions: vec![Action::Hold] }
    }

    #[test]
    fn the_teacher_pool_is_drawn_with_the_workers_as_a_staircase() {
        let event = |secs: f64, from: u32, to: u32| crate::coordinator::pool::TeacherEvent {
            step: 0,
            secs,
            from,
            to,
            reason: String::new(),
        };
        let sizes = teacher_sizes(&[event(2.0, 1, 2), event(5.0, 2, 3)], 0.5, 9.0);
        assert_eq!(sizes, [(0.5, 1.0), (2.0, 1.0), (2.0, 2.0), (5.0, 2.0), (5.0, 3.0), (9.0, 3.0)]);
        let step = |secs: f64| crate::coordinator::StepRecord {
            step: 0,
            epoch: 0,
            world: 2,
            secs,
            loss: 1.0,
            samples_per_sec: 10.0,
            cursor: 0,
            metrics: Default::default(),
        };
        let dir = tempfile::tempdir().unwrap();
        let (with, without) = (dir.path().join("with.svg"), dir.path().join("without.svg"));
        let steps = [step(0.5), step(9.0)];
        training_run(&with, "t", &steps, &[], &[event(2.0, 1, 2)]).unwrap();
        training_run(&without, "t", &steps, &[], &[]).unwrap();
        assert!(std::fs::read_to_string(&with).unwrap().contains("teachers"));
        assert!(!std::fs::read_to_string(&without).unwrap().contains("teachers"));
    }

    #[test]
    fn the_staircase_starts_at_step_0_with_the_initial_size() {
        let d = [decision(20, 1, 3), decision(40, 3, 2)];
        let pts = size_steps(&d, |d| d.chosen, |d| d.world_size);
        assert_eq!(pts, vec![(0.0, 1.0), (20.0, 1.0), (20.0, 3.0), (40.0, 3.0), (40.0, 2.0), (40.0, 2.0)]);
        assert!(size_steps(&[], |d| d.chosen, |d| d.world_size).is_empty());
    }
}
