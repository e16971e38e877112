//! `report`: draws FDO stats files as per-partition load charts, one panel per (stack, run), so
//! that runs (for example before and after `--balance`) can be compared side by side.
//!
//! What a stats file holds (docs/stats.md) decides what can be drawn: per stack,
//! `max_ids_per_partition` and `max_unique_ids_per_partition` have one value per (local device,
//! global partition), the largest count any of that device's SparseCores sent to the partition
//! in any recorded batch, and `required_buffer_size_per_sc` one value per local SparseCore. The
//! limits are not in the stats but in the config they were measured with: given `--config`, the
//! panels also draw each stack's `max_ids_per_partition` and `max_unique_ids_per_partition`
//! limits and its COO buffer per SparseCore, as the pipeline plans them (`Plan`).
//!
//! The charts are drawn with plotters' SVG backend. `.svg` writes the picture; `.html` a page
//! with the picture inline and tables of the numbers. Everything is read and checked before
//! anything is written, and the file is written atomically: a failed run writes nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use sparsecore_prep::fdo::{write_atomic, FdoStats, LayoutKey};
use sparsecore_prep::spec::Stacking;
use sparsecore_prep::{Config, Error, Plan, Result, StackStats};

use super::error::{self, CliError};
use super::outdir::clean_stale;
use super::stdio::outln;

#[derive(clap::Args)]
pub struct Args {
    /// A stats JSON file (`preprocess`'s stats.json, `stats --out`, `fdo merge`). Repeat it to
    /// draw runs side by side, in the order given.
    #[arg(long = "stats", value_name = "FILE")]
    stats: Vec<PathBuf>,
    /// A name for each --stats, in the same order (default: the file stem, or parent/stem when
    /// two stems are the same).
    #[arg(long = "label", value_name = "NAME")]
    labels: Vec<String>,
    /// The config the stats were measured with: the panels then draw its limits and its COO
    /// buffer per SparseCore (the stats do not hold them).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Local samples per feature in a batch, to plan the config's stacks. Only auto stacking
    /// needs it (it groups tables by their activation size, which depends on the batch size).
    #[arg(long, value_name = "B")]
    batch_size: Option<usize>,
    /// report.svg (the picture) or report.html (the picture and tables of the numbers).
    #[arg(long)]
    out: PathBuf,
}

/// What to write, by the extension of --out.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Svg,
    Html,
}

impl Format {
    fn of(path: &Path) -> error::Result<Format> {
        let ext = path
            .extension()
            .map(|e| e.to_string_lossy().to_ascii_lowercase())
            .unwrap_or_default();
        match ext.as_str() {
            "svg" => Ok(Format::Svg),
            "html" | "htm" => Ok(Format::Html),
            other => Err(CliError::Argument {
                flag: "--out",
                value: path.display().to_string(),
                reason: format!("unknown extension {other:?}; expected .svg or .html"),
            }),
        }
    }
}

/// One stats file and its name in the picture.
struct Run {
    label: String,
    path: PathBuf,
    stats: FdoStats,
}

/// A stack's limits and buffer as the config plans them.
#[derive(Clone, Copy)]
struct Limits {
    max_ids: u64,
    max_unique: u64,
    /// COO buffer elements per local SparseCore (the plan's buffer per device / S).
    buffer_per_sc: u64,
}

pub fn run(a: Args) -> error::Result<()> {
    let format = Format::of(&a.out)?;
    if a.stats.is_empty() {
        return Err(CliError::MissingArgument {
            command: "report",
            choices: "at least one --stats FILE to draw",
        });
    }
    if !a.labels.is_empty() && a.labels.len() != a.stats.len() {
        return Err(CliError::Argument {
            flag: "--label",
            value: a.labels.join(", "),
            reason: format!(
                "{} --label for {} --stats; give one per stats file, in the same order, or none",
                a.labels.len(),
                a.stats.len()
            ),
        });
    }
    let labels = if a.labels.is_empty() {
        default_labels(&a.stats)
    } else {
        a.labels.clone()
    };
    let mut runs = Vec::with_capacity(a.stats.len());
    for (path, label) in a.stats.iter().zip(labels) {
        let stats = FdoStats::from_path(path)?;
        check_shapes(&stats, path)?;
        runs.push(Run {
            label,
            path: path.clone(),
            stats,
        });
    }
    let stacks: Vec<String> = runs
        .iter()
        .flat_map(|r| r.stats.stacks.keys().cloned())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if stacks.is_empty() {
        return Err(CliError::Argument {
            flag: "--stats",
            value: a.stats[0].display().to_string(),
            reason: "no stack in any of the stats files; nothing to draw".into(),
        });
    }
    let limits = match &a.config {
        Some(path) => Some(config_limits(path, a.batch_size, &runs, &stacks)?),
        None => None,
    };
    let svg = draw(&runs, &stacks, limits.as_ref())?;
    let bytes = match format {
        Format::Svg => svg,
        Format::Html => html(&runs, &stacks, limits.as_ref(), &svg, a.config.as_deref()),
    };
    clean_stale(&a.out, false);
    write_atomic(&a.out, bytes.as_bytes())?;
    outln!(
        "drew {} x {} (stacks x runs) to {}{}",
        count(stacks.len(), "stack"),
        count(runs.len(), "run"),
        a.out.display(),
        if limits.is_some() {
            " with the config's limits"
        } else {
            ""
        }
    );
    Ok(())
}

