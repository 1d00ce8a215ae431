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
/// A chart of values over seconds.
type TimeChart<'a, 'b> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

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

/// Draws a training run to `path` (SVG): world size, throughput, loss and
/// each of the program's own metrics (`step.commit(loss=..., accuracy=...)`)
/// over wall-clock time, one panel and one axis each. A dashed line marks
/// each scale event, labelled with its sizes and its cause in the workers'
/// panel (a lost worker's in red); a stretch without a committed step is a
/// gap, not a line across it; the throughput is drawn smoothed, its raw
/// points faint; the teacher pool's size (from its changes) is drawn with
/// the workers.
pub fn training_run(
    path: &Path,
    title: &str,
    steps: &[crate::coordinator::StepRecord],
    events: &[crate::leader::record::ScaleEvent],
    teachers: &[crate::coordinator::pool::TeacherEvent],
) -> Result<(), PlotError> {
    let mut run = TrainingRun::new(steps, events);
    run.teachers = teacher_sizes(teachers, run.t0, run.t_end);
    let panels = run.panels();
    let root = titled_canvas(path, (960, 60 + 250 * panels.len() as u32), title)?;
    for (area, panel) in root.split_evenly((panels.len(), 1)).iter().zip(&panels) {
        run.draw(area, panel).map_err(failed(path))?;
    }
    root.present().map_err(failed(path))
}

/// Draws a `launch --torchrun` job to `path` (SVG): each group's size over
/// wall-clock time (the launcher sees no steps or throughput), a dashed
/// line where each group ended, labelled with how (a failure in red).
pub fn torchrun_run(
    path: &Path,
    title: &str,
    groups: &[crate::torchrun::GroupRecord],
) -> Result<(), PlotError> {
    let root = titled_canvas(path, (960, 360), title)?;
    draw_groups(&root, groups).map_err(failed(path))?;
    root.present().map_err(failed(path))
}

fn draw_groups(area: &Area<'_>, groups: &[crate::torchrun::GroupRecord]) -> Result<(), DrawError> {
    let t_end = groups.iter().map(|g| g.ended_secs).fold(1e-3, f64::max);
    let ymax = groups.iter().map(|g| g.world).max().unwrap_or(1) as f64 + 1.0;
    let mut chart = ChartBuilder::on(area)
        .margin(10)
        .x_label_area_size(28)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..t_end, 0f64..ymax)?;
    chart
        .configure_mesh()
        .y_desc("ranks")
        .x_desc("seconds")
        .y_labels(ymax as usize + 1)
        .y_label_formatter(&integer_label)
        .draw()?;
    let pts: Vec<(f64, f64)> = groups
        .iter()
        .flat_map(|g| [(g.started_secs, g.world as f64), (g.ended_secs, g.world as f64)])
        .collect();
    chart.draw_series(LineSeries::new(pts, ShapeStyle::from(&BLUE).stroke_width(2)))?;
    for (i, g) in groups.iter().enumerate() {
        let failed = g.ended.contains("failed");
        let color = if failed { RGBColor(220, 0, 0) } else { RGBColor(150, 150, 150) };
        chart.draw_series(DashedLineSeries::new(
            [(g.ended_secs, 0.0), (g.ended_secs, ymax)],
            4,
            4,
            ShapeStyle::from(&color).stroke_width(if failed { 2 } else { 1 }),
        ))?;
        let label: String = format!("group {}: {}", g.group, g.ended).chars().take(40).collect();
        let y = ymax * (0.95 - 0.12 * (i % 3) as f64);
        let style = ("sans-serif", 12).into_font().color(&color);
        chart.draw_series(std::iter::once(Text::new(label, (g.ended_secs, y), style)))?;
    }
    Ok(())
}

/// What a panel of a training run draws.
#[derive(Clone, Debug, PartialEq)]
enum Quantity {
    Workers,
    Throughput,
    Loss,
    NoiseScale,
    Goodput,
    Efficiency,
    Metric(String),
}

/// One panel of a training run's picture: a value of each step over time.
struct Panel {
    quantity: Quantity,
    color: RGBColor,
}

