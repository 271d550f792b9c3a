// Start here for src/sim: the modeled cluster the simulator runs on. A ClusterSpec describes it
// (nodes x devices, the PCIe tree with host bridges, NVLink or NVSwitch, NICs, the inter-node fabric,
// the device's compute figures); a Cluster turns the spec into an explicit graph of directed links and
// routes a flow from one device to another over it. network.h moves bytes over those links,
// collectives.h decomposes collectives into such flows, compute.h times ops on the devices.
//
// The model of one node (every node of a cluster is the same):
//   * Devices (GPUs) hang off PCIe switches; each switch sits under a CPU socket (host bridge); the
//     sockets are joined pairwise by a socket link (UPI, xGMI). A "switch" also stands for a CPU root
//     port with one device behind it, which is how a GPU plugged straight into the CPU is described.
//   * On top of PCIe, optionally: NVLink (a symmetric matrix of link counts between device pairs: a
//     full mesh, the DGX-1 hybrid cube mesh, NVLink bridges between pairs) or an NVSwitch (every device
//     has the same number of links to one non-blocking switch, which stands for all the node's
//     NVSwitch chips).
//   * NICs hang off PCIe switches too; each device sends through its nearest NIC (nic_of()).
// Nodes meet in a fabric: every NIC port goes to a leaf switch; with nodes_per_leaf = 0 there is one
// non-blocking switch, otherwise leaves of nodes_per_leaf nodes join a spine through one uplink per
// direction whose bandwidth is the leaf's NIC bandwidth divided by the oversubscription.
//
// Links are directed; a physical link is two links, one per direction, each with its own bandwidth
// (bytes/s) and latency (s). Ids are dense and deterministic (the same spec gives the same ids).
//
// Routing (route()) is fixed, deterministic and mirrors what NCCL uses: inside a node a direct NVLink
// if the pair has one, else the NVSwitch if there is one, else the PCIe tree (through the common
// switch, or up to the socket, across the socket link if needed, and down); between nodes, from the
// device over PCIe to its NIC, through the fabric, to the destination device's NIC and down to it
// (GPUDirect RDMA). Devices never forward traffic for others.
//
// Thread safety: a Cluster is immutable after construction; share it freely.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "sim/compute.h"
#include "util/status.h"

namespace moe::sim {

// One direction of a physical link.
struct LinkSpec {
  double bandwidth = 0;  // bytes/s, > 0
  double latency = 0;    // s, >= 0: what a flow crossing the link adds to its start latency (alpha)
  bool operator==(const LinkSpec&) const = default;
};

// What connects the devices of a node besides PCIe.
enum class Interconnect : uint8_t { pcie, nvlink, nvswitch };
const char* interconnect_name(Interconnect k);  // "pcie", "nvlink", "nvswitch"

struct NodeSpec {
  int devices = 1;  // devices per node, >= 1
  DeviceSpec device;
  // PCIe tree.
  int sockets = 1;                 // CPU sockets (host bridges), >= 1
  LinkSpec socket_link;            // between two sockets (used when sockets > 1)
  std::vector<int> switch_socket;  // PCIe switch k sits under socket switch_socket[k]
  LinkSpec switch_uplink;          // a switch and its socket
  std::vector<int> device_switch;  // device i hangs off switch device_switch[i] (size: devices)
  LinkSpec device_pcie;            // a device and its switch
  // NVLink / NVSwitch.
  Interconnect interconnect = Interconnect::pcie;
  LinkSpec nvlink;                             // one NVLink (nvlink, nvswitch)
  std::vector<std::vector<int>> nvlink_links;  // nvlink: links between devices i and j; symmetric, 0 diagonal
  int nvswitch_links = 0;                      // nvswitch: links from each device to the switch, >= 1
  // NICs (none: a single-node cluster).
  std::vector<int> nic_switch;  // NIC k hangs off switch nic_switch[k]
  LinkSpec nic_pcie;            // a NIC and its switch
  LinkSpec nic_port;            // a NIC's network port and its leaf switch (line rate)