/// `1 stack`, `3 runs`.
fn count(n: usize, word: &str) -> String {
    format!("{n} {word}{}", if n == 1 { "" } else { "s" })
}

/// File stems; where two are the same (every `preprocess` run writes `stats.json`), each run is
/// named `parent/stem` instead.
fn default_labels(paths: &[PathBuf]) -> Vec<String> {
    let stem = |p: &Path| {
        p.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| p.display().to_string())
    };
    let stems: Vec<String> = paths.iter().map(|p| stem(p)).collect();
    let unique = stems.iter().collect::<BTreeSet<_>>().len() == stems.len();
    if unique {
        return stems;
    }
    paths
        .iter()
        .zip(stems)
        .map(|(p, s)| match p.parent().and_then(|d| d.file_name()) {
            Some(dir) => format!("{}/{s}", dir.to_string_lossy()),
            None => s,
        })
        .collect()
}

/// The arrays must have the lengths the layout gives them (L·N per partition, L·S per
/// SparseCore), or the cells would be drawn under the wrong partitions.
fn check_shapes(stats: &FdoStats, path: &Path) -> error::Result<()> {
    let l = stats.layout;
    let partitions = l.local_device_count * l.global_device_count * l.num_sc_per_device;
    let scs = l.local_device_count * l.num_sc_per_device;
    for (name, st) in &stats.stacks {
        let arrays = [
            (
                "max_ids_per_partition",
                st.max_ids_per_partition.len(),
                partitions,
                "L·G·S",
            ),
            (
                "max_unique_ids_per_partition",
                st.max_unique_ids_per_partition.len(),
                partitions,
                "L·G·S",
            ),
            (
                "required_buffer_size_per_sc",
                st.required_buffer_size_per_sc.len(),
                scs,
                "L·S",
            ),
        ];
        for (field, got, want, formula) in arrays {
            if got != want {
                return Err(CliError::Stack {
                    stack: name.clone(),
                    reason: format!("stats {}: {field} has {got} values but layout {l} needs {formula} = {want}", path.display()),
                });
            }
        }
    }
    Ok(())
}

