// The simulator's topology and compute model (src/sim/cluster.h, compute.h): presets, routing, JSON
// cluster files and their errors, the roofline.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "sim/cluster.h"
#include "sim/compute.h"

namespace moe::sim {
namespace {

ClusterSpec preset(const std::string& name, int nodes) {
  ClusterSpec spec;
  const Status s = preset_cluster(name, nodes, &spec);
  EXPECT_TRUE(s) << s.message();
  return spec;
}

// The largest node count a preset allows among 1 and 2 (presets without a network are single nodes).
int nodes_for(const std::string& name) {
  ClusterSpec spec;
  return preset_cluster(name, 2, &spec) ? 2 : 1;
}

// "n1.gpu3", "n0.nic2": how a Cluster names a node's vertices.
std::string vertex(int node, const char* what, int index) {
  std::string s = "n";
  s += std::to_string(node);
  s += ".";
  s += what;
  s += std::to_string(index);
  return s;
}

const Vertex& from(const Cluster& c, int link) { return c.vertices()[c.links()[link].from]; }
const Vertex& to(const Cluster& c, int link) { return c.vertices()[c.links()[link].to]; }

// A path is connected: each link starts where the previous one ended, from device a to device b.
void expect_connected(const Cluster& c, const std::vector<int>& path, int a, int b) {
  ASSERT_FALSE(path.empty());
  const int dpn = c.devices_per_node();
  EXPECT_EQ(from(c, path.front()).name, vertex(a / dpn, "gpu", a % dpn));
  EXPECT_EQ(to(c, path.back()).name, vertex(b / dpn, "gpu", b % dpn));
  for (size_t i = 1; i < path.size(); ++i) EXPECT_EQ(c.links()[path[i - 1]].to, c.links()[path[i]].from);
  std::set<int> distinct(path.begin(), path.end());
  EXPECT_EQ(distinct.size(), path.size());
}

TEST(SimPresets, EveryPresetBuildsAndRoutesBetweenAllDevicePairs) {
  ASSERT_EQ(preset_names().size(), 8u);
  for (const std::string& name : preset_names()) {
    SCOPED_TRACE(name);
    const int nodes = nodes_for(name);
    const ClusterSpec spec = preset(name, nodes);
    EXPECT_EQ(spec.name, name);
    EXPECT_EQ(spec.nodes, nodes);
    const Cluster c(spec);
    EXPECT_EQ(c.n_devices(), nodes * spec.node.devices);
    for (int a = 0; a < c.n_devices(); ++a) {
      for (int b = 0; b < c.n_devices(); ++b) {
        const std::vector<int> path = c.route(a, b);
        if (a == b) {
          EXPECT_TRUE(path.empty());
          continue;
        }
        expect_connected(c, path, a, b);
        EXPECT_EQ(path, c.route(a, b));  // deterministic
        if (c.node_of(a) == c.node_of(b)) {
          // Inside a node: only that node's links.
          for (int l : path) {
            EXPECT_EQ(from(c, l).node, c.node_of(a));
            EXPECT_EQ(to(c, l).node, c.node_of(a));
          }
        } else {
          // Across nodes: out through a's NIC to the fabric, in through b's NIC.
          const std::string nic_a = vertex(c.node_of(a), "nic", c.nic_of(a));
          const std::string nic_b = vertex(c.node_of(b), "nic", c.nic_of(b));
          bool out = false, in = false;
          for (int l : path) {
            out = out || (from(c, l).name == nic_a && to(c, l).kind == VertexKind::leaf);
            in = in || (from(c, l).kind == VertexKind::leaf && to(c, l).name == nic_b);
          }
          EXPECT_TRUE(out && in) << c.link_name(path[0]);
          // NCCL's network step latency, 14 us, whatever the PCIe layout.
          EXPECT_NEAR(c.path_latency(path), 14.0e-6, 1e-12);
        }
      }
    }
  }
}

TEST(SimPresets, P3dnUsesTheHybridCubeMeshAndPcieForUnlinkedPairs) {
  const Cluster c(preset("p3dn.24xlarge", 2));
  EXPECT_EQ(c.device().name, "V100-SXM2-32GB");
  EXPECT_DOUBLE_EQ(c.device().peak_flops, 125e12);
  // GPU0-GPU3: two NVLinks (NV2), 50 GB/s per direction, NCCL's NVLink latency.
  std::vector<int> p = c.route(0, 3);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_STREQ(link_kind_name(c.links()[p[0]].kind), "nvlink");
  EXPECT_DOUBLE_EQ(c.path_bandwidth(p), 50e9);
  EXPECT_NEAR(c.path_latency(p), 3.4e-6, 1e-15);
  // GPU0-GPU1: one NVLink.
  EXPECT_DOUBLE_EQ(c.path_bandwidth(c.route(0, 1)), 25e9);
  // GPU0-GPU5 have no NVLink ("SYS"): up the PCIe tree, across the socket link, down.
  p = c.route(0, 5);
  ASSERT_EQ(p.size(), 5u);
  EXPECT_EQ(c.link_name(p[0]), "n0.gpu0->n0.pcie0");
  EXPECT_EQ(c.link_name(p[1]), "n0.pcie0->n0.cpu0");
  EXPECT_EQ(c.link_name(p[2]), "n0.cpu0->n0.cpu1");
  EXPECT_STREQ(link_kind_name(c.links()[p[2]].kind), "socket");
  EXPECT_EQ(c.link_name(p[3]), "n0.cpu1->n0.pcie2");
  EXPECT_EQ(c.link_name(p[4]), "n0.pcie2->n0.gpu5");
  EXPECT_NEAR(c.path_bandwidth(p), 8e9 * 16 * 128 / 130 / 8, 1);  // PCIe 3.0 x16
  EXPECT_NEAR(c.path_latency(p), 5.7e-6, 1e-15);
  // One 100 Gb/s NIC per node, on CPU 0: every GPU uses it.
  for (int d = 0; d < 8; ++d) EXPECT_EQ(c.nic_of(d), 0);
  p = c.route(5, 8 + 2);
  EXPECT_DOUBLE_EQ(c.path_bandwidth(p), 12.5e9);
}

TEST(SimPresets, NvswitchNodesAndPerGpuNics) {
  const Cluster p4d(preset("p4d.24xlarge", 2));
  std::vector<int> p = p4d.route(0, 7);
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p4d.link_name(p[0]), "n0.gpu0->n0.nvswitch");
  EXPECT_EQ(p4d.link_name(p[1]), "n0.nvswitch->n0.gpu7");
  EXPECT_DOUBLE_EQ(p4d.path_bandwidth(p), 300e9);  // 12 NVLinks x 25 GB/s
  EXPECT_NEAR(p4d.path_latency(p), 3.4e-6, 1e-15);
  // Four EFA cards, one per pair of GPUs.
  EXPECT_EQ(p4d.nic_of(0), 0);
  EXPECT_EQ(p4d.nic_of(1), 0);
  EXPECT_EQ(p4d.nic_of(6), 3);
  EXPECT_DOUBLE_EQ(p4d.path_bandwidth(p4d.route(0, 8)), 12.5e9);

