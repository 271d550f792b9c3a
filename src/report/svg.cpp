// Inline SVG charts for the report (svg.h). Hand-written rather than a plotting library: the page must
// open offline with nothing but the file, and the charts here are few and simple.
#include "report/svg.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>

#include "util/str_cat.h"

namespace moe::report {
namespace {

constexpr double kWidth = 760;
constexpr double kLeft = 72, kRight = 16, kTop = 14, kPlotHeight = 230;
constexpr double kAxisBelow = 42;  // x tick labels and the x axis label under the plot

std::string num(double v) {  // coordinates: 1 decimal is finer than a screen pixel at this size
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}

// Okabe-Ito's colour-blind-safe colours, ordered so neighbours differ in lightness too; dash
// patterns and markers carry the distinction when printed in grey.
struct LineStyle {
  const char* colour;
  const char* dash;  // stroke-dasharray, "" for solid
  int marker;        // 0 circle, 1 square, 2 triangle, 3 diamond, 4 cross, 5 hollow circle
};
LineStyle line_style(int i) {
  static const char* colours[] = {"#000000", "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#7F7F7F"};
  static const char* dashes[] = {"", "7 3", "2 2", "9 3 2 3", "4 4", "12 3 2 3 2 3", "1 3"};
  i = std::max(i, 0);
  return {colours[i % 8], dashes[i % 7], i % 6};
}

std::string marker(int shape, double x, double y, const char* colour) {
  const std::string X = num(x), Y = num(y);
  switch (shape) {
    case 0: return str_cat("<circle cx=\"", X, "\" cy=\"", Y, "\" r=\"3.5\" fill=\"", colour, "\"/>");
    case 1: return str_cat("<rect x=\"", num(x - 3.2), "\" y=\"", num(y - 3.2), "\" width=\"6.4\" height=\"6.4\" fill=\"", colour, "\"/>");
    case 2:
      return str_cat("<path d=\"M", num(x), " ", num(y - 4.2), "L", num(x + 4), " ", num(y + 3), "L", num(x - 4), " ",
                     num(y + 3), "Z\" fill=\"", colour, "\"/>");
    case 3:
      return str_cat("<path d=\"M", num(x), " ", num(y - 4.5), "L", num(x + 4), " ", num(y), "L", num(x), " ",
                     num(y + 4.5), "L", num(x - 4), " ", num(y), "Z\" fill=\"", colour, "\"/>");
    case 4:
      return str_cat("<path d=\"M", num(x - 3.5), " ", num(y - 3.5), "L", num(x + 3.5), " ", num(y + 3.5), "M", num(x - 3.5),
                     " ", num(y + 3.5), "L", num(x + 3.5), " ", num(y - 3.5), "\" stroke=\"", colour,
                     "\" stroke-width=\"2\" fill=\"none\"/>");
    default:
      return str_cat("<circle cx=\"", X, "\" cy=\"", Y, "\" r=\"3.5\" fill=\"#ffffff\" stroke=\"", colour,
                     "\" stroke-width=\"1.6\"/>");
  }
}

// Points drawn alone (validation losses): a large ring with a white centre, which stands out on top of
// the same run's dense line in colour and in grey.
std::string ring(double x, double y, const char* colour) {
  return str_cat("<circle cx=\"", num(x), "\" cy=\"", num(y), "\" r=\"5\" fill=\"#ffffff\" stroke=\"", colour,
                 "\" stroke-width=\"2.2\"/>");
}

// Tick positions: 1, 2 or 5 times a power of ten, about `target` of them over [lo, hi].
std::vector<double> nice_ticks(double lo, double hi, int target = 5) {
  if (!(hi > lo)) return {lo};
  const double raw = (hi - lo) / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  std::vector<double> t;
  for (double v = std::ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) t.push_back(std::abs(v) < step * 1e-9 ? 0 : v);
  return t;
}

// A range with some air above (and below unless it starts at zero); a flat series gets a visible band.
void pad_range(double* lo, double* hi, bool from_zero) {
  if (!std::isfinite(*lo) || !std::isfinite(*hi)) *lo = 0, *hi = 1;
  if (from_zero) *lo = std::min(*lo, 0.0);
  if (*hi - *lo < 1e-12) {
    const double d = *hi != 0 ? std::abs(*hi) * 0.1 : 1;  // all zero (nothing dropped): 0..1
    *hi += d;
    if (!from_zero || *lo - d >= 0) *lo -= d;
  }
  const double span = *hi - *lo;
  *hi += 0.05 * span;
  if (!from_zero || *lo < 0) *lo -= 0.05 * span;
}

struct Frame {
  double x0, x1, y0, y1;         // data range
  double left, top, width, height;  // plot area in pixels
  double px(double x) const { return left + (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5) * width; }
  double py(double y) const { return top + height - (y1 > y0 ? (y - y0) / (y1 - y0) : 0.5) * height; }
};

// Grid, ticks, tick labels and axis labels of a frame.
std::string axes(const Frame& f, const std::string& x_label, const std::string& y_label, bool x_ticks = true) {
  std::string s;
  for (double t : nice_ticks(f.y0, f.y1)) {
    const double y = f.py(t);
    if (y < f.top - 0.5 || y > f.top + f.height + 0.5) continue;
    s += str_cat("<line x1=\"", num(f.left), "\" y1=\"", num(y), "\" x2=\"", num(f.left + f.width), "\" y2=\"", num(y),
                 "\" class=\"grid\"/>");
    s += str_cat("<text x=\"", num(f.left - 6), "\" y=\"", num(y + 4), "\" text-anchor=\"end\">", xml_escape(short_number(t)),
                 "</text>");
  }
  if (x_ticks)
    for (double t : nice_ticks(f.x0, f.x1, 8)) {
      const double x = f.px(t);
      if (x < f.left - 0.5 || x > f.left + f.width + 0.5) continue;
      s += str_cat("<line x1=\"", num(x), "\" y1=\"", num(f.top + f.height), "\" x2=\"", num(x), "\" y2=\"",
                   num(f.top + f.height + 4), "\" class=\"axis\"/>");
      s += str_cat("<text x=\"", num(x), "\" y=\"", num(f.top + f.height + 16), "\" text-anchor=\"middle\">",
                   xml_escape(short_number(t)), "</text>");
    }
  s += str_cat("<rect x=\"", num(f.left), "\" y=\"", num(f.top), "\" width=\"", num(f.width), "\" height=\"", num(f.height),
               "\" class=\"frame\"/>");
  s += str_cat("<text x=\"", num(f.left + f.width / 2), "\" y=\"", num(f.top + f.height + 34),
               "\" text-anchor=\"middle\" class=\"label\">", xml_escape(x_label), "</text>");
  s += str_cat("<text transform=\"translate(14 ", num(f.top + f.height / 2), ") rotate(-90)\" text-anchor=\"middle\" class=\"label\">",
               xml_escape(y_label), "</text>");
  return s;
}

// Legend entries laid out in rows under the plot; `swatch(i, x, y)` draws entry i's sample.
template <typename Swatch>
std::string legend(const std::vector<std::string>& labels, double top, Swatch swatch, double* height) {
  std::string s;
  double x = kLeft, y = top + 12;
  for (size_t i = 0; i < labels.size(); ++i) {
    const double w = 44 + 7.2 * static_cast<double>(labels[i].size()) + 18;
    if (x + w > kWidth - kRight && x > kLeft) x = kLeft, y += 18;
    s += swatch(i, x, y);
    s += str_cat("<text x=\"", num(x + 40), "\" y=\"", num(y + 4), "\">", xml_escape(labels[i]), "</text>");
    x += w;
  }
  *height = labels.empty() ? 0 : y - top + 12;
  return s;
}

std::string line_swatch(const LineStyle& st, bool points_only, double x, double y) {
  std::string s;
  if (!points_only)
    s += str_cat("<line x1=\"", num(x), "\" y1=\"", num(y), "\" x2=\"", num(x + 32), "\" y2=\"", num(y), "\" stroke=\"",
                 st.colour, "\" stroke-width=\"2\"", *st.dash ? str_cat(" stroke-dasharray=\"", st.dash, "\"") : "", "/>");
  return s + (points_only ? ring(x + 16, y, st.colour) : marker(st.marker, x + 16, y, st.colour));
}

std::string figure(const std::string& id, const std::string& kind, const std::string& title, const std::string& caption,
                   double height, const std::string& body) {
  return str_cat("<figure id=\"", xml_escape(id), "\" data-chart=\"", xml_escape(kind), "\">\n<figcaption><b>",
                 xml_escape(title), "</b>", caption.empty() ? std::string() : str_cat(" ", xml_escape(caption)),
                 "</figcaption>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"", num(kWidth), "\" height=\"",
                 num(height), "\" viewBox=\"0 0 ", num(kWidth), " ", num(height), "\" role=\"img\" aria-label=\"",
                 xml_escape(title), "\">", body, "</svg>\n</figure>\n");
}

// At most `most` points per series: bins of consecutive points averaged (NaN-aware), so a long run's
// page stays small; a chart 700 pixels wide shows no more anyway.
void thin(std::vector<double>* x, std::vector<double>* y, size_t most = 1000) {
  if (x->size() <= most) return;
  const size_t n = x->size(), bins = most;
  std::vector<double> bx, by;
  for (size_t b = 0; b < bins; ++b) {
    const size_t i0 = b * n / bins, i1 = (b + 1) * n / bins;
    double sx = 0, sy = 0;
    size_t cy = 0;
    for (size_t i = i0; i < i1; ++i) {
      sx += (*x)[i];
      if (std::isfinite((*y)[i])) sy += (*y)[i], ++cy;
    }
    bx.push_back(sx / static_cast<double>(i1 - i0));
    by.push_back(cy ? sy / static_cast<double>(cy) : std::numeric_limits<double>::quiet_NaN());
  }
  *x = std::move(bx);
  *y = std::move(by);
}

// --- a PNG for the heatmaps, uncompressed (stored deflate blocks): no zlib needed, and a heatmap of a
// few thousand cells is a few KB either way.
uint32_t crc32(const uint8_t* p, size_t n, uint32_t c = 0xffffffffu) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t v = i;
      for (int k = 0; k < 8; ++k) v = v & 1 ? 0xedb88320u ^ (v >> 1) : v >> 1;
      t[i] = v;
    }
    return t;
  }();
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c;
}

