// The emulated cluster the benchmarks run on (scripts/cluster.sh, docs/cluster.md): 2 hosts x 1 rank
// joined by NICs capped at a rate, built by the constructor and removed by the destructor, whatever
// happens in between. Needs root and network namespaces; without them up() is false and why() says why.
#pragma once

#include <algorithm>
#include <string>

#include "sim/cluster.h"
#include "util/status.h"

namespace moe::bench {

// Frame bytes per TCP payload byte at MTU 1500 (Ethernet + IP + TCP with timestamps: 1514 / 1448): what
// a capped emulated NIC's payload rate is below its line rate.
inline constexpr double kWireFactor = 1514.0 / 1448.0;

class EmulatedCluster {
 public:
  // name: the cluster's (cluster.sh --name); a cluster of that name left by an interrupted run is
  // removed first. nic: the cap, e.g. "1gbit".
  EmulatedCluster(std::string name, const std::string& nic);
  ~EmulatedCluster();
  EmulatedCluster(const EmulatedCluster&) = delete;
  EmulatedCluster& operator=(const EmulatedCluster&) = delete;

  bool up() const { return up_; }
  const std::string& why() const { return why_; }  // empty when up()
  // Re-caps every link of the running cluster; false (with the reason on stderr) when that failed.
  bool shape(const std::string& nic) const;
  // The shell command `cluster.sh --name <name> args` (e.g. args "run --" prefixes a job).
  std::string command(const std::string& args) const;
  // Where cluster.sh puts things (docs/cluster.md, "What up makes"): the fabric's network namespace,
  // where mpirun runs and from which every host is reachable, and host i's address on the fabric.
  std::string fabric_netns_path() const;
  std::string host_address(int i) const;
  // What `moe bench transfer-cpu` measures across the hosts (medians), for the simulator's cluster.
  struct TransferCpu {
    double threads = 1;   // compute threads' worth of a host's cores one transfer takes (w)
    double slowdown = 1;  // how many times longer a transfer takes beside a compute thread than alone
    double exchange_bytes_per_s = 0;  // what an exchange alone sent each way (0: not measured)
    // The NIC port carries at most what an exchange alone reached: at 10 Gbit/s the kernel's TCP work
    // on these cores, not the cap, bounds it (docs/sim.md).
    void apply(sim::ClusterSpec* spec) const {
      spec->cpu_threads_per_transfer = threads;
      spec->cpu_transfer_slowdown = slowdown;
      if (exchange_bytes_per_s > 0)
        spec->node.nic_port.bandwidth = std::min(spec->node.nic_port.bandwidth, exchange_bytes_per_s);
    }
  };
  // `moe bench transfer-cpu` across the hosts at the current cap (1 rank each, `rounds` rounds). An
  // error, saying why, when the job failed (*out kept).
  Status measure_transfer_cpu(int rounds, TransferCpu* out) const;

 private:
  std::string name_;
  bool up_ = false;
  std::string why_;
};

}  // namespace moe::bench