/// Plans the config and takes each drawn stack's limits and buffer from the plan. The config's
/// layout must be the stats' layout, and every stack in the stats a stack of the plan.
fn config_limits(
    path: &Path,
    batch_size: Option<usize>,
    runs: &[Run],
    stacks: &[String],
) -> error::Result<BTreeMap<String, Limits>> {
    let config = Config::from_path(path)?;
    let o = &config.config;
    let batch = match (batch_size, o.stacking) {
        (Some(b), _) => {
            let slices = o.local_device_count * o.num_sc_per_device;
            if b == 0 || slices == 0 || !b.is_multiple_of(slices) {
                return Err(CliError::Argument {
                    flag: "--batch-size",
                    value: b.to_string(),
                    reason: format!("local samples per feature: a positive multiple of the {slices} local SparseCores"),
                });
            }
            b
        }
        (None, Stacking::Feature) => o.local_device_count.max(1) * o.num_sc_per_device.max(1),
        (None, Stacking::Auto) => {
            return Err(CliError::Argument {
                flag: "--config",
                value: path.display().to_string(),
                reason:
                    "uses auto stacking, whose stacks depend on the batch size: give --batch-size"
                        .into(),
            })
        }
    };
    // The layout first: a config of another layout may not even plan with these stats' sizes.
    let key = LayoutKey {
        local_device_count: o.local_device_count,
        global_device_count: o.global_device_count,
        num_sc_per_device: o.num_sc_per_device,
    };
    for r in runs {
        if r.stats.layout != key {
            return Err(CliError::Argument {
                flag: "--config",
                value: path.display().to_string(),
                reason: format!(
                    "its layout L/G/S is {key} but stats {} were measured on {}",
                    r.path.display(),
                    r.stats.layout
                ),
            });
        }
    }
    let plan =
        Plan::for_local_batches(&config, &vec![batch; config.features.len()]).map_err(|e| {
            e.context(format!(
                "planning config {} for batches of {batch} samples",
                path.display()
            ))
        })?;
    let mut limits = BTreeMap::new();
    for name in stacks {
        let Some(s) = plan.stack(name) else {
            let planned: Vec<&str> = plan.stacks.iter().map(|s| s.name.as_str()).collect();
            let run = runs
                .iter()
                .find(|r| r.stats.stacks.contains_key(name))
                .map(|r| r.path.display().to_string())
                .unwrap_or_default();
            return Err(CliError::Stack {
                stack: name.clone(),
                reason: format!(
                    "in stats {run} but not a stack of config {} (its stacks: {})",
                    path.display(),
                    planned.join(", ")
                ),
            });
        };
        limits.insert(
            name.clone(),
            Limits {
                max_ids: s.max_ids_per_partition as u64,
                max_unique: s.max_unique_ids_per_partition as u64,
                buffer_per_sc: s.coo_buffer_size_per_sc(&plan.layout) as u64,
            },
        );
    }
    Ok(limits)
}

// Picture geometry, in pixels.
const PANEL_W: u32 = 620;
const IDS_H: u32 = 300;
const BUF_H: u32 = 190;
const HEADER_H: u32 = 100;
/// Where the legend's limit column starts.
const LEGEND_LIMITS_X: i32 = 320;
/// Bars carry their value as text up to this many bars per chart; more would overlap.
const MAX_VALUE_LABELS: usize = 8;

// Colours: one per quantity, a darker shade of it for its limit.
const IDS: RGBColor = RGBColor(31, 119, 180);
const IDS_LIMIT: RGBColor = RGBColor(8, 48, 107);
const UNIQUE: RGBColor = RGBColor(255, 127, 14);
const UNIQUE_LIMIT: RGBColor = RGBColor(166, 54, 3);
const BUFFER: RGBColor = RGBColor(44, 160, 44);
const BUFFER_LIMIT: RGBColor = RGBColor(0, 90, 50);

/// A plotters error as ours: drawing into a string does no I/O, so this only reports a bug.
fn plot_err<E: std::error::Error + Send + Sync + 'static>(e: E) -> Error {
    Error::Io {
        context: "drawing the report".into(),
        source: std::io::Error::other(e.to_string()),
    }
}

/// The whole picture: a header (title and legend), then one row per stack and one column per
/// run. A stack's panels share their y scales so that runs compare by bar height.
fn draw(
    runs: &[Run],
    stacks: &[String],
    limits: Option<&BTreeMap<String, Limits>>,
) -> Result<String> {
    let width = PANEL_W * runs.len() as u32;
    let height = HEADER_H + (IDS_H + BUF_H) * stacks.len() as u32;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let (header, body) = root.split_vertically(HEADER_H);
        draw_header(&header, runs, limits.is_some())?;
        let panels = body.split_evenly((stacks.len(), runs.len()));
        for (i, stack) in stacks.iter().enumerate() {
            let (ids_max, buf_max) = y_ranges(runs, stack, limits.and_then(|l| l.get(stack)));
            for (j, r) in runs.iter().enumerate() {
                let area = &panels[i * runs.len() + j];
                match r.stats.stacks.get(stack) {
                    Some(st) => {
                        let lim = limits.and_then(|l| l.get(stack)).copied();
                        draw_panel(area, stack, r, st, lim, ids_max, buf_max)?;
                    }
                    None => {
                        let style = ("sans-serif", 18).into_font().color(&BLACK);
                        let (w, h) = area.dim_in_pixel();
                        let text = format!("{stack} · {}: not in this run's stats", r.label);
                        area.draw(&Text::new(text, (w as i32 / 8, h as i32 / 2), style))
                            .map_err(plot_err)?;
                    }
                }
            }
        }
        root.present().map_err(plot_err)?;
    }
    Ok(svg)
}

