// ClusterSpec validation and JSON I/O; the link graph and routing of a Cluster (cluster.h).
#include "sim/cluster.h"

#include "graph/step_graph.h"
#include "util/str_cat.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace moe::sim {

namespace {

// Bounds that catch typos (an extra zero) before a huge graph is built.
constexpr int kMaxNodes = 1 << 16;
constexpr int kMaxDevicesPerNode = 1024;
constexpr int64_t kMaxDevices = 1 << 20;
constexpr int kMaxSockets = 8;
constexpr int kMaxSwitches = 1024;
constexpr int kMaxNics = 1024;
constexpr int kMaxLinksPerPair = 64;
constexpr int64_t kMaxLinks = int64_t{1} << 28;

Status cluster_error(const std::string& what) {
  std::string m = "cluster: ";
  m += what;
  return Status::error(m);
}

std::string indexed(const std::string& field, size_t i) { return str_cat(field, "[", i, "]"); }

// A compute op kind's name (graph::op_kind_name of a kind that is not communication).
bool is_compute_kind_name(std::string_view name) {
  for (int k = 0; k <= static_cast<int>(graph::OpKind::custom_comm); ++k) {
    const auto kind = static_cast<graph::OpKind>(k);
    if (!graph::is_communication(kind) && name == graph::op_kind_name(kind)) return true;
  }
  return false;
}

Status positive(const std::string& field, double v) {
  if (!std::isfinite(v) || v <= 0) return cluster_error(str_cat(field, " (", v, ") must be a finite number > 0"));
  return Status::ok();
}

Status nonnegative(const std::string& field, double v) {
  if (!std::isfinite(v) || v < 0) return cluster_error(str_cat(field, " (", v, ") must be a finite number >= 0"));
  return Status::ok();
}

Status in_range(const std::string& field, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) return cluster_error(str_cat(field, " (", v, ") must be in [", lo, ", ", hi, "]"));
  return Status::ok();
}

Status valid_link(const std::string& field, const LinkSpec& l) {
  if (Status s = positive(str_cat(field, ".bandwidth"), l.bandwidth); !s) return s;
  return nonnegative(str_cat(field, ".latency"), l.latency);
}

// A field that only one interconnect (or only a node with NICs) uses must keep its default elsewhere,
// so that to_json, which leaves it out, round-trips.
Status unused(const std::string& field, bool is_default, const std::string& why) {
  if (!is_default) return cluster_error(str_cat(field, " is set but ", why));
  return Status::ok();
}

std::string describe(const nlohmann::json& v) {
  if (v.is_null()) return "null";
  return str_cat(v.type_name(), " ", v.dump());
}

// Reads the fields of one JSON object of a cluster file. The first error wins (later calls do
// nothing); finish() reports keys no call asked for. Field names in messages are paths from the top
// ("node.device.peak_flops").
class Reader {
 public:
  Reader(const nlohmann::json* j, std::string path, Status* st) : j_(j), path_(std::move(path)), st_(st) {
    if (ok() && j_ && !j_->is_object()) {
      fail(str_cat(path_.empty() ? "the cluster spec" : path_, " must be a JSON object, got ", describe(*j_)));
    }
  }

  bool ok() const { return st_->is_ok(); }
  std::string field(const char* key) const { return path_.empty() ? std::string(key) : str_cat(path_, ".", key); }

  // The value under key, or null when absent (an error when required).
  const nlohmann::json* find(const char* key, bool required) {
    known_.push_back(key);
    if (!ok() || !j_) return nullptr;
    auto it = j_->find(key);
    if (it == j_->end()) {
      if (required) fail(str_cat("missing key ", field(key)));
      return nullptr;
    }
    return &*it;
  }

  void number(const char* key, double* out, bool required = true) {
    const nlohmann::json* v = find(key, required);
    if (!v) return;
    if (!v->is_number()) return fail(str_cat(field(key), " must be a number, got ", describe(*v)));
    *out = v->get<double>();
  }

  void integer(const char* key, int* out, bool required = true) {
    const nlohmann::json* v = find(key, required);
    if (v) read_int(*v, field(key), out);
  }

  void boolean(const char* key, bool* out, bool required = true) {
    const nlohmann::json* v = find(key, required);
    if (!v) return;
    if (!v->is_boolean()) return fail(str_cat(field(key), " must be true or false, got ", describe(*v)));
    *out = v->get<bool>();
  }

  void text(const char* key, std::string* out, bool required = true) {
    const nlohmann::json* v = find(key, required);
    if (!v) return;
    if (!v->is_string()) return fail(str_cat(field(key), " must be a string, got ", describe(*v)));
    *out = v->get<std::string>();
  }

