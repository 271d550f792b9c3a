// Helpers every benchmark uses: see bench.h.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include <unistd.h>

#include <system_error>

#include "bench/bench.h"
#include "sim/simulate.h"
#include "bench/mpi_bench.h"
#include "comm/mpi_communicator.h"
#include "report/report.h"
#include "runtime/trainer.h"

namespace moe::bench {

std::string torch_peer_script() {
  if (const char* dir = std::getenv("MOE_BENCH_DIR")) return std::string(dir) + "/torch_moe_layer_peer.py";
  return std::string(MOE_SOURCE_DIR) + "/bench/torch_moe_layer_peer.py";
}

ScratchDir::ScratchDir(const std::string& prefix)
    : path_(std::filesystem::temp_directory_path() / (prefix + std::to_string(getpid()))) {
  std::filesystem::create_directories(path_);
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

Status simulated_graph_ms(sim::SimRunConfig cfg, const std::string& metrics, size_t first_step, double* ms) {
  cfg.load.kind = sim::LoadSpec::Kind::recorded;
  cfg.load.file = metrics;
  sim::SimRunResult res;
  if (Status s = sim::simulate(cfg, &res); !s) return s;
  std::vector<double> pred;
  for (size_t k = first_step; k < res.steps.size(); ++k)
    pred.push_back(res.steps[k].mean.compute_ms + res.steps[k].mean.exposed_comm_ms);
  if (pred.empty()) pred.push_back(res.steps[0].mean.compute_ms + res.steps[0].mean.exposed_comm_ms);
  *ms = median(pred);
  return Status::ok();
}

bool default_corpus_ready(const char* bench_name) {
  TextDataset data;
  std::string path;
  const Status s = open_training_data(TrainConfig{}, &data, &path);
  if (!s)
    std::fprintf(stderr, "moe bench %s: the default corpus (%s, Debian's python3-doc) cannot be read: %s\n",
                 bench_name, path.c_str(), s.message().c_str());
  return s.is_ok();
}

bool write_html_report(const std::string& path, const std::string& title, const std::vector<std::string>& metrics,
                       const std::vector<std::string>& labels) {
  report::Page page;
  page.title = title;
  for (size_t i = 0; i < metrics.size(); ++i) {
    report::Run run;
    if (Status s = report::read_run(metrics[i], &run); !s) {
      std::fprintf(stderr, "report: %s (left out of %s)\n", s.message().c_str(), path.c_str());
      continue;
    }
    if (i < labels.size()) run.label = labels[i];
    page.runs.push_back(std::move(run));
  }
  if (Status s = report::write_report(page, path); !s) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    return false;
  }
  std::fprintf(stderr, "report: %s (%zu runs)\n", path.c_str(), page.runs.size());
  return true;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

PairedRounds paired_rounds(const std::vector<double>& x, const std::vector<double>& ref) {
  if (x.size() != ref.size()) throw std::invalid_argument("paired_rounds: REQUIRES as many rounds as the reference");
  if (x.empty()) return {std::nan(""), std::nan(""), 0, std::nan("")};
  PairedRounds p{x[0] / ref[0], x[0] / ref[0], 0};
  std::vector<double> ratios;
  for (size_t i = 0; i < x.size(); ++i) {
    ratios.push_back(x[i] / ref[i]);
    p.lowest = std::min(p.lowest, ratios.back());
    p.highest = std::max(p.highest, ratios.back());
    p.below += x[i] < ref[i];
  }
  p.median = median(ratios);
  p.sign_p = sign_test_p(p.below, static_cast<int64_t>(x.size()));
  return p;
}

double sign_test_p(int64_t below, int64_t n) {
  // Sum over k = below..n of C(n, k) / 2^n, the binomial coefficients built up term by term in logs.
  double p = 0;
  for (int64_t k = below; k <= n; ++k)
    p += std::exp(std::lgamma(n + 1.0) - std::lgamma(k + 1.0) - std::lgamma(n - k + 1.0) - n * std::log(2.0));
  return std::min(1.0, p);
}

void check(const Status& st) {
  if (!st) comm::abort_job(st);
}

MpiJob start_mpi_job() {
  MpiJob job;
  check(comm::MpiSession::start(&job.session));
  check(job.session->world(&job.world));
  return job;
}

std::string mpi_library_version() {
  char lib[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(lib, &len);
  const std::string version(lib, static_cast<size_t>(len));
  return version.substr(0, version.find_first_of(",\n"));
}

double time_calls(MPI_Comm raw, int iters, const std::function<void()>& call) {
  MPI_Barrier(raw);
  double t0 = MPI_Wtime();
  for (int i = 0; i < iters; ++i) call();
  double t = (MPI_Wtime() - t0) / iters;
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, raw);
  return t;
}

}  // namespace moe::bench