  const Cluster h100(preset("h100x8-hgx", 2));
  EXPECT_DOUBLE_EQ(h100.path_bandwidth(h100.route(2, 5)), 450e9);  // 18 NVLinks x 25 GB/s
  for (int d = 0; d < 16; ++d) EXPECT_EQ(h100.nic_of(d), d % 8);   // a 400 Gb/s NIC per GPU
  p = h100.route(3, 8 + 6);
  EXPECT_DOUBLE_EQ(h100.path_bandwidth(p), 50e9);
  // GPU 3 and its NIC 3 share PCIe switch 1: no trip to the CPU.
  EXPECT_EQ(h100.link_name(p[0]), "n0.gpu3->n0.pcie1");
  EXPECT_EQ(h100.link_name(p[1]), "n0.pcie1->n0.nic3");
  EXPECT_EQ(h100.link_name(p[2]), "n0.nic3->leaf0");
}

TEST(SimPresets, PcieOnlyAndNvlinkPairNodes) {
  const Cluster rtx4090(preset("rtx4090x8-pcie4", 1));
  std::vector<int> p = rtx4090.route(1, 2);  // two root ports of CPU 0
  ASSERT_EQ(p.size(), 4u);
  EXPECT_NEAR(rtx4090.path_bandwidth(p), 16e9 * 16 * 128 / 130 / 8, 1);  // PCIe 4.0 x16
  EXPECT_EQ(rtx4090.route(1, 6).size(), 5u);                             // across the sockets

  const Cluster plain(preset("rtx3090x4-100g", 2));
  const Cluster paired(preset("rtx3090x4-nvlink-100g", 2));
  EXPECT_EQ(plain.route(0, 1).size(), 4u);
  p = paired.route(0, 1);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_DOUBLE_EQ(paired.path_bandwidth(p), 56.25e9);  // the bridge: 4 x4 links
  p = paired.route(1, 2);                               // not a pair: PCIe across the sockets, as without the bridges
  ASSERT_EQ(p.size(), 5u);
  for (int l : p) EXPECT_NE(paired.links()[l].kind, LinkKind::nvlink);

  const Cluster a100(preset("a100x4-ib100", 2));
  for (int a = 0; a < 4; ++a) {
    for (int b = 0; b < 4; ++b) {
      if (a == b) continue;
      EXPECT_DOUBLE_EQ(a100.path_bandwidth(a100.route(a, b)), 100e9);  // full mesh, 4 links a pair
    }
  }
}

TEST(SimPresets, ErrorsNameTheProblem) {
  ClusterSpec spec;
  Status s = preset_cluster("dgx-9000", 1, &spec);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("unknown preset \"dgx-9000\""), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("p4d.24xlarge"), std::string::npos) << s.message();
  s = preset_cluster("rtx4090x8-pcie4", 2, &spec);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("single node"), std::string::npos) << s.message();
  s = preset_cluster("p4d.24xlarge", 0, &spec);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("nodes (0)"), std::string::npos) << s.message();
  EXPECT_TRUE(preset_cluster("h100x8-hgx", 512, &spec));
  EXPECT_EQ(Cluster(spec).n_devices(), 4096);
}