  void ints(const char* key, std::vector<int>* out, bool required = true) {
    const nlohmann::json* v = find(key, required);
    if (v) read_ints(*v, field(key), out);
  }

  void int_rows(const char* key, std::vector<std::vector<int>>* out, bool required = true) {
    const nlohmann::json* v = find(key, required);
    if (!v) return;
    if (!v->is_array()) return fail(str_cat(field(key), " must be an array of arrays, got ", describe(*v)));
    std::vector<std::vector<int>> rows(v->size());
    for (size_t i = 0; i < v->size() && ok(); ++i) read_ints((*v)[i], indexed(field(key), i), &rows[i]);
    if (ok()) *out = std::move(rows);
  }

  void link(const char* key, LinkSpec* out, bool required = true) {
    const nlohmann::json* v = find(key, required);
    if (!v) return;
    Reader r(v, field(key), st_);
    r.number("bandwidth", &out->bandwidth);
    r.number("latency", &out->latency);
    r.finish();
  }

  // An array of numbers (absent and optional: *out unchanged).
  void numbers(const char* key, std::vector<double>* out, bool required = true) {
    const nlohmann::json* v = find(key, required);
    if (!v) return;
    if (!v->is_array()) return fail(str_cat(field(key), " must be an array of numbers, got ", describe(*v)));
    std::vector<double> values;
    for (size_t i = 0; i < v->size(); ++i) {
      if (!(*v)[i].is_number())
        return fail(str_cat(indexed(field(key), i), " must be a number, got ", describe((*v)[i])));
      values.push_back((*v)[i].get<double>());
    }
    *out = std::move(values);
  }

  // An object of numbers by name (absent and optional: *out unchanged).
  void numbers_by_name(const char* key, std::map<std::string, double, std::less<>>* out, bool required = true) {
    const nlohmann::json* v = find(key, required);
    if (!v) return;
    if (!v->is_object()) return fail(str_cat(field(key), " must be an object of numbers, got ", describe(*v)));
    std::map<std::string, double, std::less<>> m;
    for (const auto& [name, x] : v->items()) {
      if (!x.is_number()) return fail(str_cat(field(key), ".", name, " must be a number, got ", describe(x)));
      m[name] = x.get<double>();
    }
    *out = std::move(m);
  }

  // A nested object's reader (on an absent optional key, one whose calls do nothing).
  Reader object(const char* key, bool required = true) { return Reader(find(key, required), field(key), st_); }

  void finish() {
    if (!ok() || !j_) return;
    for (auto it = j_->begin(); it != j_->end(); ++it) {
      bool found = false;
      for (const char* k : known_) found = found || it.key() == k;
      if (found) continue;
      std::string known;
      for (const char* k : known_) {
        if (!known.empty()) known += ", ";
        known += k;
      }
      return fail(str_cat("unknown key ", field(it.key().c_str()), " (known keys here: ", known, ")"));
    }
  }

 private:
  void fail(const std::string& what) {
    if (ok()) *st_ = cluster_error(what);
  }
  void read_int(const nlohmann::json& v, const std::string& name, int* out) {
    if (!v.is_number_integer()) return fail(str_cat(name, " must be an integer, got ", describe(v)));
    if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int>::max())
                               : (v.get<int64_t>() > std::numeric_limits<int>::max() ||
                                  v.get<int64_t>() < std::numeric_limits<int>::min())) {
      return fail(str_cat(name, " (", v.dump(), ") is out of range"));
    }
    *out = v.get<int>();
  }
  void read_ints(const nlohmann::json& v, const std::string& name, std::vector<int>* out) {
    if (!v.is_array()) return fail(str_cat(name, " must be an array of integers, got ", describe(v)));
    std::vector<int> values(v.size());
    for (size_t i = 0; i < v.size() && ok(); ++i) read_int(v[i], indexed(name, i), &values[i]);
    if (ok()) *out = std::move(values);
  }

  const nlohmann::json* j_;
  std::string path_;
  Status* st_;
  std::vector<const char*> known_;
};

nlohmann::json link_json(const LinkSpec& l) { return {{"bandwidth", l.bandwidth}, {"latency", l.latency}}; }

}  // namespace

const char* interconnect_name(Interconnect k) {
  switch (k) {
    case Interconnect::pcie: return "pcie";
    case Interconnect::nvlink: return "nvlink";
    case Interconnect::nvswitch: return "nvswitch";
  }
  return "?";
}

