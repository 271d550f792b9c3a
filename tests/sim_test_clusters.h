// Small hand-made clusters for the simulator's tests (test_sim_*.cpp): one node of test devices on a
// fast PCIe switch, so that the NVLink or NVSwitch links the test sets up decide every transfer.
#pragma once

#include <vector>

#include "sim/cluster.h"

namespace moe::sim {

// 100 TFLOP/s at any op size, no launch overhead, memory at `mem_bandwidth` bytes/s.
inline DeviceSpec test_device(double mem_bandwidth = 1e12) {
  return DeviceSpec{"test-gpu", 100e12, mem_bandwidth, 0, 1, 0, {}, {}};
}

// One node of `devices` devices on one PCIe switch (1e12 B/s, no latency).
inline ClusterSpec node_spec(int devices, const DeviceSpec& device = test_device()) {
  ClusterSpec c;
  c.name = "test";
  NodeSpec& n = c.node;
  n.devices = devices;
  n.device = device;
  n.sockets = 1;
  n.switch_socket = {0};
  n.switch_uplink = {1e12, 0};
  n.device_switch.assign(devices, 0);
  n.device_pcie = {1e12, 0};
  return c;
}

// p devices on a switch (a star): each has one link of bandwidth B to it and one from it, latency
// alpha/2 each, so a device-to-device path pays alpha.
inline ClusterSpec star_spec(int p, double B, double alpha, const DeviceSpec& device = test_device()) {
  ClusterSpec c = node_spec(p, device);
  c.node.interconnect = Interconnect::nvswitch;
  c.node.nvlink = {B, alpha / 2};
  c.node.nvswitch_links = 1;
  return c;
}

// p devices joined in a ring by one NVLink each between i and i+1: every ring step crosses its own
// link of bandwidth B and latency alpha.
inline ClusterSpec ring_spec(int p, double B, double alpha, const DeviceSpec& device = test_device()) {
  ClusterSpec c = node_spec(p, device);
  c.node.interconnect = Interconnect::nvlink;
  c.node.nvlink = {B, alpha};
  c.node.nvlink_links.assign(p, std::vector<int>(p, 0));
  for (int i = 0; i < p; ++i) {
    c.node.nvlink_links[i][(i + 1) % p] = 1;
    c.node.nvlink_links[(i + 1) % p][i] = 1;
  }
  return c;
}

}  // namespace moe::sim