impl Panel {
    fn name(&self) -> &str {
        match &self.quantity {
            Quantity::Workers => "workers",
            Quantity::Throughput => "samples/s",
            Quantity::Loss => "loss",
            Quantity::NoiseScale => "gradient noise scale",
            Quantity::Goodput => "goodput",
            Quantity::Efficiency => "statistical efficiency",
            Quantity::Metric(m) => m,
        }
    }

    /// The panel's value at step `s`, if it has one.
    fn pick(&self, s: &crate::coordinator::StepRecord) -> Option<f64> {
        let v = match &self.quantity {
            Quantity::Workers => s.world as f64,
            Quantity::Throughput => s.samples_per_sec,
            Quantity::Loss => s.loss,
            Quantity::NoiseScale => s.noise_scale?,
            Quantity::Goodput => s.goodput?,
            Quantity::Efficiency => s.efficiency?,
            Quantity::Metric(m) => *s.metrics.get(m)?,
        };
        v.is_finite().then_some(v)
    }
}

/// A training run's steps and scale events, with the ranges its panels share.
struct TrainingRun<'a> {
    steps: &'a [crate::coordinator::StepRecord],
    events: &'a [crate::leader::record::ScaleEvent],
    /// The time axis, in seconds.
    t0: f64,
    t_end: f64,
    /// The names of the program's own metrics.
    metrics: std::collections::BTreeSet<&'a str>,
    /// Longer than this between two committed steps is a gap in the lines.
    gap: f64,
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

/// A tick label of a count's axis: whole numbers only, each once.
fn integer_label(v: &f64) -> String {
    if (v - v.round()).abs() < 1e-6 { format!("{}", v.round() as i64) } else { String::new() }
}

/// A tick label of a large quantity, short (`12k`, `1.5M`).
fn short_label(v: &f64) -> String {
    match v.abs() {
        a if a >= 1e6 => format!("{:.1}M", v / 1e6),
        a if a >= 1e4 => format!("{:.0}k", v / 1e3),
        a if a >= 1e3 => format!("{:.1}k", v / 1e3),
        a if a >= 10.0 => format!("{v:.0}"),
        _ => format!("{v:.2}"),
    }
}

/// Splits `pts` (in time order) where two points are more than `gap` apart.
fn segments(pts: Vec<(f64, f64)>, gap: f64) -> Vec<Vec<(f64, f64)>> {
    let mut out: Vec<Vec<(f64, f64)>> = Vec::new();
    for p in pts {
        match out.last_mut() {
            Some(seg) if seg.last().is_some_and(|q| p.0 - q.0 <= gap) => seg.push(p),
            _ => out.push(vec![p]),
        }
    }
    out
}

/// Each point's value as the mean over the `k` points around it.
fn smoothed(pts: &[(f64, f64)], k: usize) -> Vec<(f64, f64)> {
    let half = k / 2;
    (0..pts.len())
        .map(|i| {
            let w = &pts[i.saturating_sub(half)..(i + half + 1).min(pts.len())];
            (pts[i].0, w.iter().map(|p| p.1).sum::<f64>() / w.len() as f64)
        })
        .collect()
}

/// A scale event's label: its sizes and the first part of its reason.
fn event_label(e: &crate::leader::record::ScaleEvent) -> String {
    let cause: String = e.reason.split([';', ',']).next().unwrap_or("").chars().take(28).collect();
    format!("{}→{} {}", e.from, e.to, cause.trim())
}

/// Whether a scale event came from a failure (a worker lost), not a plan.
fn is_loss(e: &crate::leader::record::ScaleEvent) -> bool {
    e.reason.contains("lost") || e.reason.contains("failed")
}

impl<'a> TrainingRun<'a> {
    fn new(
        steps: &'a [crate::coordinator::StepRecord],
        events: &'a [crate::leader::record::ScaleEvent],
    ) -> Self {
        let t_end = steps.last().map_or(1.0, |s| s.secs).max(1e-3);
        let t0 = steps.first().map_or(0.0, |s| s.secs).min(t_end - 1e-3);
        let metrics = steps.iter().flat_map(|s| s.metrics.keys().map(String::as_str)).collect();
        let mut dt: Vec<f64> = steps.windows(2).map(|w| w[1].secs - w[0].secs).collect();
        dt.sort_by(f64::total_cmp);
        let median = dt.get(dt.len() / 2).copied().unwrap_or(0.0);
        let gap = (median * 10.0).max(2.0);
        TrainingRun { steps, events, t0, t_end, metrics, gap, teachers: Vec::new() }
    }