const char* link_kind_name(LinkKind k) {
  switch (k) {
    case LinkKind::pcie: return "pcie";
    case LinkKind::socket: return "socket";
    case LinkKind::nvlink: return "nvlink";
    case LinkKind::nic_port: return "nic_port";
    case LinkKind::fabric: return "fabric";
  }
  return "?";
}

Status ClusterSpec::validate() const {
  const NodeSpec& n = node;
  Status s;
  if (!(s = in_range("nodes", nodes, 1, kMaxNodes))) return s;
  if (!(s = in_range("node.devices", n.devices, 1, kMaxDevicesPerNode))) return s;
  if (static_cast<int64_t>(nodes) * n.devices > kMaxDevices) {
    return cluster_error(
        str_cat("nodes x node.devices (", static_cast<int64_t>(nodes) * n.devices, ") must be <= ", kMaxDevices));
  }

  const DeviceSpec& d = n.device;
  if (!(s = positive("node.device.peak_flops", d.peak_flops))) return s;
  if (!(s = positive("node.device.mem_bandwidth", d.mem_bandwidth))) return s;
  if (!(s = nonnegative("node.device.launch_overhead", d.launch_overhead))) return s;
  if (!(d.max_efficiency > 0 && d.max_efficiency <= 1)) {
    return cluster_error(str_cat("node.device.max_efficiency (", d.max_efficiency, ") must be in (0, 1]"));
  }
  if (!(s = nonnegative("node.device.half_efficiency_flops", d.half_efficiency_flops))) return s;
  for (const auto& [kind, speed] : d.op_kind_speed) {
    if (!is_compute_kind_name(kind))
      return cluster_error(str_cat("node.device.op_kind_speed has \"", kind, "\", which is not a compute op kind"));
    if (!(s = positive(str_cat("node.device.op_kind_speed.", kind), speed))) return s;
  }
  for (size_t i = 0; i < d.op_time_quantiles.size(); ++i) {
    if (!(s = positive(str_cat("node.device.op_time_quantiles[", i, "]"), d.op_time_quantiles[i]))) return s;
    if (i > 0 && d.op_time_quantiles[i] < d.op_time_quantiles[i - 1])
      return cluster_error("node.device.op_time_quantiles must be ascending");
  }

  if (!(s = in_range("node.sockets", n.sockets, 1, kMaxSockets))) return s;
  if (n.sockets > 1) {
    if (!(s = valid_link("node.socket_link", n.socket_link))) return s;
  } else if (!(s = unused("node.socket_link", n.socket_link == LinkSpec{}, "node.sockets is 1"))) {
    return s;
  }
  if (!(s = in_range("size of node.switch_socket", static_cast<int64_t>(n.switch_socket.size()), 1, kMaxSwitches))) {
    return s;
  }
  for (size_t k = 0; k < n.switch_socket.size(); ++k) {
    if (!(s = in_range(indexed("node.switch_socket", k), n.switch_socket[k], 0, n.sockets - 1))) return s;
  }
  if (!(s = valid_link("node.switch_uplink", n.switch_uplink))) return s;
  const int switches = static_cast<int>(n.switch_socket.size());
  if (static_cast<int>(n.device_switch.size()) != n.devices) {
    return cluster_error(
        str_cat("node.device_switch has ", n.device_switch.size(), " entries, node.devices is ", n.devices));
  }
  for (size_t i = 0; i < n.device_switch.size(); ++i) {
    if (!(s = in_range(indexed("node.device_switch", i), n.device_switch[i], 0, switches - 1))) return s;
  }
  if (!(s = valid_link("node.device_pcie", n.device_pcie))) return s;

  const bool nvlink = n.interconnect == Interconnect::nvlink;
  const bool nvswitch = n.interconnect == Interconnect::nvswitch;
  if (nvlink || nvswitch) {
    if (!(s = valid_link("node.nvlink", n.nvlink))) return s;
  } else if (!(s = unused("node.nvlink", n.nvlink == LinkSpec{}, "node.interconnect is \"pcie\""))) {
    return s;
  }
  if (nvlink) {
    if (static_cast<int>(n.nvlink_links.size()) != n.devices) {
      return cluster_error(str_cat("node.nvlink_links has ", n.nvlink_links.size(), " rows, node.devices is ", n.devices));
    }
    for (int i = 0; i < n.devices; ++i) {
      if (static_cast<int>(n.nvlink_links[i].size()) != n.devices) {
        return cluster_error(str_cat(indexed("node.nvlink_links", i), " has ", n.nvlink_links[i].size(),
                                 " entries, node.devices is ", n.devices));
      }
    }
    for (int i = 0; i < n.devices; ++i) {
      for (int j = 0; j < n.devices; ++j) {
        const std::string f = indexed(indexed("node.nvlink_links", i), j);
        const int v = n.nvlink_links[i][j];
        if (!(s = in_range(f, v, 0, i == j ? 0 : kMaxLinksPerPair))) return s;
        if (v != n.nvlink_links[j][i]) {
          return cluster_error(str_cat(f, " (", v, ") differs from node.nvlink_links[", j, "][", i, "] (",
                                   n.nvlink_links[j][i], "): links are symmetric"));
        }
      }
    }
  } else if (!(s = unused("node.nvlink_links", n.nvlink_links.empty(), "node.interconnect is not \"nvlink\""))) {
    return s;
  }
  if (nvswitch) {
    if (!(s = in_range("node.nvswitch_links", n.nvswitch_links, 1, kMaxLinksPerPair))) return s;
  } else if (!(s = unused("node.nvswitch_links", n.nvswitch_links == 0, "node.interconnect is not \"nvswitch\""))) {
    return s;
  }

  if (!(s = in_range("size of node.nic_switch", static_cast<int64_t>(n.nic_switch.size()), 0, kMaxNics))) return s;
  for (size_t k = 0; k < n.nic_switch.size(); ++k) {
    if (!(s = in_range(indexed("node.nic_switch", k), n.nic_switch[k], 0, switches - 1))) return s;
  }
  if (!n.nic_switch.empty()) {
    if (!(s = valid_link("node.nic_pcie", n.nic_pcie))) return s;
    if (!(s = valid_link("node.nic_port", n.nic_port))) return s;
  } else {
    if (nodes > 1) return cluster_error(str_cat("nodes (", nodes, ") > 1 needs NICs, but node.nic_switch is empty"));
    if (!(s = unused("node.nic_pcie", n.nic_pcie == LinkSpec{}, "the node has no NICs"))) return s;
    if (!(s = unused("node.nic_port", n.nic_port == LinkSpec{}, "the node has no NICs"))) return s;
  }

  if (!(s = in_range("fabric.nodes_per_leaf", fabric.nodes_per_leaf, 0, kMaxNodes))) return s;
  if (!std::isfinite(fabric.oversubscription) || fabric.oversubscription < 1) {
    return cluster_error(str_cat("fabric.oversubscription (", fabric.oversubscription, ") must be a finite number >= 1"));
  }
  if (!(s = nonnegative("fabric.uplink_latency", fabric.uplink_latency))) return s;
  if (!(s = in_range("cpu_cores", cpu_cores, 0, 1 << 20))) return s;
  if (!(s = in_range("cpu_threads_per_device", cpu_threads_per_device, 1, 1 << 20))) return s;
  if (!std::isfinite(cpu_threads_per_transfer) || cpu_threads_per_transfer < 0)
    return cluster_error(str_cat("cpu_threads_per_transfer (", cpu_threads_per_transfer,
                                 ") must be a finite number >= 0"));
  if (!std::isfinite(cpu_transfer_slowdown) || cpu_transfer_slowdown < 1)
    return cluster_error(
        str_cat("cpu_transfer_slowdown (", cpu_transfer_slowdown, ") must be a finite number >= 1"));
  if (!std::isfinite(eager_bytes) || eager_bytes < 0)
    return cluster_error(str_cat("eager_bytes (", eager_bytes, ") must be a finite number >= 0"));
  if (cpu_nodes_pinned && cpu_cores < nodes)
    return cluster_error(str_cat("cpu_nodes_pinned needs a core for every node: cpu_cores (", cpu_cores, ") < nodes (",
                                 nodes, ")"));

  // The links Cluster builds (two per physical link), bounded so ids fit and memory stays sane.
  int64_t per_node = 2 * static_cast<int64_t>(n.devices) + 2 * switches +
                     static_cast<int64_t>(n.sockets) * (n.sockets - 1) + 4 * static_cast<int64_t>(n.nic_switch.size());
  if (nvswitch) per_node += 2 * static_cast<int64_t>(n.devices);
  if (nvlink) {
    for (int i = 0; i < n.devices; ++i) {
      for (int j = i + 1; j < n.devices; ++j) per_node += n.nvlink_links[i][j] > 0 ? 2 : 0;
    }
  }
  const int64_t total = per_node * nodes + 2 * static_cast<int64_t>(nodes);
  if (total > kMaxLinks) return cluster_error(str_cat("the spec makes about ", total, " links, more than ", kMaxLinks));
  return Status::ok();
}

