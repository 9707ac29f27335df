//! The report's SVG charts (plotters).

use super::*;
use minikv_core::{Error, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

pub(crate) fn plot(
    path: &Path,
    title: &str,
    pts: &[(f64, f64, String)],
    higher_better: bool,
    y_label: &str,
) -> Result<()> {
    let err = |e: String| Error::Input(format!("plot {}: {e}", path.display()));
    // Only points a chart can place; ranges padded without overflowing.
    let pts: Vec<&(f64, f64, String)> = pts
        .iter()
        .filter(|p| p.0.is_finite() && p.1.is_finite())
        .collect();
    let (x0, x1) = pts
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = pts
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let pad = |a: f64, b: f64| {
        let d = ((b / 2.0 - a / 2.0) * 0.2).max(1e-6);
        (a - d, b + d)
    };
    let ((x0, x1), (y0, y1)) = (pad(x0, x1), pad(y0, y1));
    if pts.is_empty()
        || ![x0, x1, y0, y1]
            .iter()
            .all(|v| v.is_finite() && v.abs() < 1e300)
    {
        eprintln!(
            "report: {} not drawn: its values are beyond what a chart can scale",
            path.display()
        );
        return Ok(());
    }
    let root = SVGBackend::new(path, (720, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("KV bytes / full fp16")
        .y_desc(y_label)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    chart
        .draw_series(
            pts.iter()
                .map(|p| Circle::new((p.0, p.1), 4, BLUE.filled())),
        )
        .map_err(|e| err(e.to_string()))?;
    chart
        .draw_series(
            pts.iter()
                .map(|p| Text::new(p.2.clone(), (p.0, p.1), ("sans-serif", 11))),
        )
        .map_err(|e| err(e.to_string()))?;
    let xy: Vec<(f64, f64)> = pts.iter().map(|p| (p.0, p.1)).collect();
    let mut front: Vec<(f64, f64)> = pareto(&xy, higher_better)
        .into_iter()
        .map(|i| xy[i])
        .collect();
    front.sort_by(|a, b| a.0.total_cmp(&b.0));
    chart
        .draw_series(LineSeries::new(front, RED.stroke_width(2)))
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// One line per series over the layers (per-layer budgets, per-layer errors).
pub(crate) fn line_plot(
    path: &Path,
    title: &str,
    y_label: &str,
    series: &[(String, Vec<f64>)],
) -> Result<()> {
    let err = |e: String| Error::Input(format!("plot {}: {e}", path.display()));
    let n = series.iter().map(|s| s.1.len()).max().unwrap_or(0).max(1);
    let y1 = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max)
        .max(1e-6)
        * 1.08;
    if !(y1.is_finite() && y1 < 1e300) {
        eprintln!(
            "report: {} not drawn: its values are beyond what a chart can scale",
            path.display()
        );
        return Ok(());
    }
    let root = SVGBackend::new(path, (820, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..(n - 1).max(1) as f64, 0f64..y1)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("layer")
        .y_desc(y_label)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, (name, ys)) in series.iter().enumerate() {
        let c = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                ys.iter().enumerate().map(|(l, &y)| (l as f64, y)),
                c.stroke_width(2),
            ))
            .map_err(|e| err(e.to_string()))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 11))
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// Element-wise mean of numeric arrays at `field` (a JSON pointer) over rows,
/// per label, in first-seen order.
pub(crate) fn per_layer_series(rows: &[&Value], field: &str) -> Vec<(String, Vec<f64>)> {
    let mut order: Vec<String> = Vec::new();
    let mut acc: BTreeMap<String, (Vec<f64>, usize)> = BTreeMap::new();
    for r in rows {
        let Some(a) = r.pointer(field).and_then(Value::as_array) else {
            continue;
        };
        let v: Vec<f64> = a.iter().filter_map(Value::as_f64).collect();
        if v.is_empty() || v.len() != a.len() {
            continue;
        }
        let name = row_label(r);
        let e = acc.entry(name.clone()).or_insert_with(|| {
            order.push(name);
            (vec![0.0; v.len()], 0)
        });
        if e.0.len() == v.len() {
            e.0.iter_mut().zip(&v).for_each(|(s, x)| *s += x);
            e.1 += 1;
        }
    }
    order
        .into_iter()
        .map(|n| {
            let (s, k) = &acc[&n];
            (n.clone(), s.iter().map(|x| x / *k as f64).collect())
        })
        .collect()
}