    /// The panels, top to bottom: one per quantity.
    fn panels(&self) -> Vec<Panel> {
        let mut out = vec![
            Panel { quantity: Quantity::Workers, color: BLUE },
            Panel { quantity: Quantity::Throughput, color: RED },
            Panel { quantity: Quantity::Loss, color: RGBColor(0, 130, 0) },
        ];
        if self.steps.iter().any(|s| s.noise_scale.is_some()) {
            out.push(Panel { quantity: Quantity::NoiseScale, color: RGBColor(140, 80, 0) });
            out.push(Panel { quantity: Quantity::Goodput, color: RGBColor(120, 0, 140) });
            out.push(Panel { quantity: Quantity::Efficiency, color: RGBColor(0, 110, 140) });
        }
        for (i, m) in self.metrics.iter().enumerate() {
            let color = Palette99::pick(i + 1).to_rgba();
            out.push(Panel {
                quantity: Quantity::Metric(m.to_string()),
                color: RGBColor(color.0, color.1, color.2),
            });
        }
        out
    }

    fn draw(&self, area: &Area<'_>, panel: &Panel) -> Result<(), DrawError> {
        let ymax = self.top_of(panel);
        let mut chart = ChartBuilder::on(area)
            .margin(10)
            .x_label_area_size(28)
            .y_label_area_size(64)
            .build_cartesian_2d(self.t0..self.t_end, 0f64..ymax)?;
        let counts = panel.quantity == Quantity::Workers;
        let mut mesh = chart.configure_mesh();
        mesh.y_desc(panel.name()).x_desc("seconds");
        if counts {
            mesh.y_labels(ymax as usize + 1).y_label_formatter(&integer_label);
        } else {
            mesh.y_label_formatter(&short_label);
        }
        mesh.draw()?;
        for (i, e) in self.events.iter().enumerate() {
            let color = if is_loss(e) { RGBColor(220, 0, 0) } else { RGBColor(150, 150, 150) };
            chart.draw_series(DashedLineSeries::new(
                [(e.at_secs, 0.0), (e.at_secs, ymax)],
                4,
                4,
                ShapeStyle::from(&color).stroke_width(if is_loss(e) { 2 } else { 1 }),
            ))?;
            if counts {
                // Staggered, so labels of close events do not overlap.
                let y = ymax * (0.95 - 0.12 * (i % 3) as f64);
                let style = ("sans-serif", 12).into_font().color(&color);
                chart.draw_series(std::iter::once(Text::new(event_label(e), (e.at_secs, y), style)))?;
            }
        }
        match &panel.quantity {
            Quantity::Workers => self.draw_counts(&mut chart, panel),
            Quantity::Throughput | Quantity::Goodput => self.draw_smoothed(&mut chart, panel),
            _ => {
                for seg in segments(self.values(panel), self.gap) {
                    chart
                        .draw_series(LineSeries::new(seg, ShapeStyle::from(&panel.color).stroke_width(2)))?;
                }
                Ok(())
            }
        }
    }

    /// A count of each step as a staircase over time.
    fn staircase(&self, count: impl Fn(&crate::coordinator::StepRecord) -> Option<u32>) -> Vec<(f64, f64)> {
        let mut v = Vec::new();
        for (i, s) in self.steps.iter().enumerate() {
            let Some(n) = count(s) else { continue };
            v.push((s.secs, n as f64));
            let next = self.steps.get(i + 1).map_or(self.t_end, |n| n.secs);
            v.push((next, n as f64));
        }
        v
    }