nlohmann::json ClusterSpec::to_json() const {
  const NodeSpec& n = node;
  const DeviceSpec& d = n.device;
  nlohmann::json device = {{"name", d.name},
                           {"peak_flops", d.peak_flops},
                           {"mem_bandwidth", d.mem_bandwidth},
                           {"launch_overhead", d.launch_overhead},
                           {"max_efficiency", d.max_efficiency},
                           {"half_efficiency_flops", d.half_efficiency_flops}};
  if (!d.op_kind_speed.empty()) device["op_kind_speed"] = d.op_kind_speed;
  if (!d.op_time_quantiles.empty()) device["op_time_quantiles"] = d.op_time_quantiles;
  nlohmann::json nj = {{"devices", n.devices},
                       {"device", device},
                       {"sockets", n.sockets},
                       {"switch_socket", n.switch_socket},
                       {"switch_uplink", link_json(n.switch_uplink)},
                       {"device_switch", n.device_switch},
                       {"device_pcie", link_json(n.device_pcie)},
                       {"interconnect", interconnect_name(n.interconnect)},
                       {"nic_switch", n.nic_switch}};
  if (n.sockets > 1) nj["socket_link"] = link_json(n.socket_link);
  if (n.interconnect != Interconnect::pcie) nj["nvlink"] = link_json(n.nvlink);
  if (n.interconnect == Interconnect::nvlink) nj["nvlink_links"] = n.nvlink_links;
  if (n.interconnect == Interconnect::nvswitch) nj["nvswitch_links"] = n.nvswitch_links;
  if (!n.nic_switch.empty()) {
    nj["nic_pcie"] = link_json(n.nic_pcie);
    nj["nic_port"] = link_json(n.nic_port);
  }
  nlohmann::json j = {{"name", name},
                      {"nodes", nodes},
                      {"node", nj},
                      {"fabric",
                       {{"nodes_per_leaf", fabric.nodes_per_leaf},
                        {"oversubscription", fabric.oversubscription},
                        {"uplink_latency", fabric.uplink_latency}}}};
  if (cpu_cores > 0) {
    j["cpu_cores"] = cpu_cores;
    j["cpu_threads_per_device"] = cpu_threads_per_device;
    if (cpu_nodes_pinned) j["cpu_nodes_pinned"] = true;
    j["cpu_threads_per_transfer"] = cpu_threads_per_transfer;
    j["cpu_transfer_slowdown"] = cpu_transfer_slowdown;
  }
  if (eager_bytes > 0) j["eager_bytes"] = eager_bytes;
  return j;
}