void put32(std::string* s, uint32_t v) {
  for (int k = 3; k >= 0; --k) s->push_back(static_cast<char>((v >> (8 * k)) & 0xff));
}

void chunk(std::string* png, const char* type, const std::string& data) {
  put32(png, static_cast<uint32_t>(data.size()));
  std::string body = std::string(type, 4) + data;
  png->append(body);
  put32(png, crc32(reinterpret_cast<const uint8_t*>(body.data()), body.size()) ^ 0xffffffffu);
}

std::string png_rgb(int width, int height, const std::vector<uint8_t>& rgb) {
  std::string raw;
  for (int y = 0; y < height; ++y) {
    raw.push_back(0);  // filter: none
    raw.append(reinterpret_cast<const char*>(rgb.data()) + static_cast<size_t>(y) * width * 3, static_cast<size_t>(width) * 3);
  }
  std::string z = "\x78\x01";
  for (size_t pos = 0; pos < raw.size() || pos == 0; pos += 65535) {
    const size_t n = std::min<size_t>(65535, raw.size() - pos);
    z.push_back(pos + n >= raw.size() ? 1 : 0);
    z.push_back(static_cast<char>(n & 0xff));
    z.push_back(static_cast<char>(n >> 8));
    z.push_back(static_cast<char>(~n & 0xff));
    z.push_back(static_cast<char>((~n >> 8) & 0xff));
    z.append(raw, pos, n);
    if (raw.empty()) break;
  }
  uint32_t a = 1, b = 0;
  for (unsigned char c : raw) a = (a + c) % 65521, b = (b + a) % 65521;
  put32(&z, (b << 16) | a);
  std::string png = "\x89PNG\r\n\x1a\n";
  std::string ihdr;
  put32(&ihdr, static_cast<uint32_t>(width));
  put32(&ihdr, static_cast<uint32_t>(height));
  ihdr += std::string("\x08\x02\x00\x00\x00", 5);  // 8 bits, RGB, deflate, no filter, no interlace
  chunk(&png, "IHDR", ihdr);
  chunk(&png, "IDAT", z);
  chunk(&png, "IEND", "");
  return png;
}

