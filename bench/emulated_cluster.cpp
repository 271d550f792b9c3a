// The benchmarks' emulated cluster: see emulated_cluster.h.
#include "bench/emulated_cluster.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include <nlohmann/json.hpp>

#include "bench/report.h"

#include "util/shell.h"
#include "util/str_cat.h"

#ifndef MOE_SOURCE_DIR
#define MOE_SOURCE_DIR ""
#endif

namespace moe::bench {

namespace {
constexpr const char* kSubnet = "10.213.0";  // the fabric's /24; host i is .(i + 1)
}  // namespace

EmulatedCluster::EmulatedCluster(std::string name, const std::string& nic) : name_(std::move(name)) {
  if (geteuid() != 0) {
    why_ = "needs root (it builds an emulated cluster of network namespaces, scripts/cluster.sh); run it as root";
    return;
  }
  if (ShellResult c = run_shell(command("check")); c.exit_code != 0) {
    why_ = "no emulated cluster here: " + c.output;
    return;
  }
  run_shell(command("down"));  // a cluster of this name left by an interrupted run
  if (ShellResult u = run_shell(command(str_cat("up --nodes 2 --ranks-per-node 1 --subnet ", kSubnet, " --nic ", nic))); u.exit_code != 0) {
    run_shell(command("down"));
    why_ = "cluster up failed: " + u.output;
    return;
  }
  up_ = true;
}

EmulatedCluster::~EmulatedCluster() {
  if (up_) run_shell(command("down"));
}

bool EmulatedCluster::shape(const std::string& nic) const {
  const ShellResult r = run_shell(command("shape --nic " + nic));
  if (r.exit_code != 0)
    std::fprintf(stderr, "moe bench: cluster shape --nic %s failed: %s", nic.c_str(), r.output.c_str());
  return r.exit_code == 0;
}

std::string EmulatedCluster::command(const std::string& args) const {
  const char* env = std::getenv("MOE_CLUSTER_SCRIPT");
  const std::string script = env && *env ? env : str_cat(MOE_SOURCE_DIR, "/scripts/cluster.sh");
  return str_cat("bash ", script, " --name ", name_, " ", args);
}

std::string EmulatedCluster::fabric_netns_path() const { return str_cat("/run/netns/", name_, "-head"); }

std::string EmulatedCluster::host_address(int i) const { return str_cat(kSubnet, ".", i + 1); }

Status EmulatedCluster::measure_transfer_cpu(int rounds, TransferCpu* out) const {
  const ShellResult r = run_shell(command(str_cat("run --ranks-per-node 1 -- ", self_exe("moe"),
                                                  " bench transfer-cpu --json --repeats ", rounds)));
  const nlohmann::json doc = child_document(r.output);
  // tables[1] "result": rows ["cpu threads per transfer w (median)", w],
  // ["exchange beside / alone (median)", slowdown] and ["exchange alone GB/s each way (median)", GB/s]
  if (r.exit_code == 0 && doc.is_object() && doc.contains("tables") && doc["tables"].size() == 2) {
    const nlohmann::json& rows = doc["tables"][1]["rows"];
    auto figure = [&](size_t i) { return rows[i].size() == 2 && rows[i][1].is_number(); };
    if (rows.size() == 3 && figure(0) && figure(1) && figure(2)) {
      out->threads = rows[0][1].get<double>();
      out->slowdown = std::max(1.0, rows[1][1].get<double>());
      out->exchange_bytes_per_s = std::max(0.0, rows[2][1].get<double>()) * 1e9;
      return Status::ok();
    }
  }
  return Status::error(
      str_cat("bench transfer-cpu on the emulated cluster failed (exit ", r.exit_code, "): ", r.output));
}

}  // namespace moe::bench