Status ClusterSpec::from_json(const nlohmann::json& j, ClusterSpec* out) {
  Status st;
  ClusterSpec c;
  Reader top(&j, "", &st);
  top.text("name", &c.name);
  top.integer("nodes", &c.nodes);
  {
    Reader n = top.object("node");
    NodeSpec& ns = c.node;
    n.integer("devices", &ns.devices);
    {
      Reader d = n.object("device");
      d.text("name", &ns.device.name);
      d.number("peak_flops", &ns.device.peak_flops);
      d.number("mem_bandwidth", &ns.device.mem_bandwidth);
      d.number("launch_overhead", &ns.device.launch_overhead);
      d.number("max_efficiency", &ns.device.max_efficiency);
      d.number("half_efficiency_flops", &ns.device.half_efficiency_flops);
      d.numbers_by_name("op_kind_speed", &ns.device.op_kind_speed, /*required=*/false);
      d.numbers("op_time_quantiles", &ns.device.op_time_quantiles, /*required=*/false);
      d.finish();
    }
    n.integer("sockets", &ns.sockets);
    n.link("socket_link", &ns.socket_link, /*required=*/false);
    n.ints("switch_socket", &ns.switch_socket);
    n.link("switch_uplink", &ns.switch_uplink);
    n.ints("device_switch", &ns.device_switch);
    n.link("device_pcie", &ns.device_pcie);
    std::string interconnect;
    n.text("interconnect", &interconnect);
    if (st) {
      if (interconnect == "pcie") {
        ns.interconnect = Interconnect::pcie;
      } else if (interconnect == "nvlink") {
        ns.interconnect = Interconnect::nvlink;
      } else if (interconnect == "nvswitch") {
        ns.interconnect = Interconnect::nvswitch;
      } else {
        st = cluster_error(
            str_cat("node.interconnect (\"", interconnect, "\") must be \"pcie\", \"nvlink\" or \"nvswitch\""));
      }
    }
    n.link("nvlink", &ns.nvlink, false);
    n.int_rows("nvlink_links", &ns.nvlink_links, false);
    n.integer("nvswitch_links", &ns.nvswitch_links, false);
    n.ints("nic_switch", &ns.nic_switch);
    n.link("nic_pcie", &ns.nic_pcie, false);
    n.link("nic_port", &ns.nic_port, false);
    n.finish();
  }
  {
    Reader f = top.object("fabric", /*required=*/false);
    f.integer("nodes_per_leaf", &c.fabric.nodes_per_leaf);
    f.number("oversubscription", &c.fabric.oversubscription);
    f.number("uplink_latency", &c.fabric.uplink_latency);
    f.finish();
  }
  top.integer("cpu_cores", &c.cpu_cores, /*required=*/false);
  top.integer("cpu_threads_per_device", &c.cpu_threads_per_device, /*required=*/false);
  top.boolean("cpu_nodes_pinned", &c.cpu_nodes_pinned, /*required=*/false);
  top.number("cpu_threads_per_transfer", &c.cpu_threads_per_transfer, /*required=*/false);
  top.number("cpu_transfer_slowdown", &c.cpu_transfer_slowdown, /*required=*/false);
  top.number("eager_bytes", &c.eager_bytes, /*required=*/false);
  top.finish();
  if (!st) return st;
  if (Status s = c.validate(); !s) return s;
  *out = std::move(c);
  return Status::ok();
}