/// The title (what is drawn, over how many batches) and one legend for every panel.
fn draw_header(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    runs: &[Run],
    with_limits: bool,
) -> Result<()> {
    let names: Vec<String> = runs
        .iter()
        .map(|r| {
            format!(
                "{} ({} batches, {})",
                r.label, r.stats.batches, r.stats.layout
            )
        })
        .collect();
    let title = format!("Per-partition load per stack: {}", names.join(" | "));
    area.draw(&Text::new(
        title,
        (10, 8),
        ("sans-serif", 22).into_font().color(&BLACK),
    ))
    .map_err(plot_err)?;
    // One row per quantity: its bar colour, then the line of its limit in the config.
    let rows = [
        (
            IDS,
            "max ids per partition",
            IDS_LIMIT,
            "max_ids_per_partition limit",
        ),
        (
            UNIQUE,
            "max unique ids per partition",
            UNIQUE_LIMIT,
            "max_unique_ids_per_partition limit",
        ),
        (
            BUFFER,
            "required COO buffer per SparseCore",
            BUFFER_LIMIT,
            "COO buffer per SparseCore",
        ),
    ];
    let font = ("sans-serif", 17).into_font().color(&BLACK);
    for (i, (bar, name, line, limit)) in rows.into_iter().enumerate() {
        let y = 44 + 20 * i as i32;
        area.draw(&Rectangle::new([(10, y - 6), (28, y + 6)], bar.filled()))
            .map_err(plot_err)?;
        area.draw(&Text::new(name, (34, y - 7), font.clone()))
            .map_err(plot_err)?;
        if with_limits {
            area.draw(&PathElement::new(
                vec![(LEGEND_LIMITS_X, y), (LEGEND_LIMITS_X + 18, y)],
                line.stroke_width(3),
            ))
            .map_err(plot_err)?;
            area.draw(&Text::new(
                limit,
                (LEGEND_LIMITS_X + 24, y - 7),
                font.clone(),
            ))
            .map_err(plot_err)?;
        } else if i == 0 {
            area.draw(&Text::new(
                "(no --config: limits not drawn)",
                (LEGEND_LIMITS_X, y - 7),
                font.clone(),
            ))
            .map_err(plot_err)?;
        }
    }
    Ok(())
}

/// The top of a stack's y axes over all runs (values and limits), with room above the bars.
fn y_ranges(runs: &[Run], stack: &str, limits: Option<&Limits>) -> (f64, f64) {
    let mut ids = limits.map_or(0, |l| l.max_ids.max(l.max_unique));
    let mut buf = limits.map_or(0, |l| l.buffer_per_sc);
    for st in runs.iter().filter_map(|r| r.stats.stacks.get(stack)) {
        ids = ids.max(st.max_ids().max(st.max_unique_ids()).max(0) as u64);
        buf = buf.max(
            st.required_buffer_size_per_sc
                .iter()
                .copied()
                .max()
                .unwrap_or(0)
                .max(0) as u64,
        );
    }
    (ids.max(1) as f64 * 1.12, buf.max(1) as f64 * 1.12)
}

/// Tick labels for cell `i` of `per_device` cells per local device: the index, or `device:index`
/// with more than one local device.
fn cell_label(v: f64, per_device: usize, devices: usize) -> String {
    let i = v.round();
    if (v - i).abs() > 1e-6 || i < 0.0 {
        return String::new();
    }
    let i = i as usize;
    if devices > 1 {
        format!("{}:{}", i / per_device.max(1), i % per_device.max(1))
    } else {
        i.to_string()
    }
}

