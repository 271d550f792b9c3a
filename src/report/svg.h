// The report's chart kinds as inline SVG strings (XML-clean: every attribute quoted, text escaped).
// Greyscale-safe by construction: series differ by dash pattern and marker as well as colour, stacked
// layers by lightness and hatching, heatmaps use a ramp whose lightness rises monotonically.
#pragma once

#include <string>
#include <vector>

namespace moe::report {

// Text escaped for XML character data and attribute values.
std::string xml_escape(const std::string& s);
// A number as a tick or table shows it: 3 significant digits, k / M / G beyond 10^4.
std::string short_number(double v);

struct Series {
  std::string label;
  std::vector<double> x, y;  // same length; NaN y values break the line
  int style = 0;             // index into the line styles (colour, dash, marker)
  bool points_only = false;  // markers without a line (e.g. validation losses)
};
struct HorizontalLine {
  std::string label;
  double y = 0;
};
struct LineChart {
  std::string id, kind;       // the <figure>'s id and data-chart
  std::string title, caption;  // caption: what is drawn and how it was measured
  std::string x_label, y_label;  // with units
  std::vector<Series> series;
  std::vector<HorizontalLine> hlines;
  bool y_from_zero = true;
};
std::string line_chart(const LineChart& c);

// Layers stacked bottom-up over a common x, plus lines drawn over them (not stacked).
struct StackedChart {
  std::string id, kind, title, caption, x_label, y_label;
  std::vector<double> x;
  std::vector<std::pair<std::string, std::vector<double>>> layers;  // (label, values per x)
  std::vector<Series> lines;
};
std::string stacked_chart(const StackedChart& c);

// rows x columns of values drawn as an image (one pixel per cell, scaled up without smoothing) with a
// colour scale from 0 to the largest value.
struct Heatmap {
  std::string id, kind, title, caption, x_label, y_label, value_label;
  std::vector<double> x;                    // per column (e.g. the step)
  std::vector<std::string> row_labels;      // per row, top to bottom
  std::vector<std::vector<double>> values;  // [row][column]
};
std::string heatmap(const Heatmap& h);

// Horizontal bars on rows (e.g. a rank's stream), x in ms.
struct TimelineBar {
  double start = 0, end = 0;
  bool communication = false;
  std::string name;
};
struct Timeline {
  std::string id, kind, title, caption, x_label;
  std::vector<std::string> row_labels;
  std::vector<std::vector<TimelineBar>> rows;
};
std::string timeline(const Timeline& t);

// A figure element for a chart that could not be drawn: says what is missing.
std::string missing_chart(const std::string& kind, const std::string& title, const std::string& why);

}  // namespace moe::report
