// `moe report`: one HTML page from metrics files (src/report/report.h).
#include <cstdio>

#include "cli/commands.h"
#include "report/report.h"

namespace moe::cli {

CLI::App* add_report_command(CLI::App& app, ReportFlags* f) {
  CLI::App* c = app.add_subcommand(
      "report", "draw one self-contained HTML page (inline SVG, opens offline) from moe train --metrics files; several "
                "files compare runs on one page (see src/report/README.md)");
  c->add_option("metrics", f->metrics, "moe train --metrics files (JSON lines), one per run")->required();
  c->add_option("--trace", f->trace, "moe train --trace file of the first run: draws its last traced step's timeline");
  c->add_option("--sim", f->sim, "moe sim --metrics file: its predicted step time against the first run's measured");
  c->add_option("--out", f->out, "the HTML file to write (replaced atomically)")->required();
  c->add_option("--title", f->title, "the page's title");
  return c;
}

int run_report(const ReportFlags& f) {
  auto fail = [](const std::string& message) {
    std::fprintf(stderr, "moe report: %s\n", message.c_str());
    return 1;
  };
  report::Page page;
  page.title = f.title;
  page.runs.resize(f.metrics.size());
  for (size_t i = 0; i < f.metrics.size(); ++i)
    if (Status s = report::read_run(f.metrics[i], &page.runs[i]); !s) return fail(s.message());
  report::Trace trace;
  if (!f.trace.empty()) {
    if (Status s = report::read_trace(f.trace, &trace); !s) return fail(s.message());
    page.trace = &trace;
  }
  report::Run sim;
  if (!f.sim.empty()) {
    if (Status s = report::read_run(f.sim, &sim); !s) return fail(s.message());
    page.simulated = &sim;
  }
  if (Status s = report::write_report(page, f.out); !s) return fail(s.message());
  std::printf("moe report: %s (%zu run%s)\n", f.out.c_str(), page.runs.size(), page.runs.size() == 1 ? "" : "s");
  return 0;
}

}  // namespace moe::cli