    /// The workers as a staircase, and the teacher pool's size and the
    /// parameter servers beside them.
    fn draw_counts<'c>(&self, chart: &mut TimeChart<'c, 'c>, panel: &Panel) -> Result<(), DrawError> {
        let v = self.staircase(|s| Some(s.world));
        let line = chart.draw_series(LineSeries::new(v, ShapeStyle::from(&panel.color).stroke_width(2)))?;
        let servers = self.staircase(|s| s.ps_servers);
        if self.teachers.is_empty() && servers.is_empty() {
            return Ok(());
        }
        line.label("workers").legend(legend_line(panel.color, 16));
        for (name, pts, color) in [
            ("teachers", &self.teachers, RGBColor(230, 120, 0)),
            ("parameter servers", &servers, RGBColor(0, 150, 90)),
        ] {
            if !pts.is_empty() {
                chart
                    .draw_series(LineSeries::new(pts.clone(), ShapeStyle::from(&color).stroke_width(2)))?
                    .label(name)
                    .legend(legend_line(color, 16));
            }
        }
        chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()
    }

    /// The raw values faint, and their mean over a window (a fiftieth of
    /// the run, at least 5 steps) bold; both with gaps where no step committed.
    fn draw_smoothed(&self, chart: &mut TimeChart<'_, '_>, panel: &Panel) -> Result<(), DrawError> {
        let k = (self.steps.len() / 50).max(5);
        for seg in segments(self.values(panel), self.gap) {
            let faint = ShapeStyle::from(&panel.color.mix(0.25)).stroke_width(1);
            chart.draw_series(LineSeries::new(seg.clone(), faint))?;
            chart.draw_series(LineSeries::new(
                smoothed(&seg, k),
                ShapeStyle::from(&panel.color).stroke_width(2),
            ))?;
        }
        Ok(())
    }

    /// `panel`'s finite values over time.
    fn values(&self, panel: &Panel) -> Vec<(f64, f64)> {
        self.steps.iter().filter_map(|s| Some((s.secs, panel.pick(s)?))).collect()
    }

    /// The top of `panel`'s value axis: above its largest finite value.
    fn top_of(&self, panel: &Panel) -> f64 {
        let floor = match panel.quantity {
            Quantity::Workers => {
                let servers = self.steps.iter().filter_map(|s| s.ps_servers).max().unwrap_or(0) as f64;
                self.teachers.iter().map(|p| p.1).fold(servers, f64::max)
            }
            _ => 0.0,
        };
        let max = self.steps.iter().filter_map(|s| panel.pick(s)).fold(floor, f64::max).max(1e-6);
        if panel.quantity == Quantity::Workers { max + 1.0 } else { max * 1.1 }
    }
}

/// A line of a chart of curves: its name and its points.
pub type Curve = (String, Vec<(f64, f64)>);

/// Draws `curves` to `path` (SVG): a line for each, in its own colour and
/// named in the legend, on axes named `x` and `y`; `mark` draws a dashed
/// level across (a target), named.
pub fn curves(
    path: &Path,
    title: &str,
    (x, y): (&str, &str),
    curves: &[Curve],
    mark: Option<(f64, &str)>,
) -> Result<(), PlotError> {
    let root = titled_canvas(path, (960, 560), title)?;
    draw_curves(&root, (x, y), curves, mark).map_err(failed(path))?;
    root.present().map_err(failed(path))
}