std::string base64(const std::string& in) {
  static const char* t = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    out += {t[v >> 18], t[(v >> 12) & 63], t[(v >> 6) & 63], t[v & 63]};
  }
  if (i + 1 == in.size()) {
    const uint32_t v = uint8_t(in[i]) << 16;
    out += {t[v >> 18], t[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == in.size()) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8);
    out += {t[v >> 18], t[(v >> 12) & 63], t[(v >> 6) & 63], '='};
  }
  return out;
}

// Viridis at 9 stops: perceptually uniform and its lightness rises monotonically, so a heatmap reads
// the same printed in grey.
const std::array<std::array<int, 3>, 9> kViridis{{{68, 1, 84},
                                                  {71, 45, 123},
                                                  {59, 82, 139},
                                                  {44, 114, 142},
                                                  {33, 145, 140},
                                                  {40, 174, 128},
                                                  {94, 201, 98},
                                                  {173, 220, 48},
                                                  {253, 231, 37}}};
std::array<int, 3> viridis(double t) {
  t = std::clamp(t, 0.0, 1.0) * 8;
  const int i = std::min(7, static_cast<int>(t));
  const double f = t - i;
  std::array<int, 3> c{};
  for (int k = 0; k < 3; ++k) c[k] = static_cast<int>(std::lround(kViridis[i][k] * (1 - f) + kViridis[i + 1][k] * f));
  return c;
}
std::string hex(const std::array<int, 3>& c) {
  char b[8];
  std::snprintf(b, sizeof b, "#%02x%02x%02x", c[0], c[1], c[2]);
  return b;
}

}  // namespace