/// One (stack, run) panel: ids per partition (two bars per cell) over the buffer per SparseCore.
fn draw_panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    stack: &str,
    run: &Run,
    st: &StackStats,
    limits: Option<Limits>,
    ids_max: f64,
    buf_max: f64,
) -> Result<()> {
    let layout = run.stats.layout;
    let devices = layout.local_device_count;
    let n = layout.global_device_count * layout.num_sc_per_device;
    let s = layout.num_sc_per_device;
    let (top, bottom) = area.split_vertically(IDS_H);

    let cells = st.max_ids_per_partition.len();
    let caption = format!(
        "{stack} · {}: peak {} ids, {} unique, {} dropped",
        run.label,
        st.max_ids(),
        st.max_unique_ids(),
        st.dropped_id_count
    );
    let x_desc = if devices > 1 {
        "local device:destination partition"
    } else {
        "destination partition"
    };
    let mut chart = axes(
        &top,
        Axes {
            caption,
            caption_size: 19,
            columns: cells,
            per: n,
            devices,
            x_desc,
            y_desc: "ids",
            y_labels: 6,
            y_max: ids_max,
        },
    )?;
    let bars = |values: &[i32], left: f64, colour: RGBColor| {
        values
            .iter()
            .enumerate()
            .map(move |(i, &v)| {
                Rectangle::new(
                    [
                        (i as f64 + left, 0.0),
                        (i as f64 + left + 0.4, v.max(0) as f64),
                    ],
                    colour.filled(),
                )
            })
            .collect::<Vec<_>>()
    };
    // Each bar's value just above it, centred at `centre` from the cell.
    let values = |values: &[i32], centre: f64| {
        let style = ("sans-serif", 14)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Center, VPos::Bottom));
        values
            .iter()
            .enumerate()
            .map(move |(i, &v)| {
                Text::new(
                    v.to_string(),
                    (i as f64 + centre, v.max(0) as f64),
                    style.clone(),
                )
            })
            .collect::<Vec<_>>()
    };
    chart
        .draw_series(bars(&st.max_ids_per_partition, -0.4, IDS))
        .map_err(plot_err)?;
    chart
        .draw_series(bars(&st.max_unique_ids_per_partition, 0.0, UNIQUE))
        .map_err(plot_err)?;
    if 2 * cells <= MAX_VALUE_LABELS {
        chart
            .draw_series(values(&st.max_ids_per_partition, -0.2))
            .map_err(plot_err)?;
        chart
            .draw_series(values(&st.max_unique_ids_per_partition, 0.2))
            .map_err(plot_err)?;
    }
    if let Some(l) = limits {
        limit_line(&mut chart, cells, l.max_ids as f64, IDS_LIMIT)?;
        limit_line(&mut chart, cells, l.max_unique as f64, UNIQUE_LIMIT)?;
    }

    let scs = st.required_buffer_size_per_sc.len();
    let peak = st
        .required_buffer_size_per_sc
        .iter()
        .copied()
        .max()
        .unwrap_or(0);
    let caption = match limits {
        Some(l) => format!(
            "COO buffer per local SparseCore: peak {peak} of {} slots",
            l.buffer_per_sc
        ),
        None => format!("COO buffer per local SparseCore: peak {peak} slots"),
    };
    let x_desc = if devices > 1 {
        "local device:SparseCore"
    } else {
        "SparseCore"
    };
    let mut chart = axes(
        &bottom,
        Axes {
            caption,
            caption_size: 17,
            columns: scs,
            per: s,
            devices,
            x_desc,
            y_desc: "slots",
            y_labels: 4,
            y_max: buf_max,
        },
    )?;
    chart
        .draw_series(bars(&st.required_buffer_size_per_sc, -0.2, BUFFER))
        .map_err(plot_err)?;
    if scs <= MAX_VALUE_LABELS {
        chart
            .draw_series(values(&st.required_buffer_size_per_sc, 0.0))
            .map_err(plot_err)?;
    }
    if let Some(l) = limits {
        limit_line(&mut chart, scs, l.buffer_per_sc as f64, BUFFER_LIMIT)?;
    }
    Ok(())
}

/// What one bar chart of a panel shows: `columns` bars labelled by [`cell_label`] with `per`
/// columns per local device.
struct Axes<'a> {
    caption: String,
    caption_size: u32,
    columns: usize,
    per: usize,
    devices: usize,
    x_desc: &'a str,
    y_desc: &'a str,
    y_labels: usize,
    y_max: f64,
}

type Chart<'a, 'b> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// A chart on `area` with its caption, axes and mesh drawn: columns centred on 0, 1, …
fn axes<'a, 'b>(
    area: &'a DrawingArea<SVGBackend<'b>, Shift>,
    a: Axes<'_>,
) -> Result<Chart<'a, 'b>> {
    let whole = |v: &f64| format!("{v:.0}");
    let label = |v: &f64| cell_label(*v, a.per, a.devices);
    let mut chart = ChartBuilder::on(area)
        .caption(a.caption, ("sans-serif", a.caption_size))
        .margin(8)
        .x_label_area_size(34)
        .y_label_area_size(74)
        .build_cartesian_2d(-0.5f64..(a.columns.max(1) as f64 - 0.5), 0f64..a.y_max)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(a.columns.clamp(1, 16))
        .x_label_formatter(&label)
        .x_desc(a.x_desc)
        .y_desc(a.y_desc)
        .y_labels(a.y_labels)
        .y_max_light_lines(1)
        .y_label_formatter(&whole)
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 15))
        .draw()
        .map_err(plot_err)?;
    Ok(chart)
}