TEST(SimFabric, OversubscribedLeavesAddAnUplinkBetweenLeavesOnly) {
  ClusterSpec spec = preset("p4d.24xlarge", 4);
  spec.fabric.nodes_per_leaf = 2;
  spec.fabric.oversubscription = 4;
  ASSERT_TRUE(spec.validate());
  const Cluster c(spec);
  // Nodes 0 and 1 share leaf 0: no spine.
  for (int l : c.route(0, 8)) EXPECT_NE(c.links()[l].kind, LinkKind::fabric);
  // Node 0 to node 2: up leaf 0's uplink and down leaf 1's, each 2 nodes x 4 NICs x 12.5 GB/s / 4.
  const std::vector<int> p = c.route(0, 16);
  std::vector<std::string> fabric;
  for (int l : p) {
    if (c.links()[l].kind == LinkKind::fabric) {
      fabric.push_back(c.link_name(l));
      EXPECT_DOUBLE_EQ(c.links()[l].bandwidth, 2 * 4 * 12.5e9 / 4);
    }
  }
  EXPECT_EQ(fabric, (std::vector<std::string>{"leaf0->spine", "spine->leaf1"}));
}

TEST(SimClusterJson, EveryPresetRoundTrips) {
  for (const std::string& name : preset_names()) {
    SCOPED_TRACE(name);
    ClusterSpec spec = preset(name, nodes_for(name));
    spec.fabric = {2, 1.5, 1e-6};
    const nlohmann::json j = spec.to_json();
    ClusterSpec back;
    const Status s = ClusterSpec::from_json(nlohmann::json::parse(j.dump()), &back);
    ASSERT_TRUE(s) << s.message();
    EXPECT_EQ(back, spec);
    EXPECT_EQ(back.to_json().dump(), j.dump());
  }
}