Status load_cluster_file(const std::string& path, ClusterSpec* out) {
  std::ifstream in(path);
  if (!in) return Status::error(str_cat("cluster file ", path, ": cannot be opened"));
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    return Status::error(str_cat("cluster file ", path, ": not valid JSON (", e.what(), ")"));
  }
  if (Status s = ClusterSpec::from_json(j, out); !s) {
    // "cluster file F: node.x ..." rather than "cluster file F: cluster: node.x ...".
    const std::string prefix = "cluster: ";
    std::string what = s.message();
    if (what.rfind(prefix, 0) == 0) what.erase(0, prefix.size());
    return Status::error(str_cat("cluster file ", path, ": ", what));
  }
  return Status::ok();
}

Cluster::Cluster(ClusterSpec spec) : spec_(std::move(spec)) {
  if (Status s = spec_.validate(); !s) {
    std::string m = "sim::Cluster: ";
    m += s.message();
    throw std::logic_error(m);
  }
  const NodeSpec& n = spec_.node;
  const int D = n.devices;
  const int K = static_cast<int>(n.switch_socket.size());
  const int S = n.sockets;
  const int N = static_cast<int>(n.nic_switch.size());
  const bool nvswitch = n.interconnect == Interconnect::nvswitch;
  const int npl = spec_.fabric.nodes_per_leaf;
  n_leaves_ = npl == 0 ? 1 : (spec_.nodes + npl - 1) / npl;

  // Vertices: each node's devices, switches, sockets, NVSwitch, NICs; then the leaves and the spine.
  const int per_node = D + K + S + (nvswitch ? 1 : 0) + N;
  vertices_.reserve(static_cast<size_t>(per_node) * spec_.nodes + n_leaves_ + 1);
  for (int node = 0; node < spec_.nodes; ++node) {
    auto add = [&](VertexKind kind, const char* what, int i) {
      vertices_.push_back({kind, node, i < 0 ? str_cat("n", node, ".", what) : str_cat("n", node, ".", what, i)});
    };
    for (int i = 0; i < D; ++i) add(VertexKind::device, "gpu", i);
    for (int k = 0; k < K; ++k) add(VertexKind::pcie_switch, "pcie", k);
    for (int s = 0; s < S; ++s) add(VertexKind::socket, "cpu", s);
    if (nvswitch) add(VertexKind::nvswitch, "nvswitch", -1);
    for (int k = 0; k < N; ++k) add(VertexKind::nic, "nic", k);
  }
  const int first_leaf = static_cast<int>(vertices_.size());
  if (N > 0) {
    for (int l = 0; l < n_leaves_; ++l) vertices_.push_back({VertexKind::leaf, -1, str_cat("leaf", l)});
    if (n_leaves_ > 1) vertices_.push_back({VertexKind::spine, -1, "spine"});
  }
  const int spine = first_leaf + n_leaves_;

  // Links, node by node in the same order, so that a link's id is node * count + its node-local id.
  NodeLinks& L = local_;
  L.dev_to_sw.resize(D);
  L.sw_to_dev.resize(D);
  L.sw_to_cpu.resize(K);
  L.cpu_to_sw.resize(K);
  L.cpu_to_cpu.assign(static_cast<size_t>(S) * S, -1);
  L.dev_to_dev.assign(static_cast<size_t>(D) * D, -1);
  L.dev_to_nvs.assign(nvswitch ? D : 0, -1);
  L.nvs_to_dev.assign(nvswitch ? D : 0, -1);
  L.nic_to_sw.resize(N);
  L.sw_to_nic.resize(N);
  L.nic_to_leaf.resize(N);
  L.leaf_to_nic.resize(N);
  for (int node = 0; node < spec_.nodes; ++node) {
    const int v0 = node * per_node;
    const int dev = v0, sw = v0 + D, cpu = sw + K, nvs = cpu + S, nic = nvs + (nvswitch ? 1 : 0);
    const int link0 = static_cast<int>(links_.size());
    auto add = [&](int from, int to, LinkKind kind, double bandwidth, double latency) {
      links_.push_back({from, to, kind, bandwidth, latency});
      return static_cast<int>(links_.size()) - 1 - link0;
    };
    for (int i = 0; i < D; ++i) {
      const LinkSpec& l = n.device_pcie;
      L.dev_to_sw[i] = add(dev + i, sw + n.device_switch[i], LinkKind::pcie, l.bandwidth, l.latency);
      L.sw_to_dev[i] = add(sw + n.device_switch[i], dev + i, LinkKind::pcie, l.bandwidth, l.latency);
    }
    for (int k = 0; k < K; ++k) {
      const LinkSpec& l = n.switch_uplink;
      L.sw_to_cpu[k] = add(sw + k, cpu + n.switch_socket[k], LinkKind::pcie, l.bandwidth, l.latency);
      L.cpu_to_sw[k] = add(cpu + n.switch_socket[k], sw + k, LinkKind::pcie, l.bandwidth, l.latency);
    }
    for (int s = 0; s < S; ++s) {
      for (int t = 0; t < S; ++t) {
        if (s != t) {
          L.cpu_to_cpu[s * S + t] =
              add(cpu + s, cpu + t, LinkKind::socket, n.socket_link.bandwidth, n.socket_link.latency);
        }
      }
    }
    if (n.interconnect == Interconnect::nvlink) {
      for (int i = 0; i < D; ++i) {
        for (int j = i + 1; j < D; ++j) {
          const int count = n.nvlink_links[i][j];
          if (count == 0) continue;
          // The bundle of `count` links between a pair carries count times one link's bandwidth.
          const double bw = count * n.nvlink.bandwidth;
          L.dev_to_dev[i * D + j] = add(dev + i, dev + j, LinkKind::nvlink, bw, n.nvlink.latency);
          L.dev_to_dev[j * D + i] = add(dev + j, dev + i, LinkKind::nvlink, bw, n.nvlink.latency);
        }
      }
    }
    if (nvswitch) {
      const double bw = n.nvswitch_links * n.nvlink.bandwidth;
      for (int i = 0; i < D; ++i) {
        L.dev_to_nvs[i] = add(dev + i, nvs, LinkKind::nvlink, bw, n.nvlink.latency);
        L.nvs_to_dev[i] = add(nvs, dev + i, LinkKind::nvlink, bw, n.nvlink.latency);
      }
    }
    const int leaf = first_leaf + leaf_of(node);
    for (int k = 0; k < N; ++k) {
      const LinkSpec& p = n.nic_pcie;
      const LinkSpec& q = n.nic_port;
      L.nic_to_sw[k] = add(nic + k, sw + n.nic_switch[k], LinkKind::pcie, p.bandwidth, p.latency);
      L.sw_to_nic[k] = add(sw + n.nic_switch[k], nic + k, LinkKind::pcie, p.bandwidth, p.latency);
      L.nic_to_leaf[k] = add(nic + k, leaf, LinkKind::nic_port, q.bandwidth, q.latency);
      L.leaf_to_nic[k] = add(leaf, nic + k, LinkKind::nic_port, q.bandwidth, q.latency);
    }
    L.count = static_cast<int>(links_.size()) - link0;
  }
  fabric_base_ = static_cast<int>(links_.size());
  if (N > 0 && n_leaves_ > 1) {
    const double uplink = static_cast<double>(npl) * N * n.nic_port.bandwidth / spec_.fabric.oversubscription;
    for (int l = 0; l < n_leaves_; ++l) {
      links_.push_back({first_leaf + l, spine, LinkKind::fabric, uplink, spec_.fabric.uplink_latency});
      links_.push_back({spine, first_leaf + l, LinkKind::fabric, uplink, spec_.fabric.uplink_latency});
    }
  }

  // Each device's NIC: the nearest ones on the PCIe tree, shared round-robin by the devices of a switch.
  if (N > 0) {
    nic_of_local_.resize(D);
    for (int i = 0; i < D; ++i) {
      const int sw_i = n.device_switch[i];
      auto distance = [&](int k) {
        const int sw_k = n.nic_switch[k];
        if (sw_k == sw_i) return 0;
        return n.switch_socket[sw_k] == n.switch_socket[sw_i] ? 1 : 2;
      };
      int best = 2;
      for (int k = 0; k < N; ++k) best = std::min(best, distance(k));
      std::vector<int> nearest;
      for (int k = 0; k < N; ++k) {
        if (distance(k) == best) nearest.push_back(k);
      }
      int before = 0;
      for (int j = 0; j < i; ++j) before += n.device_switch[j] == sw_i ? 1 : 0;
      nic_of_local_[i] = nearest[before % nearest.size()];
    }
  }
}