std::string xml_escape(const std::string& s) {
  std::string o;
  o.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      case '\'': o += "&#39;"; break;
      default:
        // XML 1.0 forbids most control characters even escaped: drop them.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t') continue;
        o += c;
    }
  }
  return o;
}

std::string short_number(double v) {
  if (!std::isfinite(v)) return "–";
  const double a = std::abs(v);
  char b[32];
  if (a >= 1e10) std::snprintf(b, sizeof b, "%.3gG", v / 1e9);
  else if (a >= 1e7) std::snprintf(b, sizeof b, "%.3gM", v / 1e6);
  else if (a >= 1e4) std::snprintf(b, sizeof b, "%.3gk", v / 1e3);
  else if (a >= 1e3) std::snprintf(b, sizeof b, "%.0f", v);
  else std::snprintf(b, sizeof b, "%.3g", v);
  return b;
}

std::string line_chart(const LineChart& c) {
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  std::vector<Series> series = c.series;
  for (Series& s : series) {
    if (!s.points_only) thin(&s.x, &s.y);
    for (size_t i = 0; i < s.x.size(); ++i) {
      x0 = std::min(x0, s.x[i]), x1 = std::max(x1, s.x[i]);
      if (std::isfinite(s.y[i])) y0 = std::min(y0, s.y[i]), y1 = std::max(y1, s.y[i]);
    }
  }
  for (const HorizontalLine& h : c.hlines) y0 = std::min(y0, h.y), y1 = std::max(y1, h.y);
  if (!std::isfinite(x0)) x0 = 0, x1 = 1;
  if (x1 <= x0) x1 = x0 + 1;
  pad_range(&y0, &y1, c.y_from_zero);
  const Frame f{x0, x1, y0, y1, kLeft, kTop, kWidth - kLeft - kRight, kPlotHeight};
  std::string body = axes(f, c.x_label, c.y_label);
  for (size_t k = 0; k < c.hlines.size(); ++k) {
    const double y = f.py(c.hlines[k].y);
    body += str_cat("<line x1=\"", num(f.left), "\" y1=\"", num(y), "\" x2=\"", num(f.left + f.width), "\" y2=\"", num(y),
                    "\" stroke=\"#555555\" stroke-width=\"1.2\" stroke-dasharray=\"1 4\"/>");
    body += str_cat("<text x=\"", num(f.left + f.width - 4), "\" y=\"", num(y - 4), "\" text-anchor=\"end\" class=\"note\">",
                    xml_escape(c.hlines[k].label), "</text>");
  }
  for (size_t k = 0; k < series.size(); ++k) {
    const Series& s = series[k];
    const LineStyle st = line_style(s.style);
    if (!s.points_only) {
      std::string d;
      bool pen = false;
      for (size_t i = 0; i < s.x.size(); ++i) {
        if (!std::isfinite(s.y[i])) {
          pen = false;
          continue;
        }
        d += str_cat(pen ? "L" : "M", num(f.px(s.x[i])), " ", num(f.py(s.y[i])));
        pen = true;
      }
      body += str_cat("<path d=\"", d, "\" fill=\"none\" stroke=\"", st.colour, "\" stroke-width=\"1.8\"",
                      *st.dash ? str_cat(" stroke-dasharray=\"", st.dash, "\"") : "", " stroke-linejoin=\"round\"/>");
    }
    // Markers: every point of a sparse series; otherwise ~8 along the line, offset per series so
    // overlapping lines still show each one's marks.
    const size_t n = s.x.size();
    const size_t every = s.points_only || n <= 12 ? 1 : n / 8;
    const size_t offset = s.points_only || n <= 12 ? 0 : (k * every / std::max<size_t>(series.size(), 1)) % every;
    for (size_t i = offset; i < n; i += every)
      if (std::isfinite(s.y[i])) body += s.points_only ? ring(f.px(s.x[i]), f.py(s.y[i]), st.colour)
                                                       : marker(st.marker, f.px(s.x[i]), f.py(s.y[i]), st.colour);
  }
  std::vector<std::string> labels;
  for (const Series& s : series) labels.push_back(s.label);
  double lh = 0;
  body += legend(labels, kTop + kPlotHeight + kAxisBelow,
                 [&](size_t i, double x, double y) { return line_swatch(line_style(series[i].style), series[i].points_only, x, y); },
                 &lh);
  return figure(c.id, c.kind, c.title, c.caption, kTop + kPlotHeight + kAxisBelow + lh + 6, body);
}