TEST(SimClusterJson, CpuCoresRoundTripAndStayOutOfAcceleratorClusters) {
  ClusterSpec spec = preset("p3dn.24xlarge", 1);
  EXPECT_FALSE(spec.to_json().contains("cpu_cores"));
  spec.cpu_cores = 2;
  spec.cpu_threads_per_device = 3;
  const nlohmann::json j = spec.to_json();
  EXPECT_EQ(j.at("cpu_cores"), 2);
  ClusterSpec back;
  ASSERT_TRUE(ClusterSpec::from_json(nlohmann::json::parse(j.dump()), &back));
  EXPECT_EQ(back, spec);
  nlohmann::json bad = j;
  bad["cpu_threads_per_device"] = 0;
  EXPECT_FALSE(ClusterSpec::from_json(bad, &back));
  bad = j;
  bad["cpu_cores"] = -1;
  const Status s = ClusterSpec::from_json(bad, &back);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("cpu_cores (-1) must be in [0"), std::string::npos) << s.message();
  // Pinned nodes: written only when set, read back; a core for every node.
  EXPECT_FALSE(j.contains("cpu_nodes_pinned"));
  spec.cpu_nodes_pinned = true;
  ASSERT_TRUE(ClusterSpec::from_json(nlohmann::json::parse(spec.to_json().dump()), &back));
  EXPECT_EQ(back, spec);
  bad = spec.to_json();
  bad["cpu_nodes_pinned"] = "yes";
  EXPECT_FALSE(ClusterSpec::from_json(bad, &back));
  spec.cpu_cores = 1;
  spec.nodes = 2;
  EXPECT_FALSE(spec.validate());
  // The threads' worth of a transfer between hosts: 1 unless given, read back, finite and >= 0.
  spec = preset("p3dn.24xlarge", 1);
  spec.cpu_cores = 2;
  EXPECT_EQ(spec.to_json().at("cpu_threads_per_transfer"), 1.0);
  spec.cpu_threads_per_transfer = 1.75;
  ASSERT_TRUE(ClusterSpec::from_json(nlohmann::json::parse(spec.to_json().dump()), &back));
  EXPECT_EQ(back, spec);
  nlohmann::json no_key = spec.to_json();
  no_key.erase("cpu_threads_per_transfer");
  ASSERT_TRUE(ClusterSpec::from_json(no_key, &back));
  EXPECT_EQ(back.cpu_threads_per_transfer, 1.0);
  bad = spec.to_json();
  bad["cpu_threads_per_transfer"] = -0.5;
  const Status negative = ClusterSpec::from_json(bad, &back);
  ASSERT_FALSE(negative);
  EXPECT_NE(negative.message().find("cpu_threads_per_transfer (-0.5) must be a finite number >= 0"), std::string::npos)
      << negative.message();
  // A transfer's slowdown beside compute: 1 unless given, read back, finite and >= 1.
  EXPECT_EQ(spec.to_json().at("cpu_transfer_slowdown"), 1.0);
  spec.cpu_transfer_slowdown = 4.2;
  ASSERT_TRUE(ClusterSpec::from_json(nlohmann::json::parse(spec.to_json().dump()), &back));
  EXPECT_EQ(back, spec);
  no_key = spec.to_json();
  no_key.erase("cpu_transfer_slowdown");
  ASSERT_TRUE(ClusterSpec::from_json(no_key, &back));
  EXPECT_EQ(back.cpu_transfer_slowdown, 1.0);
  bad = spec.to_json();
  bad["cpu_transfer_slowdown"] = 0.5;
  const Status faster = ClusterSpec::from_json(bad, &back);
  ASSERT_FALSE(faster);
  EXPECT_NE(faster.message().find("cpu_transfer_slowdown (0.5) must be a finite number >= 1"), std::string::npos)
      << faster.message();
}

// Eager sends between nodes: written only when set, read back equal, finite and >= 0.
TEST(SimClusterJson, EagerBytesRoundTripAndAreChecked) {
  ClusterSpec spec = preset("p3dn.24xlarge", 2);
  EXPECT_FALSE(spec.to_json().contains("eager_bytes"));
  spec.eager_bytes = 1 << 20;
  ClusterSpec back;
  ASSERT_TRUE(ClusterSpec::from_json(nlohmann::json::parse(spec.to_json().dump()), &back));
  EXPECT_EQ(back, spec);
  EXPECT_EQ(back.eager_bytes, 1 << 20);
  nlohmann::json bad = spec.to_json();
  bad["eager_bytes"] = -1;
  const Status s = ClusterSpec::from_json(bad, &back);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("eager_bytes (-1) must be a finite number >= 0"), std::string::npos) << s.message();
}