int Cluster::node_of(int device) const {
  if (device < 0 || device >= n_devices()) {
    throw std::logic_error(str_cat("sim::Cluster: device ", device, " out of range"));
  }
  return device / spec_.node.devices;
}

int Cluster::local_index(int device) const { return device - node_of(device) * spec_.node.devices; }

int Cluster::nic_of(int device) const {
  const int i = local_index(device);
  if (nic_of_local_.empty()) throw std::logic_error("sim::Cluster::nic_of: the node has no NICs");
  return nic_of_local_[i];
}

int Cluster::leaf_of(int node) const {
  const int npl = spec_.fabric.nodes_per_leaf;
  return npl == 0 ? 0 : node / npl;
}

std::string Cluster::link_name(int link) const {
  if (link < 0 || link >= n_links()) {
    throw std::logic_error(str_cat("sim::Cluster::link_name: link ", link, " out of range"));
  }
  const Link& l = links_[link];
  return str_cat(vertices_[l.from].name, "->", vertices_[l.to].name);
}

void Cluster::pcie_path(int node, int sa, int sb, std::vector<int>* path) const {
  if (sa == sb) return;
  const std::vector<int>& socket = spec_.node.switch_socket;
  path->push_back(global(node, local_.sw_to_cpu[sa]));
  if (socket[sa] != socket[sb]) {
    path->push_back(global(node, local_.cpu_to_cpu[socket[sa] * spec_.node.sockets + socket[sb]]));
  }
  path->push_back(global(node, local_.cpu_to_sw[sb]));
}