  bool operator==(const NodeSpec&) const = default;
};

struct FabricSpec {
  int nodes_per_leaf = 0;       // 0: one non-blocking switch for all nodes
  double oversubscription = 1;  // >= 1: leaf uplink = nodes_per_leaf * NICs * nic_port.bandwidth / this
  double uplink_latency = 0;    // s, each leaf-spine link
  bool operator==(const FabricSpec&) const = default;
};

struct ClusterSpec {
  std::string name;  // preset name or what the file says
  int nodes = 1;     // >= 1; > 1 needs NICs
  NodeSpec node;
  FabricSpec fabric;
  // CPU ranks (a calibrated cluster of this machine): cpu_cores > 0 says every device is an MPI rank
  // running cpu_threads_per_device compute threads on a machine of cpu_cores cores (an emulated
  // cluster's hosts are namespaces of one machine). The executor then shares the cores among the
  // threads running at a time (processor sharing, executor.h). 0: the devices are accelerators with
  // their own compute (every preset). JSON keys present only when cpu_cores > 0.
  int cpu_cores = 0;               // >= 0
  int cpu_threads_per_device = 1;  // >= 1
  // With cpu_cores > 0 and several nodes: each node's ranks run on cpu_cores / nodes cores of their
  // own (`moe cluster up` pins every emulated host to an equal share of the machine's CPUs when it
  // has one per host), instead of all nodes sharing all of them. REQUIRES cpu_cores >= nodes.
  bool cpu_nodes_pinned = false;
  // With cpu_cores > 0: the compute threads' worth of a host's cores that one lane moving data between
  // hosts takes while it runs (the kernel's TCP and shaping work, executor.h). 1 unless measured
  // (bench cluster-strategies measures it on the emulated cluster: docs/sim.md). >= 0, finite.
  double cpu_threads_per_transfer = 1;
  // With cpu_cores > 0: how many times longer a transfer between hosts takes while a compute thread
  // runs beside it on its host's cores than alone (the lane waits to be scheduled; bench transfer-cpu
  // measures it). While compute runs in its pool such a lane moves at most the NIC's bandwidth over
  // this (executor.h). 1 unless measured. >= 1, finite.
  double cpu_transfer_slowdown = 1;
  // Messages between nodes of at most this many bytes go eagerly, as MPI's TCP transport sends them
  // into the receiver's socket buffers: an alltoallv's transfer between nodes then starts when its
  // sender reaches the collective, without waiting for the receiver (executor.h). 0: every transfer
  // waits for both its ends (NCCL's grouped send/recv; the presets). The emulated cluster sends up to
  // 1 MiB eagerly (docs/cluster.md). >= 0, finite; JSON key present only when > 0.
  double eager_bytes = 0;

  // Every figure and index, and their combinations. The message names the field as the JSON spells
  // it, e.g. "cluster: node.device_switch[3] (7) must be in [0, 4)".
  Status validate() const;
  // Every field under its JSON key; the fields of an unused interconnect are left out.
  nlohmann::json to_json() const;
  // Reads a spec written by to_json() (or by hand). Unknown keys, missing keys, values of the wrong
  // type and specs that fail validate() are errors naming the key; *out is unchanged on error.
  static Status from_json(const nlohmann::json& j, ClusterSpec* out);