// Per-kind speeds: written only when there are some, read back equal; a kind that is not a compute op
// kind, or a speed that is not positive, is an error naming it.
TEST(SimClusterJson, OpKindSpeedsRoundTripAndAreChecked) {
  ClusterSpec spec = preset("p3dn.24xlarge", 1);
  EXPECT_FALSE(spec.to_json().at("node").at("device").contains("op_kind_speed"));
  spec.node.device.op_kind_speed = {{"attn_fwd", 0.625}, {"expert_bwd", 1.5}};
  const nlohmann::json j = spec.to_json();
  ClusterSpec back;
  ASSERT_TRUE(ClusterSpec::from_json(nlohmann::json::parse(j.dump()), &back));
  EXPECT_EQ(back, spec);
  for (const auto& [kind, speed, why] :
       {std::tuple<const char*, double, const char*>{"dispatch_a2a", 1.0, "not a compute op kind"},
        {"attn_fwdx", 1.0, "not a compute op kind"},
        {"attn_fwd", 0.0, "op_kind_speed.attn_fwd"},
        {"attn_fwd", -2.0, "op_kind_speed.attn_fwd"}}) {
    nlohmann::json bad = j;
    bad["node"]["device"]["op_kind_speed"] = {{kind, speed}};
    const Status s = ClusterSpec::from_json(bad, &back);
    ASSERT_FALSE(s) << kind << " " << speed;
    EXPECT_NE(s.message().find(why), std::string::npos) << s.message();
  }
  nlohmann::json bad = j;
  bad["node"]["device"]["op_kind_speed"] = {{"attn_fwd", "fast"}};
  EXPECT_FALSE(ClusterSpec::from_json(bad, &back));
}

TEST(SimClusterJson, OpTimeQuantilesRoundTripAndAreChecked) {
  ClusterSpec spec = preset("p3dn.24xlarge", 1);
  EXPECT_FALSE(spec.to_json().at("node").at("device").contains("op_time_quantiles"));
  spec.node.device.op_time_quantiles = {0.75, 1.0, 1.5};
  const nlohmann::json j = spec.to_json();
  ClusterSpec back;
  ASSERT_TRUE(ClusterSpec::from_json(nlohmann::json::parse(j.dump()), &back));
  EXPECT_EQ(back, spec);
  for (const auto& [q, why] : {std::pair<std::vector<double>, const char*>{{0.5, 0.0}, "op_time_quantiles[1]"},
                               {{1.5, 1.0}, "ascending"},
                               {{-1.0}, "op_time_quantiles[0]"}}) {
    nlohmann::json bad = j;
    bad["node"]["device"]["op_time_quantiles"] = q;
    const Status s = ClusterSpec::from_json(bad, &back);
    ASSERT_FALSE(s) << why;
    EXPECT_NE(s.message().find(why), std::string::npos) << s.message();
  }
  nlohmann::json bad = j;
  bad["node"]["device"]["op_time_quantiles"] = {1.0, "slow"};
  EXPECT_FALSE(ClusterSpec::from_json(bad, &back));
  bad["node"]["device"]["op_time_quantiles"] = 1.0;
  EXPECT_FALSE(ClusterSpec::from_json(bad, &back));
}

TEST(SimClusterJson, LoadsAFileAndNamesTheFileInErrors) {
  const std::string path = ::testing::TempDir() + "sim_cluster_test.json";
  {
    std::ofstream out(path);
    out << preset("a100x4-ib100", 3).to_json().dump(2);
  }
  ClusterSpec spec;
  Status s = load_cluster_file(path, &spec);
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(spec, preset("a100x4-ib100", 3));
  {
    std::ofstream out(path);
    out << "{\"name\": \"x\",";
  }
  s = load_cluster_file(path, &spec);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("not valid JSON"), std::string::npos) << s.message();
  {
    std::ofstream out(path);
    nlohmann::json j = preset("a100x4-ib100", 3).to_json();
    j["node"]["nic_port"]["bandwidth"] = -1;
    out << j.dump();
  }
  s = load_cluster_file(path, &spec);
  ASSERT_FALSE(s);
  std::string expected = "cluster file ";
  expected += path;
  expected += ": node.nic_port.bandwidth (-1) must be a finite number > 0";
  EXPECT_EQ(s.message(), expected);
  std::remove(path.c_str());
  s = load_cluster_file(path, &spec);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("cannot be opened"), std::string::npos) << s.message();
}