std::string stacked_chart(const StackedChart& c) {
  // Layer fills differ in lightness (dark, hatched mid, light), so they separate in grey as well.
  static const char* fills[] = {"#1f3a68", "#e08a3c", "#c9ccd1", "#7fb3d5"};
  const std::string hatch_id = c.id + "-hatch";
  std::vector<double> top(c.x.size(), 0);
  double y1 = 0;
  for (const auto& [label, v] : c.layers)
    for (size_t i = 0; i < c.x.size(); ++i) top[i] += std::isfinite(v[i]) ? std::max(0.0, v[i]) : 0;
  for (double t : top) y1 = std::max(y1, t);
  for (const Series& s : c.lines)
    for (double y : s.y)
      if (std::isfinite(y)) y1 = std::max(y1, y);
  double y0 = 0;
  pad_range(&y0, &y1, true);
  double x0 = c.x.empty() ? 0 : c.x.front(), x1 = c.x.empty() ? 1 : c.x.back();
  if (x1 <= x0) x1 = x0 + 1;
  const Frame f{x0, x1, y0, y1, kLeft, kTop, kWidth - kLeft - kRight, kPlotHeight};
  std::string body = str_cat("<defs><pattern id=\"", xml_escape(hatch_id),
                             "\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" patternTransform=\"rotate(45)\">"
                             "<rect width=\"6\" height=\"6\" fill=\"",
                             fills[1], "\"/><line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#ffffff\" stroke-width=\"2\"/></pattern></defs>");
  body += axes(f, c.x_label, c.y_label);
  // Thinned columns: a long run's polygons keep at most ~700 vertices per edge.
  std::vector<size_t> idx;
  const size_t n = c.x.size(), step = std::max<size_t>(1, n / 700);
  for (size_t i = 0; i < n; i += step) idx.push_back(i);
  if (n && idx.back() != n - 1) idx.push_back(n - 1);
  std::vector<double> base(n, 0);
  for (size_t l = 0; l < c.layers.size(); ++l) {
    const std::vector<double>& v = c.layers[l].second;
    std::vector<double> upper(n);
    for (size_t i = 0; i < n; ++i) upper[i] = base[i] + (std::isfinite(v[i]) ? std::max(0.0, v[i]) : 0);
    std::string pts;
    for (size_t i : idx) pts += str_cat(num(f.px(c.x[i])), ",", num(f.py(upper[i])), " ");
    for (auto it = idx.rbegin(); it != idx.rend(); ++it) pts += str_cat(num(f.px(c.x[*it])), ",", num(f.py(base[*it])), " ");
    const std::string fill = l == 1 ? str_cat("url(#", xml_escape(hatch_id), ")") : fills[l % 4];
    body += str_cat("<polygon points=\"", pts, "\" fill=\"", fill, "\" stroke=\"none\"/>");
    base = std::move(upper);
  }
  for (size_t k = 0; k < c.lines.size(); ++k) {
    const Series& s = c.lines[k];
    std::vector<double> x = s.x, y = s.y;
    thin(&x, &y, 700);
    const LineStyle st = line_style(s.style);
    std::string d;
    bool pen = false;
    for (size_t i = 0; i < x.size(); ++i) {
      if (!std::isfinite(y[i])) {
        pen = false;
        continue;
      }
      d += str_cat(pen ? "L" : "M", num(f.px(x[i])), " ", num(f.py(y[i])));
      pen = true;
    }
    // A white halo under the line keeps it readable over the dark compute layer.
    body += str_cat("<path d=\"", d, "\" fill=\"none\" stroke=\"#ffffff\" stroke-width=\"4\" stroke-opacity=\"0.85\"/>");
    body += str_cat("<path d=\"", d, "\" fill=\"none\" stroke=\"", st.colour, "\" stroke-width=\"1.6\"",
                    *st.dash ? str_cat(" stroke-dasharray=\"", st.dash, "\"") : "", "/>");
    for (size_t i = k; i < x.size(); i += std::max<size_t>(1, x.size() / 8))
      if (std::isfinite(y[i])) body += marker(st.marker, f.px(x[i]), f.py(y[i]), st.colour);
  }
  std::vector<std::string> labels;
  for (const auto& [label, v] : c.layers) labels.push_back(label);
  for (const Series& s : c.lines) labels.push_back(s.label);
  double lh = 0;
  body += legend(labels, kTop + kPlotHeight + kAxisBelow,
                 [&](size_t i, double x, double y) {
                   if (i >= c.layers.size()) return line_swatch(line_style(c.lines[i - c.layers.size()].style), false, x, y);
                   const std::string fill = i == 1 ? str_cat("url(#", xml_escape(hatch_id), ")") : fills[i % 4];
                   return str_cat("<rect x=\"", num(x), "\" y=\"", num(y - 6), "\" width=\"32\" height=\"12\" fill=\"", fill,
                                  "\" stroke=\"#333333\" stroke-width=\"0.6\"/>");
                 },
                 &lh);
  return figure(c.id, c.kind, c.title, c.caption, kTop + kPlotHeight + kAxisBelow + lh + 6, body);
}

