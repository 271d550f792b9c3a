// Fuzz target: the simulator's cluster file (sim/cluster.h: load_cluster_file, `moe sim --cluster
// FILE`). The input is the file. A spec that loads must build a Cluster, route between its devices,
// and round-trip through to_json.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fuzz/fuzz_util.h"
#include "sim/cluster.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using moe::fuzz::require;
  const auto path = moe::fuzz::scratch_dir() / "cluster.json";
  moe::fuzz::write_file(path, std::string_view(reinterpret_cast<const char*>(data), size));
  moe::sim::ClusterSpec spec;
  if (!moe::sim::load_cluster_file(path.string(), &spec)) return 0;

  moe::sim::ClusterSpec again;
  require(static_cast<bool>(moe::sim::ClusterSpec::from_json(spec.to_json(), &again)) && again == spec,
          "ClusterSpec round-trips through JSON");
  const moe::sim::Cluster cluster(spec);
  const int n = cluster.n_devices();
  std::vector<int> path_links;
  for (int a : {0, n / 2, n - 1}) {
    for (int b : {0, 1 % n, n - 1}) {
      cluster.route(a, b, &path_links);
      for (int link : path_links) require(link >= 0 && link < cluster.n_links(), "routes use existing links");
      (void)cluster.path_latency(path_links);
      (void)cluster.path_bandwidth(path_links);
    }
    if (!spec.node.nic_switch.empty()) (void)cluster.nic_of(a);
  }
  return 0;
}