std::vector<int> Cluster::route(int a, int b) const {
  std::vector<int> path;
  route(a, b, &path);
  return path;
}

void Cluster::route(int a, int b, std::vector<int>* out) const {
  std::vector<int>& path = *out;
  path.clear();
  const int na = node_of(a), nb = node_of(b);
  if (a == b) return;
  const NodeSpec& n = spec_.node;
  const int D = n.devices;
  const int ia = a - na * D, ib = b - nb * D;
  if (na == nb) {
    if (n.interconnect == Interconnect::nvlink && local_.dev_to_dev[ia * D + ib] >= 0) {
      path.push_back(global(na, local_.dev_to_dev[ia * D + ib]));
    } else if (n.interconnect == Interconnect::nvswitch) {
      path.push_back(global(na, local_.dev_to_nvs[ia]));
      path.push_back(global(na, local_.nvs_to_dev[ib]));
    } else {
      path.push_back(global(na, local_.dev_to_sw[ia]));
      pcie_path(na, n.device_switch[ia], n.device_switch[ib], &path);
      path.push_back(global(na, local_.sw_to_dev[ib]));
    }
    return;
  }
  const int ka = nic_of_local_[ia], kb = nic_of_local_[ib];
  path.push_back(global(na, local_.dev_to_sw[ia]));
  pcie_path(na, n.device_switch[ia], n.nic_switch[ka], &path);
  path.push_back(global(na, local_.sw_to_nic[ka]));
  path.push_back(global(na, local_.nic_to_leaf[ka]));
  const int la = leaf_of(na), lb = leaf_of(nb);
  if (la != lb) {
    path.push_back(fabric_base_ + 2 * la);
    path.push_back(fabric_base_ + 2 * lb + 1);
  }
  path.push_back(global(nb, local_.leaf_to_nic[kb]));
  path.push_back(global(nb, local_.nic_to_sw[kb]));
  pcie_path(nb, n.nic_switch[kb], n.device_switch[ib], &path);
  path.push_back(global(nb, local_.sw_to_dev[ib]));
}

double Cluster::path_latency(const std::vector<int>& path) const {
  double sum = 0;
  for (int l : path) sum += links_.at(l).latency;
  return sum;
}

double Cluster::path_bandwidth(const std::vector<int>& path) const {
  double bw = std::numeric_limits<double>::infinity();
  for (int l : path) bw = std::min(bw, links_.at(l).bandwidth);
  return bw;
}

}  // namespace moe::sim