  bool operator==(const ClusterSpec&) const = default;
};

// Reads a cluster file (from_json of its content). Errors name the file: unreadable, not JSON, or
// what from_json says.
Status load_cluster_file(const std::string& path, ClusterSpec* out);

// The presets (presets.cpp, every figure with its source), for `nodes` nodes. Errors: unknown name
// (the message lists the known ones), nodes < 1, or nodes > 1 for a preset without a network.
Status preset_cluster(const std::string& name, int nodes, ClusterSpec* out);
const std::vector<std::string>& preset_names();

enum class VertexKind : uint8_t { device, pcie_switch, socket, nvswitch, nic, leaf, spine };
enum class LinkKind : uint8_t { pcie, socket, nvlink, nic_port, fabric };
const char* link_kind_name(LinkKind k);  // "pcie", "socket", "nvlink", "nic_port", "fabric"

struct Vertex {
  VertexKind kind;
  int node;          // -1 for leaves and the spine
  std::string name;  // "n0.gpu3", "n0.pcie1", "n0.cpu0", "n0.nvswitch", "n0.nic2", "leaf1", "spine"
};

struct Link {
  int from = -1, to = -1;  // vertex ids
  LinkKind kind = LinkKind::pcie;
  double bandwidth = 0;  // bytes/s
  double latency = 0;    // s
};

class Cluster {
 public:
  // REQUIRES: spec.validate() is ok (std::logic_error otherwise; from_json and the presets validate).
  explicit Cluster(ClusterSpec spec);

  const ClusterSpec& spec() const { return spec_; }
  const DeviceSpec& device() const { return spec_.node.device; }  // every device is the same
  int n_nodes() const { return spec_.nodes; }
  int devices_per_node() const { return spec_.node.devices; }
  int n_devices() const { return spec_.nodes * spec_.node.devices; }
  // Device d is local device d % devices_per_node() of node d / devices_per_node().
  int node_of(int device) const;
  int local_index(int device) const;
  // The node-local index of the NIC device d sends and receives through: of the NICs nearest on the
  // PCIe tree (same switch, else same socket, else any), the j-th modulo their number, where j counts
  // the devices before d on d's switch; so two devices and two NICs on a switch pair up one to one.
  // REQUIRES: the node has NICs.
  int nic_of(int device) const;

  const std::vector<Vertex>& vertices() const { return vertices_; }
  const std::vector<Link>& links() const { return links_; }
  int n_links() const { return static_cast<int>(links_.size()); }
  std::string link_name(int link) const;  // "n0.gpu3->n0.nvswitch"

  // The directed links a flow from device a to device b crosses, in order (see the header comment).
  // Empty when a == b. REQUIRES: 0 <= a, b < n_devices() (std::logic_error).
  std::vector<int> route(int a, int b) const;
  // The same into *path (cleared first): reuses its storage, for callers routing many flows.
  void route(int a, int b, std::vector<int>* path) const;
  // Sum of the latencies / smallest bandwidth of the links of `path` (0 / +inf when empty).
  double path_latency(const std::vector<int>& path) const;
  double path_bandwidth(const std::vector<int>& path) const;

 private:
  // Node-local link ids (offsets from the node's first link), -1 where absent.
  struct NodeLinks {
    std::vector<int> dev_to_sw, sw_to_dev;    // by device
    std::vector<int> sw_to_cpu, cpu_to_sw;    // by switch
    std::vector<int> cpu_to_cpu;              // [s * sockets + t]
    std::vector<int> dev_to_dev;              // [i * devices + j]: the NVLink bundle from i to j
    std::vector<int> dev_to_nvs, nvs_to_dev;  // by device
    std::vector<int> nic_to_sw, sw_to_nic, nic_to_leaf, leaf_to_nic;  // by NIC
    int count = 0;                                                    // links per node
  };
  // Links from switch sa up and down to switch sb of node `node` (nothing when sa == sb).
  void pcie_path(int node, int sa, int sb, std::vector<int>* path) const;
  int global(int node, int local) const { return node * local_.count + local; }
  int leaf_of(int node) const;

  ClusterSpec spec_;
  std::vector<Vertex> vertices_;
  std::vector<Link> links_;
  NodeLinks local_;
  std::vector<int> nic_of_local_;  // by local device index
  int n_leaves_ = 1;
  int fabric_base_ = 0;  // id of leaf 0's uplink; leaf l: up = base + 2l, down = base + 2l + 1
};

}  // namespace moe::sim