fn draw_curves(
    area: &Area<'_>,
    (x, y): (&str, &str),
    curves: &[Curve],
    mark: Option<(f64, &str)>,
) -> Result<(), DrawError> {
    let points =
        || curves.iter().flat_map(|c| c.1.iter().copied()).filter(|p| p.0.is_finite() && p.1.is_finite());
    let span = |lo: f64, hi: f64| if hi > lo { lo..hi } else { lo..lo + 1.0 };
    let (x0, x1) = points().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let ys = points().map(|p| p.1).chain(mark.map(|m| m.0));
    let (y0, y1) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)));
    let (x0, x1) = if x0.is_finite() { (x0.min(0.0), x1) } else { (0.0, 1.0) };
    let (y0, y1) = if y0.is_finite() { (y0, y1 + (y1 - y0).abs() * 0.05) } else { (0.0, 1.0) };
    let mut chart = ChartBuilder::on(area)
        .margin(12)
        .x_label_area_size(32)
        .y_label_area_size(64)
        .build_cartesian_2d(span(x0, x1), span(y0, y1))?;
    chart.configure_mesh().x_desc(x).y_desc(y).draw()?;
    if let Some((level, name)) = mark {
        let dashes =
            DashedLineSeries::new([(x0, level), (x1, level)], 6, 4, ShapeStyle::from(&BLACK).stroke_width(1));
        chart.draw_series(dashes)?.label(name).legend(legend_line(BLACK, 18));
    }
    // Dark enough to read on white, apart enough to tell apart.
    const COLORS: [RGBColor; 10] = [
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(255, 127, 14),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(0, 0, 0),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
    ];
    for (i, (name, line)) in curves.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let style = ShapeStyle::from(&color).stroke_width(2);
        chart
            .draw_series(LineSeries::new(
                line.iter().copied().filter(|p| p.0.is_finite() && p.1.is_finite()),
                style,
            ))?
            .label(name.as_str())
            .legend(legend_line(color, 18));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_plugin_sdk::Action;

    fn decision(step: u64, world_size: u32, chosen: u32) -> Decision {
        Decision { step, world_size, chosen, throughput: 1.0, capacity: 8, actions: vec![Action::Hold] }
    }

    #[test]
    fn curves_are_drawn_each_named_with_the_level_marked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.svg");
        let lines =
            [("fixed 512".to_string(), vec![(0.1, 0.5), (0.9, 0.93)]), ("goodput".into(), vec![(0.2, 0.6)])];
        curves(&path, "time to 92%", ("seconds", "test accuracy"), &lines, Some((0.92, "target"))).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        for text in ["time to 92%", "fixed 512", "goodput", "target", "seconds", "test accuracy"] {
            assert!(svg.contains(text), "{text}");
        }
        // Nothing to draw still makes a picture, not an error.
        curves(&path, "empty", ("x", "y"), &[], None).unwrap();
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
            batch: 64,
            lr: 0.05,
            noise_scale: None,
            grad_var: None,
            grad_sqr: None,
            efficiency: None,
            goodput: None,
            metrics: Default::default(),
            ps_servers: None,
        };
        let dir = tempfile::tempdir().unwrap();
        let (with, without) = (dir.path().join("with.svg"), dir.path().join("without.svg"));
        let steps = [step(0.5), step(9.0)];
        training_run(&with, "t", &steps, &[], &[event(2.0, 1, 2)]).unwrap();
        training_run(&without, "t", &steps, &[], &[]).unwrap();
        assert!(std::fs::read_to_string(&with).unwrap().contains("teachers"));
        assert!(!std::fs::read_to_string(&without).unwrap().contains("teachers"));
        // The parameter servers, where the job had them.
        let served = [step(0.5), crate::coordinator::StepRecord { ps_servers: Some(3), ..step(4.0) }];
        let served =
            [crate::coordinator::StepRecord { ps_servers: Some(2), ..served[0].clone() }, served[1].clone()];
        training_run(&with, "t", &served, &[], &[]).unwrap();
        assert!(std::fs::read_to_string(&with).unwrap().contains("parameter servers"));
        assert!(!std::fs::read_to_string(&without).unwrap().contains("parameter servers"));
    }

    #[test]
    fn a_stall_is_a_gap_each_resize_is_labelled_and_each_quantity_has_its_own_axis() {
        let step = |secs: f64, world: u32, accuracy: f64| crate::coordinator::StepRecord {
            step: 0,
            epoch: 0,
            world,
            secs,
            loss: 1.0 / (1.0 + secs),
            samples_per_sec: 58_000.0 + 1000.0 * (secs * 7.0).sin(),
            cursor: 0,
            batch: 64,
            lr: 0.05,
            noise_scale: None,
            grad_var: None,
            grad_sqr: None,
            efficiency: None,
            goodput: None,
            metrics: [("accuracy".to_string(), accuracy)].into(),
            ps_servers: None,
        };
        // Twenty steps, 30 s without a committed one, twenty more.
        let mut steps: Vec<_> = (0..20).map(|i| step(i as f64 * 0.1, 2, 0.5)).collect();
        steps.extend((0..20).map(|i| step(32.0 + i as f64 * 0.1, 1, 0.6)));
        let event = |at_secs: f64, from: u32, to: u32, reason: &str| crate::leader::record::ScaleEvent {
            step: 0,
            from,
            to,
            pause_ms: 40.0,
            reason: reason.into(),
            generation: 1,
            setup_ms: 1.0,
            join_ms: None,
            at_secs,
            recovery: None,
        };
        let events = [event(0.5, 1, 2, "policy: add 1 worker"), event(32.0, 2, 1, "worker 2 lost")];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.svg");
        training_run(&path, "t", &steps, &events, &[]).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        // The loss in two pieces: no line across the stall.
        assert_eq!(svg.matches("stroke=\"#008200\"").count(), 2, "{svg}");
        // Each resize labelled with its cause; the lost worker's line red.
        let texts: Vec<&str> =
            svg.split("</text>").filter_map(|t| Some(t.rsplit_once('>')?.1.trim())).collect();
        assert!(
            texts.contains(&"1→2 policy: add 1 worker") && texts.contains(&"2→1 worker 2 lost"),
            "{texts:?}"
        );
        assert!(svg.contains("stroke=\"#DC0000\""), "{svg}");
        // The program's accuracy on an axis of its own, not the loss's.
        assert!(texts.contains(&"accuracy") && texts.contains(&"loss"), "{texts:?}");
        // The throughput faint and smoothed, in two pieces each; its ticks short.
        assert_eq!(svg.matches("stroke=\"#FF0000\"").count(), 4, "{svg}");
        assert!(texts.iter().any(|t| t.ends_with('k')), "{texts:?}");
        assert!(!texts.iter().any(|t| t.len() >= 5 && t.chars().all(|c| c.is_ascii_digit())), "{texts:?}");
        // The workers' axis labels each whole number once.
        assert!(!texts.contains(&"1.5"), "{texts:?}");
    }

    #[test]
    fn a_torchrun_job_is_drawn_over_time_with_its_groups_sizes_and_ends() {
        let group = |group: u32, world: u32, from: f64, to: f64, ended: &str| crate::torchrun::GroupRecord {
            group,
            world,
            hosts: Vec::new(),
            restart_count: group,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            log_dir: "/tmp".into(),
            started_secs: from,
            ended_secs: to,
            ended: ended.into(),
            taken_over: false,
        };
        let groups = [
            group(0, 2, 0.0, 5.0, "resized to 3"),
            group(1, 3, 5.5, 9.0, "rank 1 failed (exit status 1)"),
            group(2, 3, 9.4, 12.0, "succeeded"),
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("torchrun.svg");
        torchrun_run(&path, "t", &groups).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        let texts: Vec<&str> =
            svg.split("</text>").filter_map(|t| Some(t.rsplit_once('>')?.1.trim())).collect();
        assert!(texts.contains(&"seconds") && texts.contains(&"ranks"), "{texts:?}");
        assert!(
            !texts.contains(&"samples/s") && !texts.contains(&"step"),
            "no throughput nor steps it cannot know"
        );
        assert!(
            texts.contains(&"group 0: resized to 3") && texts.contains(&"group 2: succeeded"),
            "{texts:?}"
        );
        assert!(svg.contains("stroke=\"#DC0000\""), "the failure in red");
        // Each whole number of ranks labelled once.
        for n in ["1", "2", "3"] {
            assert_eq!(texts.iter().filter(|t| **t == n).count(), 1, "{n}: {texts:?}");
        }
    }

    #[test]
    fn count_axes_label_whole_numbers_once_and_large_ones_short() {
        assert_eq!(integer_label(&2.0), "2");
        assert_eq!(integer_label(&2.5), "");
        assert_eq!(short_label(&58_000.0), "58k");
        assert_eq!(short_label(&1_500_000.0), "1.5M");
        assert_eq!(short_label(&0.25), "0.25");
        let pts = [(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)];
        assert_eq!(smoothed(&pts, 3), [(0.0, 2.0), (1.0, 3.0), (2.0, 4.0)]);
        assert_eq!(segments(vec![(0.0, 1.0), (0.5, 1.0), (9.0, 1.0)], 2.0).len(), 2);
    }

    #[test]
    fn the_staircase_starts_at_step_0_with_the_initial_size() {
        let d = [decision(20, 1, 3), decision(40, 3, 2)];
        let pts = size_steps(&d, |d| d.chosen, |d| d.world_size);
        assert_eq!(pts, vec![(0.0, 1.0), (20.0, 1.0), (20.0, 3.0), (40.0, 3.0), (40.0, 2.0), (40.0, 2.0)]);
        assert!(size_steps(&[], |d| d.chosen, |d| d.world_size).is_empty());
    }
}