/// A horizontal line at `value` across a chart of `columns` bars.
fn limit_line(
    chart: &mut Chart<'_, '_>,
    columns: usize,
    value: f64,
    colour: RGBColor,
) -> Result<()> {
    let (left, right) = (-0.5, columns.max(1) as f64 - 0.5);
    let line = PathElement::new(vec![(left, value), (right, value)], colour.stroke_width(2));
    chart.draw_series(std::iter::once(line)).map_err(plot_err)?;
    Ok(())
}

/// Escapes text for HTML.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            _ => out.push(c),
        }
    }
    out
}

/// A page with the picture inline and the numbers it draws: a summary per (stack, run) and the
/// arrays cell by cell.
fn html(
    runs: &[Run],
    stacks: &[String],
    limits: Option<&BTreeMap<String, Limits>>,
    svg: &str,
    config: Option<&Path>,
) -> String {
    let mut h = String::new();
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>sparsecore-prep report</title>\n<style>\n\
         body {{ font-family: sans-serif; }}\ntable {{ border-collapse: collapse; margin-bottom: 1em; }}\n\
         th, td {{ border: 1px solid #bbb; padding: 2px 6px; text-align: right; }}\nth:first-child, td:first-child {{ text-align: left; }}\n\
         </style>\n</head>\n<body>\n<h1>sparsecore-prep report</h1>\n<ul>\n"
    );
    for r in runs {
        let _ = writeln!(
            h,
            "<li><b>{}</b>: {} (layout L/G/S {}, {} batches)</li>",
            esc(&r.label),
            esc(&r.path.display().to_string()),
            r.stats.layout,
            r.stats.batches
        );
    }
    let _ = match config {
        Some(c) => writeln!(
            h,
            "</ul>\n<p>Limits and buffers from config {}.</p>",
            esc(&c.display().to_string())
        ),
        None => writeln!(
            h,
            "</ul>\n<p>No config given: limits and buffers are not known.</p>"
        ),
    };
    h.push_str(svg);
    h.push_str("\n<h2>Summary</h2>\n<table>\n<tr><th>stack</th><th>run</th><th>max ids per partition</th><th>limit</th>\
                <th>max unique ids per partition</th><th>limit</th><th>required buffer per SparseCore</th><th>buffer per SparseCore</th>\
                <th>dropped ids</th></tr>\n");
    let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
    for stack in stacks {
        let lim = limits.and_then(|l| l.get(stack));
        for r in runs {
            let Some(st) = r.stats.stacks.get(stack) else {
                continue;
            };
            let _ = writeln!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(stack),
                esc(&r.label),
                st.max_ids(),
                opt(lim.map(|l| l.max_ids)),
                st.max_unique_ids(),
                opt(lim.map(|l| l.max_unique)),
                st.required_buffer_size_per_sc.iter().copied().max().unwrap_or(0),
                opt(lim.map(|l| l.buffer_per_sc)),
                st.dropped_id_count
            );
        }
    }
    h.push_str("</table>\n<h2>Per cell</h2>\n");
    for stack in stacks {
        for r in runs {
            let Some(st) = r.stats.stacks.get(stack) else {
                continue;
            };
            let _ = writeln!(h, "<h3>{} · {}</h3>\n<table>", esc(stack), esc(&r.label));
            let cells = st
                .max_ids_per_partition
                .len()
                .max(st.required_buffer_size_per_sc.len());
            h.push_str("<tr><th>cell</th>");
            for i in 0..cells {
                let _ = write!(h, "<th>{i}</th>");
            }
            h.push_str("</tr>\n");
            for (name, values) in [
                ("max_ids_per_partition", &st.max_ids_per_partition),
                (
                    "max_unique_ids_per_partition",
                    &st.max_unique_ids_per_partition,
                ),
                (
                    "required_buffer_size_per_sc",
                    &st.required_buffer_size_per_sc,
                ),
            ] {
                let _ = write!(h, "<tr><td>{name}</td>");
                for i in 0..cells {
                    match values.get(i) {
                        Some(v) => {
                            let _ = write!(h, "<td>{v}</td>");
                        }
                        None => h.push_str("<td></td>"),
                    }
                }
                h.push_str("</tr>\n");
            }
            h.push_str("</table>\n");
        }
    }
    h.push_str("</body>\n</html>\n");
    h
}