std::string heatmap(const Heatmap& h) {
  const size_t rows = h.values.size(), cols = h.x.size();
  double vmax = 0;
  for (const auto& r : h.values)
    for (double v : r)
      if (std::isfinite(v)) vmax = std::max(vmax, v);
  if (vmax <= 0) vmax = 1;
  // Tall enough for the colour scale's label even with 2 rows (ranks).
  const double cell = std::max(std::clamp(180.0 / std::max<size_t>(rows, 1), 6.0, 26.0), 110.0 / std::max<size_t>(rows, 1));
  const double plot_h = cell * static_cast<double>(rows);
  const double scale_w = 88;  // the colour scale on the right
  const double x_step = cols > 1 ? (h.x.back() - h.x.front()) / static_cast<double>(cols - 1) : 1;
  const Frame f{cols ? h.x.front() - x_step / 2 : 0, cols ? h.x.back() + x_step / 2 : 1, 0, static_cast<double>(rows),
                kLeft, kTop, kWidth - kLeft - kRight - scale_w, plot_h};
  std::string body;
  // Cells: one pixel each, stretched without smoothing (the image-rendering below).
  std::vector<uint8_t> rgb;
  rgb.reserve(rows * cols * 3);
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < cols; ++c) {
      const double v = c < h.values[r].size() ? h.values[r][c] : std::nan("");
      const std::array<int, 3> col = std::isfinite(v) ? viridis(v / vmax) : std::array<int, 3>{255, 255, 255};
      for (int k = 0; k < 3; ++k) rgb.push_back(static_cast<uint8_t>(col[k]));
    }
  if (rows && cols)
    body += str_cat("<image x=\"", num(f.left), "\" y=\"", num(f.top), "\" width=\"", num(f.width), "\" height=\"", num(plot_h),
                    "\" preserveAspectRatio=\"none\" style=\"image-rendering:pixelated;image-rendering:crisp-edges\" href=\"data:image/png;base64,",
                    base64(png_rgb(static_cast<int>(cols), static_cast<int>(rows), rgb)), "\"/>");
  // Row labels: every one when they fit, else every k-th.
  const size_t every = static_cast<size_t>(std::ceil(12.0 / cell));
  for (size_t r = 0; r < rows; r += every)
    body += str_cat("<text x=\"", num(f.left - 6), "\" y=\"", num(f.top + (r + 0.5) * cell + 4), "\" text-anchor=\"end\">",
                    xml_escape(h.row_labels[r]), "</text>");
  for (double t : nice_ticks(f.x0, f.x1, 8)) {
    const double x = f.px(t);
    if (x < f.left - 0.5 || x > f.left + f.width + 0.5) continue;
    body += str_cat("<line x1=\"", num(x), "\" y1=\"", num(f.top + plot_h), "\" x2=\"", num(x), "\" y2=\"", num(f.top + plot_h + 4),
                    "\" class=\"axis\"/><text x=\"", num(x), "\" y=\"", num(f.top + plot_h + 16), "\" text-anchor=\"middle\">",
                    xml_escape(short_number(t)), "</text>");
  }
  body += str_cat("<rect x=\"", num(f.left), "\" y=\"", num(f.top), "\" width=\"", num(f.width), "\" height=\"", num(plot_h),
                  "\" class=\"frame\"/>");
  body += str_cat("<text x=\"", num(f.left + f.width / 2), "\" y=\"", num(f.top + plot_h + 34), "\" text-anchor=\"middle\" class=\"label\">",
                  xml_escape(h.x_label), "</text>");
  body += str_cat("<text transform=\"translate(14 ", num(f.top + plot_h / 2), ") rotate(-90)\" text-anchor=\"middle\" class=\"label\">",
                  xml_escape(h.y_label), "</text>");
  // The colour scale: 0 at the bottom to the largest value at the top.
  const std::string grad = h.id + "-scale";
  const double sx = f.left + f.width + 14, sh = std::max(plot_h, 60.0);
  body += str_cat("<defs><linearGradient id=\"", xml_escape(grad), "\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">");
  for (size_t i = 0; i < kViridis.size(); ++i)
    body += str_cat("<stop offset=\"", num(100.0 * i / 8), "%\" stop-color=\"", hex(kViridis[i]), "\"/>");
  body += "</linearGradient></defs>";
  body += str_cat("<rect x=\"", num(sx), "\" y=\"", num(f.top), "\" width=\"12\" height=\"", num(sh), "\" fill=\"url(#",
                  xml_escape(grad), ")\" stroke=\"#333333\" stroke-width=\"0.6\"/>");
  for (double t : {0.0, vmax / 2, vmax})
    body += str_cat("<text x=\"", num(sx + 16), "\" y=\"", num(f.top + sh - t / vmax * sh + 4), "\">", xml_escape(short_number(t)),
                    "</text>");
  body += str_cat("<text transform=\"translate(", num(kWidth - 6), " ", num(f.top + sh / 2),
                  ") rotate(-90)\" text-anchor=\"middle\" class=\"label\">", xml_escape(h.value_label), "</text>");
  return figure(h.id, h.kind, h.title, h.caption, kTop + std::max(plot_h, sh) + kAxisBelow + 6, body);
}