// Applies `edit` to the JSON of a valid spec and expects from_json to fail with `expected` in the
// message, leaving *out untouched.
void expect_json_error(const std::function<void(nlohmann::json&)>& edit, const std::string& expected) {
  nlohmann::json j = preset("p3dn.24xlarge", 2).to_json();
  edit(j);
  ClusterSpec out;
  out.name = "untouched";
  const Status s = ClusterSpec::from_json(j, &out);
  ASSERT_FALSE(s) << "expected an error containing: " << expected;
  EXPECT_NE(s.message().find(expected), std::string::npos) << s.message();
  EXPECT_EQ(s.message().rfind("cluster: ", 0), 0u) << s.message();
  EXPECT_EQ(out.name, "untouched");
}

TEST(SimClusterJson, BadFilesGetErrorsNamingTheField) {
  expect_json_error([](nlohmann::json& j) { j["node"]["device"].erase("peak_flops"); },
                    "missing key node.device.peak_flops");
  expect_json_error([](nlohmann::json& j) { j["node"]["device"]["peak_flops"] = "fast"; },
                    "node.device.peak_flops must be a number, got string \"fast\"");
  expect_json_error([](nlohmann::json& j) { j["node"]["device"]["peak_flops"] = -1; },
                    "node.device.peak_flops (-1) must be a finite number > 0");
  expect_json_error([](nlohmann::json& j) { j["nodes"] = 2.5; }, "nodes must be an integer, got number 2.5");
  expect_json_error([](nlohmann::json& j) { j["node"]["device_switch"][3] = 7; },
                    "node.device_switch[3] (7) must be in [0, 4]");
  expect_json_error([](nlohmann::json& j) { j["node"]["nvlink_links"][0][1] = 3; },
                    "node.nvlink_links[0][1] (3) differs from node.nvlink_links[1][0] (1)");
  expect_json_error([](nlohmann::json& j) { j["node"]["interconnect"] = "infinityfabric"; },
                    "node.interconnect (\"infinityfabric\") must be");
  expect_json_error([](nlohmann::json& j) { j["node"]["nvlink"]["bandwidth"] = 0; },
                    "node.nvlink.bandwidth (0) must be a finite number > 0");
  expect_json_error([](nlohmann::json& j) { j["node"]["nic_port"]["latncy"] = 1; }, "unknown key node.nic_port.latncy");
  expect_json_error([](nlohmann::json& j) { j["fabric"]["oversubscription"] = 0.5; },
                    "fabric.oversubscription (0.5) must be a finite number >= 1");
  expect_json_error([](nlohmann::json& j) { j["node"]["nic_switch"] = nlohmann::json::array(); },
                    "nodes (2) > 1 needs NICs");
  expect_json_error([](nlohmann::json& j) { j["node"]["nvswitch_links"] = 6; },
                    "node.nvswitch_links is set but node.interconnect is not \"nvswitch\"");
  expect_json_error([](nlohmann::json& j) { j["node"]["nvlink_links"][5].erase(0); },
                    "node.nvlink_links[5] has 7 entries, node.devices is 8");
  expect_json_error([](nlohmann::json& j) { j["node"] = 3; }, "node must be a JSON object, got number 3");
  expect_json_error([](nlohmann::json& j) { j = nlohmann::json::array(); },
                    "the cluster spec must be a JSON object, got array []");
}

TEST(SimCluster, RejectsAnInvalidSpecAndOutOfRangeDevices) {
  ClusterSpec spec = preset("p4d.24xlarge", 2);
  spec.node.device_switch.pop_back();
  EXPECT_FALSE(spec.validate());
  EXPECT_THROW(Cluster{spec}, std::logic_error);
  const Cluster c(preset("p4d.24xlarge", 2));
  EXPECT_THROW(c.route(0, 16), std::logic_error);
  EXPECT_THROW(c.route(-1, 0), std::logic_error);
  EXPECT_THROW(c.link_name(c.n_links()), std::logic_error);
}

