// The cluster presets of cluster.h: the testbeds of the four papers (Hecate, Parm, Lina, Pro-Prophet) and an
// H100 HGX node. Every figure names its source beside it. Where a source gives only a total over both
// directions or over several links, the comment says how the per-direction, per-link figure follows.
// Where a testbed's description leaves the layout open (which PCIe switch a NIC sits on, how many
// socket links join the CPUs), the comment says "assumed" and why; calibration against a real run
// (issue 4, item 6) is what replaces assumptions with fitted figures.
#include <functional>
#include <sstream>
#include <utility>

#include "sim/cluster.h"

namespace moe::sim {

namespace {

// ---- Links ----------------------------------------------------------------------------------------

// PCIe x16, per direction: transfer rate x 16 lanes x 128/130 (the line code of PCIe 3.0 and later)
// / 8 bits. Transfer rates from the PCI-SIG base specifications: 3.0: 8 GT/s, 4.0: 16 GT/s,
// 5.0: 32 GT/s; so 15.75, 31.51 and 63.02 GB/s. Protocol overhead (TLP headers, flow control) is
// left to calibration.
constexpr double pcie_x16(double gigatransfers) { return gigatransfers * 1e9 * 16 * 128.0 / 130.0 / 8; }
constexpr double kPcie3 = pcie_x16(8);
constexpr double kPcie4 = pcie_x16(16);
constexpr double kPcie5 = pcie_x16(32);

// Network ports are full duplex: a line rate of R Gb/s carries R/8 GB/s in each direction.
constexpr double gbps(double r) { return r * 1e9 / 8; }

// NVLink 2.0 (V100), 3.0 (A100) and 4.0 (H100): 25 GB/s per link per direction. The datasheets give
// the total over all links and both directions: V100 SXM2 300 GB/s over 6 links, A100 SXM4 600 GB/s
// over 12 links, H100 SXM5 900 GB/s over 18 links (link counts from the V100, A100 and H100
// architecture whitepapers); 300 / (6 x 2) = 600 / (12 x 2) = 900 / (18 x 2) = 25 GB/s.
constexpr double kNvlinkLink = 25e9;
// RTX 3090 NVLink bridge: "four x4 links ... 56.25 GB/s bandwidth in each direction, 112.5 GB/s total"
// (NVIDIA Ampere GA102 GPU Architecture whitepaper), so 14.0625 GB/s per x4 link per direction.
constexpr double kRtx3090NvlinkLink = 56.25e9 / 4;

// Intel UPI at 10.4 GT/s (Skylake-SP and Cascade Lake Xeon Scalable; Intel ARK lists "UPI speed
// 10.4 GT/s" for the Xeon Platinum 8175M, 8275CL and Gold 6230): 2 bytes per transfer, 20.8 GB/s per
// link per direction.
constexpr double kUpi10 = 10.4e9 * 2;
// Intel UPI 2.0 at 16 GT/s (Sapphire Rapids; Intel ARK, Xeon Platinum 8480+: 4 UPI links, 16 GT/s):
// 32 GB/s per link per direction.
constexpr double kUpi16 = 16e9 * 2;
// AMD EPYC 7002 (Rome) two-socket systems join the sockets with 4 x16 xGMI links (64 lanes of each
// socket; AMD EPYC 7002 platform documentation, ServeTheHome "Why AMD EPYC Rome 2P Will Have 128-160
// PCIe Gen4 Lanes"). Taken as four PCIe 4.0 x16 links (xGMI runs over the same SerDes; AMD quotes up
// to 18 GT/s for xGMI-2, so this is the lower figure).
constexpr double kXgmiRome = 4 * kPcie4;

// Latencies. NCCL models one latency per ring step by the kind of path the step crosses (NVIDIA/nccl
// src/graph/tuning.cc, commit b6475625, hwLat, Ring algorithm, Simple protocol): NVLink 3.4 us,
// PCIe 5.7 us, network 14.0 us. Our alpha is the sum of the latencies of the links a flow crosses, so
// each class's figure is split over the links of that class's paths, and every route's alpha equals
// NCCL's figure for it:
//   * NVLink: a direct link carries all 3.4 us; through an NVSwitch, 1.7 us on each of the two links.
//   * PCIe: 2.85 us on each endpoint link (a device's or a NIC's link to its switch), 0 on switch
//     uplinks and socket links: any device-to-device PCIe path has two endpoint links, 5.7 us.
//   * Network: device and NIC endpoint links on both sides (4 x 2.85 us) plus 1.3 us on each NIC port
//     link (the remaining 14.0 - 11.4 = 2.6 us over two ports): 14.0 us.
constexpr double kNvlinkDirectLatency = 3.4e-6;
constexpr double kNvswitchLinkLatency = 3.4e-6 / 2;
constexpr double kPcieEndpointLatency = 5.7e-6 / 2;
constexpr double kNicPortLatency = (14.0e-6 - 4 * kPcieEndpointLatency) / 2;

// ---- Devices --------------------------------------------------------------------------------------
// peak_flops: dense FP16 tensor throughput with FP32 accumulation (mixed-precision training
// accumulates in FP32; GeForce parts run FP32-accumulate tensor ops at half their FP16-accumulate rate,
// as their whitepapers state). mem_bandwidth: the datasheet's memory bandwidth.
//
// The efficiency curve and the launch overhead are ASSUMED, not measured, the same for every device
// and not tuned to any paper's figure: large ops reach 80% of peak (max_efficiency), an op reaches
// half of that when its ideal time at max_efficiency is 10 us (half_efficiency_flops = 10 us x peak x
// 0.8), and every op pays 5 us of launch overhead. Calibration fits all three per device.
constexpr double kMaxEfficiency = 0.8;
constexpr double kHalfEfficiencyTime = 10e-6;
constexpr double kLaunchOverhead = 5e-6;

DeviceSpec device(const char* name, double peak_flops, double mem_bandwidth) {
  DeviceSpec d;
  d.name = name;
  d.peak_flops = peak_flops;
  d.mem_bandwidth = mem_bandwidth;
  d.launch_overhead = kLaunchOverhead;
  d.max_efficiency = kMaxEfficiency;
  d.half_efficiency_flops = kHalfEfficiencyTime * peak_flops * kMaxEfficiency;
  return d;
}

// NVIDIA Tesla V100 datasheet (SXM2): Tensor Performance 125 TFLOPS, HBM2 900 GB/s.
DeviceSpec v100_sxm2_32gb() { return device("V100-SXM2-32GB", 125e12, 900e9); }
// NVIDIA A100 datasheet (40GB SXM): FP16 Tensor Core 312 TFLOPS (624 with sparsity), 1,555 GB/s.
DeviceSpec a100_sxm4_40gb() { return device("A100-SXM4-40GB", 312e12, 1555e9); }
// NVIDIA H100 datasheet (SXM): FP16 Tensor Core 1,979 TFLOPS with sparsity, so 989.5 dense; 3.35 TB/s.
DeviceSpec h100_sxm5_80gb() { return device("H100-SXM5-80GB", 1979e12 / 2, 3.35e12); }
// NVIDIA Ada GPU Architecture whitepaper, RTX 4090: Peak FP16 Tensor TFLOPS with FP32 Accumulate
// 165.2 (330.4 with sparsity); memory bandwidth 1008 GB/s.
DeviceSpec rtx4090() { return device("RTX-4090", 165.2e12, 1008e9); }
// NVIDIA Ampere GA102 GPU Architecture whitepaper, RTX 3090: Peak FP16 Tensor TFLOPS with FP32
// Accumulate 71 (142 with sparsity); memory bandwidth 936 GB/s.
DeviceSpec rtx3090() { return device("RTX-3090", 71e12, 936e9); }
// NVIDIA Turing GPU Architecture whitepaper, RTX 2080 Ti at reference clocks (Parm's cards run the
// reference 1350 MHz base clock): Peak FP16 Tensor TFLOPS with FP32 Accumulate 53.8; 616 GB/s.
DeviceSpec rtx2080ti() { return device("RTX-2080Ti", 53.8e12, 616e9); }

// ---- Nodes ----------------------------------------------------------------------------------------

LinkSpec endpoint(double bandwidth) { return {bandwidth, kPcieEndpointLatency}; }
LinkSpec internal(double bandwidth) { return {bandwidth, 0}; }
LinkSpec port(double bandwidth) { return {bandwidth, kNicPortLatency}; }

// AWS p3dn.24xlarge (AWS EC2 P3 instance page: 8 x V100 32 GB with NVLink, 100 Gbps networking,
// Intel Xeon Platinum 8175M). The GPU board is the DGX-1 (V100) design: the NVLink hybrid cube mesh
// and PCIe layout below are the `nvidia-smi topo -m` of a DGX-1 as NVIDIA's developer blog prints it
// (GPU pairs {0,1}, {2,3}, {4,5}, {6,7} on one PCIe switch each; GPUs 0-3 on CPU 0, 4-7 on CPU 1;
// NV1/NV2 = one or two NVLinks between a pair).
ClusterSpec p3dn() {
  ClusterSpec c;
  c.name = "p3dn.24xlarge";
  NodeSpec& n = c.node;
  n.devices = 8;
  n.device = v100_sxm2_32gb();
  n.sockets = 2;
  n.socket_link = internal(2 * kUpi10);  // assumed: 2 of the 8175M's 3 UPI links join the sockets
  // Switches 0-3 hold the GPU pairs; "switch" 4 is the CPU 0 root port of the single NIC (assumed:
  // AWS does not publish where the NIC sits; NUMA node 0 is where the OS puts it).
  n.switch_socket = {0, 0, 1, 1, 0};
  n.switch_uplink = internal(kPcie3);  // Skylake-SP is PCIe 3.0
  n.device_switch = {0, 0, 1, 1, 2, 2, 3, 3};
  n.device_pcie = endpoint(kPcie3);  // V100 SXM2: PCIe 3.0 x16 (V100 datasheet)
  n.interconnect = Interconnect::nvlink;
  n.nvlink = {kNvlinkLink, kNvlinkDirectLatency};
  n.nvlink_links = {{0, 1, 1, 2, 2, 0, 0, 0}, {1, 0, 2, 1, 0, 2, 0, 0}, {1, 2, 0, 2, 0, 0, 1, 0},
                    {2, 1, 2, 0, 0, 0, 0, 1}, {2, 0, 0, 0, 0, 1, 1, 2}, {0, 2, 0, 0, 1, 0, 2, 1},
                    {0, 0, 1, 0, 1, 2, 0, 2}, {0, 0, 0, 1, 2, 1, 2, 0}};
  n.nic_switch = {4};
  n.nic_pcie = endpoint(kPcie3);
  n.nic_port = port(gbps(100));  // "100 Gbps" (AWS)
  return c;
}

// AWS p4d.24xlarge (AWS EC2 P4 instance page: 8 x A100 40 GB, 600 GB/s NVSwitch GPU interconnect,
// 400 Gbps EFA as 4 x 100 Gbps network cards, Intel Xeon Platinum 8275CL).
ClusterSpec p4d() {
  ClusterSpec c;
  c.name = "p4d.24xlarge";
  NodeSpec& n = c.node;
  n.devices = 8;
  n.device = a100_sxm4_40gb();
  n.sockets = 2;
  n.socket_link = internal(2 * kUpi10);  // assumed: 2 of the 8275CL's 3 UPI links join the sockets
  // Assumed, as AWS does not publish it: the HGX A100 8-GPU layout, four PCIe 4.0 switches, each with
  // two GPUs and one EFA card, two switches per CPU.
  n.switch_socket = {0, 0, 1, 1};
  n.switch_uplink = internal(kPcie3);  // Cascade Lake is PCIe 3.0
  n.device_switch = {0, 0, 1, 1, 2, 2, 3, 3};
  n.device_pcie = endpoint(kPcie4);  // A100: PCIe 4.0 x16 (A100 datasheet)
  n.interconnect = Interconnect::nvswitch;
  n.nvlink = {kNvlinkLink, kNvswitchLinkLatency};
  n.nvswitch_links = 12;  // every A100 NVLink goes to the NVSwitches: 12 x 25 = 300 GB/s per direction
  n.nic_switch = {0, 1, 2, 3};
  n.nic_pcie = endpoint(kPcie4);  // assumed PCIe 4.0 x16; the 100 Gb/s port is the bottleneck either way
  n.nic_port = port(gbps(100));
  return c;
}

// Parm's testbed A (parm.txt, Table II): one node, 8 x RTX 4090 on PCIe 4.0 x16, dual AMD EPYC 7402,
// no network. The RTX 4090 has no NVLink, and its driver does not allow peer-to-peer, so GPU-to-GPU
// traffic goes through the CPUs either way. Assumed: each GPU on its own CPU root port, 4 per socket.
ClusterSpec rtx4090x8() {
  ClusterSpec c;
  c.name = "rtx4090x8-pcie4";
  NodeSpec& n = c.node;
  n.devices = 8;
  n.device = rtx4090();
  n.sockets = 2;
  n.socket_link = internal(kXgmiRome);
  n.switch_socket = {0, 0, 0, 0, 1, 1, 1, 1};
  n.switch_uplink = internal(kPcie4);
  n.device_switch = {0, 1, 2, 3, 4, 5, 6, 7};
  n.device_pcie = endpoint(kPcie4);
  return c;
}

// Four GPUs, two per CPU socket, each on its own PCIe 3.0 x16 root port, and one 100 Gb/s NIC on a
// root port of CPU 0: Pro-Prophet's nodes ("Each CPU is connected to two GPUs through PCI-Express 3.0.
// 100Gb/s Infiniband is used for inter-node communication", pro-prophet.txt) and Parm's testbed B
// (4 x RTX 2080 Ti, PCIe 3.0 x16, Mellanox ConnectX-5 at 100 Gb/s, dual Xeon Gold 6230; parm.txt,
// Table II). Assumed: the NIC on CPU 0 and 2 UPI links between the sockets (neither paper says).
ClusterSpec four_gpu_pcie3_node(const char* name, DeviceSpec d) {
  ClusterSpec c;
  c.name = name;
  NodeSpec& n = c.node;
  n.devices = 4;
  n.device = std::move(d);
  n.sockets = 2;
  n.socket_link = internal(2 * kUpi10);
  n.switch_socket = {0, 0, 1, 1, 0};  // GPU root ports 0-3, the NIC's root port 4
  n.switch_uplink = internal(kPcie3);
  n.device_switch = {0, 1, 2, 3};
  n.device_pcie = endpoint(kPcie3);
  n.nic_switch = {4};
  n.nic_pcie = endpoint(kPcie3);  // ConnectX-5: PCIe 3.0 x16 on these PCIe 3.0 hosts
  n.nic_port = port(gbps(100));
  return c;
}

// Parm's testbed B and Pro-Prophet's LPWNV nodes.
ClusterSpec rtx2080tix4() { return four_gpu_pcie3_node("rtx2080tix4-100g", rtx2080ti()); }
// Pro-Prophet's HPWNV nodes (no NVLink).
ClusterSpec rtx3090x4() { return four_gpu_pcie3_node("rtx3090x4-100g", rtx3090()); }
// Pro-Prophet's HPNV nodes: "four GPUs are divided into two groups. Two GPUs within a group are
// connected by a NVLink connection" (an NVLink bridge, 4 x4 links). Assumed: the pairs are the two
// GPUs of a socket.
ClusterSpec rtx3090x4_nvlink() {
  ClusterSpec c = four_gpu_pcie3_node("rtx3090x4-nvlink-100g", rtx3090());
  c.node.interconnect = Interconnect::nvlink;
  c.node.nvlink = {kRtx3090NvlinkLink, kNvlinkDirectLatency};
  c.node.nvlink_links = {{0, 4, 0, 0}, {4, 0, 0, 0}, {0, 0, 0, 4}, {0, 0, 4, 0}};
  return c;
}

// Lina's testbed (lina.txt): "Each node has 4 Ampere A100 GPUs with 40GB memory and is equipped with
// 100Gbps InfiniBand". Assumed, as the paper does not say: an HGX A100 4-GPU board (SXM4), whose GPUs
// are fully connected by NVLink, 4 of each GPU's 12 links to each of the 3 others (100 GB/s per pair
// per direction); one CPU socket with each GPU and the NIC on its own PCIe 4.0 root port.
ClusterSpec a100x4() {
  ClusterSpec c;
  c.name = "a100x4-ib100";
  NodeSpec& n = c.node;
  n.devices = 4;
  n.device = a100_sxm4_40gb();
  n.sockets = 1;
  n.switch_socket = {0, 0, 0, 0, 0};
  n.switch_uplink = internal(kPcie4);
  n.device_switch = {0, 1, 2, 3};
  n.device_pcie = endpoint(kPcie4);
  n.interconnect = Interconnect::nvlink;
  n.nvlink = {kNvlinkLink, kNvlinkDirectLatency};
  n.nvlink_links = {{0, 4, 4, 4}, {4, 0, 4, 4}, {4, 4, 0, 4}, {4, 4, 4, 0}};
  n.nic_switch = {4};
  n.nic_pcie = endpoint(kPcie4);
  n.nic_port = port(gbps(100));
  return c;
}

// NVIDIA HGX H100 8-GPU as in the DGX H100 (NVIDIA DGX H100 datasheet: 8 x H100 SXM5 80 GB, 4th
// generation NVSwitch with 900 GB/s per GPU, 8 x single-port ConnectX-7 at 400 Gb/s for the compute
// fabric, dual Intel Xeon Platinum 8480C, PCIe 5.0). Assumed: GPU i and NIC i on one PCIe 5.0 switch,
// two GPUs and two NICs per switch, two switches per CPU, and all 4 UPI links joining the sockets.
ClusterSpec h100x8() {
  ClusterSpec c;
  c.name = "h100x8-hgx";
  NodeSpec& n = c.node;
  n.devices = 8;
  n.device = h100_sxm5_80gb();
  n.sockets = 2;
  n.socket_link = internal(4 * kUpi16);
  n.switch_socket = {0, 0, 1, 1};
  n.switch_uplink = internal(kPcie5);
  n.device_switch = {0, 0, 1, 1, 2, 2, 3, 3};
  n.device_pcie = endpoint(kPcie5);  // H100 SXM: PCIe 5.0 x16 (H100 datasheet)
  n.interconnect = Interconnect::nvswitch;
  n.nvlink = {kNvlinkLink, kNvswitchLinkLatency};
  n.nvswitch_links = 18;  // 18 x 25 = 450 GB/s per direction
  n.nic_switch = {0, 0, 1, 1, 2, 2, 3, 3};
  n.nic_pcie = endpoint(kPcie5);  // ConnectX-7: PCIe 5.0 x16
  n.nic_port = port(gbps(400));
  return c;
}

const std::vector<std::pair<std::string, std::function<ClusterSpec()>>>& registry() {
  static const std::vector<std::pair<std::string, std::function<ClusterSpec()>>> presets = {
      {"p3dn.24xlarge", p3dn},           {"p4d.24xlarge", p4d},         {"rtx4090x8-pcie4", rtx4090x8},
      {"rtx2080tix4-100g", rtx2080tix4}, {"rtx3090x4-100g", rtx3090x4}, {"rtx3090x4-nvlink-100g", rtx3090x4_nvlink},
      {"a100x4-ib100", a100x4},          {"h100x8-hgx", h100x8},
  };
  return presets;
}

}  // namespace

const std::vector<std::string>& preset_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const auto& p : registry()) v.push_back(p.first);
    return v;
  }();
  return names;
}

Status preset_cluster(const std::string& name, int nodes, ClusterSpec* out) {
  for (const auto& [preset, make] : registry()) {
    if (preset != name) continue;
    ClusterSpec c = make();
    std::ostringstream m;
    if (nodes < 1) {
      m << "cluster: preset " << name << ": nodes (" << nodes << ") must be >= 1";
      return Status::error(m.str());
    }
    if (c.node.nic_switch.empty() && nodes != 1) {
      m << "cluster: preset " << name << " is a single node without a network; nodes (" << nodes << ") must be 1";
      return Status::error(m.str());
    }
    c.nodes = nodes;
    if (Status s = c.validate(); !s) return s;
    *out = std::move(c);
    return Status::ok();
  }
  std::string m = "cluster: unknown preset \"";
  m += name;
  m += "\" (known: ";
  for (size_t i = 0; i < preset_names().size(); ++i) {
    if (i > 0) m += ", ";
    m += preset_names()[i];
  }
  m += ")";
  return Status::error(m);
}

}  // namespace moe::sim