std::string timeline(const Timeline& t) {
  const double row_h = 18;
  double x1 = 0;
  for (const auto& row : t.rows)
    for (const TimelineBar& b : row) x1 = std::max(x1, b.end);
  if (x1 <= 0) x1 = 1;
  const double left = 150;  // row labels ("rank 0 allreduce")
  const double plot_h = row_h * static_cast<double>(t.rows.size());
  const Frame f{0, x1 * 1.01, 0, 1, left, kTop, kWidth - left - kRight, plot_h};
  const std::string hatch_id = t.id + "-hatch";
  std::string body = str_cat("<defs><pattern id=\"", xml_escape(hatch_id),
                             "\" width=\"5\" height=\"5\" patternUnits=\"userSpaceOnUse\" patternTransform=\"rotate(45)\">"
                             "<rect width=\"5\" height=\"5\" fill=\"#e08a3c\"/><line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"5\" "
                             "stroke=\"#ffffff\" stroke-width=\"1.6\"/></pattern></defs>");
  for (size_t r = 0; r < t.rows.size(); ++r) {
    const double y = f.top + r * row_h;
    if (r % 2) body += str_cat("<rect x=\"", num(f.left), "\" y=\"", num(y), "\" width=\"", num(f.width), "\" height=\"", num(row_h),
                               "\" fill=\"#f3f3f3\"/>");
    body += str_cat("<text x=\"", num(f.left - 6), "\" y=\"", num(y + row_h / 2 + 4), "\" text-anchor=\"end\">",
                    xml_escape(t.row_labels[r]), "</text>");
    for (const TimelineBar& b : t.rows[r]) {
      const double x = f.px(b.start), w = std::max(0.6, f.px(b.end) - x);
      body += str_cat("<rect x=\"", num(x), "\" y=\"", num(y + 2), "\" width=\"", num(w), "\" height=\"", num(row_h - 4),
                      "\" fill=\"", b.communication ? str_cat("url(#", xml_escape(hatch_id), ")") : std::string("#1f3a68"),
                      "\"><title>", xml_escape(b.name), str_cat(" (", short_number(b.end - b.start), " ms)"), "</title></rect>");
    }
  }
  for (double tk : nice_ticks(f.x0, f.x1, 8)) {
    const double x = f.px(tk);
    if (x > f.left + f.width + 0.5) continue;
    body += str_cat("<line x1=\"", num(x), "\" y1=\"", num(f.top), "\" x2=\"", num(x), "\" y2=\"", num(f.top + plot_h + 4),
                    "\" class=\"grid\"/><text x=\"", num(x), "\" y=\"", num(f.top + plot_h + 16), "\" text-anchor=\"middle\">",
                    xml_escape(short_number(tk)), "</text>");
  }
  body += str_cat("<rect x=\"", num(f.left), "\" y=\"", num(f.top), "\" width=\"", num(f.width), "\" height=\"", num(plot_h),
                  "\" class=\"frame\"/>");
  body += str_cat("<text x=\"", num(f.left + f.width / 2), "\" y=\"", num(f.top + plot_h + 34), "\" text-anchor=\"middle\" class=\"label\">",
                  xml_escape(t.x_label), "</text>");
  double lh = 0;
  body += legend({"compute op", "communication op"}, kTop + plot_h + kAxisBelow,
                 [&](size_t i, double x, double y) {
                   return str_cat("<rect x=\"", num(x), "\" y=\"", num(y - 6), "\" width=\"32\" height=\"12\" fill=\"",
                                  i ? str_cat("url(#", xml_escape(hatch_id), ")") : std::string("#1f3a68"),
                                  "\" stroke=\"#333333\" stroke-width=\"0.6\"/>");
                 },
                 &lh);
  return figure(t.id, t.kind, t.title, t.caption, kTop + plot_h + kAxisBelow + lh + 6, body);
}

std::string missing_chart(const std::string& kind, const std::string& title, const std::string& why) {
  return str_cat("<p class=\"missing\" data-missing=\"", xml_escape(kind), "\"><b>", xml_escape(title), ":</b> not drawn: ",
                 xml_escape(why), "</p>\n");
}

}  // namespace moe::report