TEST(SimCompute, RooflineWithEfficiencyCurveAndLaunchOverhead) {
  DeviceSpec d;
  d.name = "test";
  d.peak_flops = 100e12;
  d.mem_bandwidth = 1e12;
  d.launch_overhead = 5e-6;
  d.max_efficiency = 0.8;
  d.half_efficiency_flops = 1e9;
  EXPECT_DOUBLE_EQ(efficiency(d, 0), 0);
  EXPECT_DOUBLE_EQ(efficiency(d, 1e9), 0.4);  // half of max at half_efficiency_flops
  EXPECT_DOUBLE_EQ(efficiency(d, 3e9), 0.6);  // 0.8 * 3 / 4
  EXPECT_NEAR(efficiency(d, 1e15), 0.8, 1e-6);
  // Compute-bound: (3e9 + 1e9) / (100e12 * 0.8) = 50 us, memory 1 us.
  EXPECT_DOUBLE_EQ(op_time(d, 3e9, 1e6), 50e-6 + 5e-6);
  // Memory-bound: 1 GB at 1 TB/s = 1 ms; compute (1e6 + 1e9) / 8e13 = 12.5 us.
  EXPECT_DOUBLE_EQ(op_time(d, 1e6, 1e9), 1e-3 + 5e-6);
  EXPECT_DOUBLE_EQ(op_time(d, 0, 0), 5e-6);
  EXPECT_THROW(op_time(d, -1, 0), std::logic_error);
  // A kind's speed divides the compute term only: attention at 0.5 takes twice the 50 us compute.
  d.op_kind_speed["attn_fwd"] = 0.5;
  EXPECT_DOUBLE_EQ(kind_speed(d, "attn_fwd"), 0.5);
  EXPECT_DOUBLE_EQ(kind_speed(d, "expert_fwd"), 1);
  EXPECT_DOUBLE_EQ(op_time(d, 3e9, 1e6, kind_speed(d, "attn_fwd")), 100e-6 + 5e-6);
  EXPECT_DOUBLE_EQ(op_time(d, 1e6, 1e9, 0.5), 1e-3 + 5e-6);  // still memory-bound
  // The spread: no table, 1; entries at the quantiles 1/6, 1/2, 5/6, linear between, flat outside.
  EXPECT_DOUBLE_EQ(op_time_factor(d, 0.3), 1);
  d.op_time_quantiles = {0.5, 1.0, 2.0};
  EXPECT_DOUBLE_EQ(op_time_factor(d, 0), 0.5);
  EXPECT_DOUBLE_EQ(op_time_factor(d, 1.0 / 6), 0.5);
  EXPECT_DOUBLE_EQ(op_time_factor(d, 1.0 / 3), 0.75);
  EXPECT_DOUBLE_EQ(op_time_factor(d, 0.5), 1.0);
  EXPECT_DOUBLE_EQ(op_time_factor(d, 2.0 / 3), 1.5);
  EXPECT_DOUBLE_EQ(op_time_factor(d, 1), 2.0);
  EXPECT_THROW(op_time_factor(d, 1.5), std::logic_error);
  EXPECT_THROW(op_time_factor(d, std::nan("")), std::logic_error);
  d.op_time_quantiles.clear();
  EXPECT_THROW(op_time(d, 1, 0, 0), std::logic_error);
  d.max_efficiency = 0;
  EXPECT_THROW(op_time(d, 1, 0), std::logic_error);
  // The presets' devices: a 1 TFLOP op on an H100 takes about 1e12 / (989.5e12 * 0.8) = 1.26 ms.
  const ClusterSpec h100 = preset("h100x8-hgx", 1);
  EXPECT_NEAR(op_time(h100.node.device, 1e12, 0), (1e12 + 10e-6 * 989.5e12 * 0.8) / (989.5e12 * 0.8) + 5e-6, 1e-12);
}

}  // namespace
}  // namespace moe::sim
