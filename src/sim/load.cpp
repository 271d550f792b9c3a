// Synthetic and recorded loads, and the EP graph's run-time sizes from a load (load.h).
#include "sim/load.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "util/str_cat.h"

namespace moe::sim {

namespace {

using graph::OpKind;

bool parse_number(const std::string& text, double* out) {
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    if (used != text.size() || !std::isfinite(v)) return false;
    *out = v;
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// Splits `total` into parts proportional to `weights` (sum > 0) by largest remainder, ties to the
// lower index, no part above `cap` (the excess goes to the others in proportion to their weights).
std::vector<int64_t> apportion(int64_t total, std::vector<double> weights, int64_t cap) {
  const size_t n = weights.size();
  std::vector<int64_t> out(n, 0);
  std::vector<char> capped(n, 0);
  int64_t left = total;
  // Water-fill the caps: an expert whose share exceeds the cap gets the cap and leaves the pool.
  for (bool again = true; again;) {
    again = false;
    double wsum = 0;
    for (size_t i = 0; i < n; ++i)
      if (!capped[i]) wsum += weights[i];
    if (wsum <= 0) break;
    for (size_t i = 0; i < n; ++i) {
      if (capped[i] || static_cast<double>(left) * weights[i] / wsum <= static_cast<double>(cap)) continue;
      capped[i] = 1;
      out[i] = cap;
      left -= cap;
      again = true;
      break;  // shares of the rest changed: recompute
    }
  }
  double wsum = 0;
  for (size_t i = 0; i < n; ++i)
    if (!capped[i]) wsum += weights[i];
  if (wsum <= 0 || left <= 0) return out;
  std::vector<std::pair<double, size_t>> rem;
  int64_t given = 0;
  for (size_t i = 0; i < n; ++i) {
    if (capped[i]) continue;
    const double exact = static_cast<double>(left) * weights[i] / wsum;
    out[i] = static_cast<int64_t>(std::floor(exact));
    given += out[i];
    rem.emplace_back(-(exact - std::floor(exact)), i);
  }
  std::sort(rem.begin(), rem.end());
  for (size_t k = 0; given < left && k < rem.size(); ++k, ++given) ++out[rem[k].second];
  return out;
}

}  // namespace

Status LoadSpec::parse(const std::string& text, LoadSpec* out) {
  LoadSpec s;
  auto bad = [&](const std::string& why) { return Status::error(str_cat("load \"", text, "\": ", why)); };
  if (text == "uniform") {
    s.kind = Kind::uniform;
  } else if (text.rfind("zipf:", 0) == 0) {
    s.kind = Kind::zipf;
    if (!parse_number(text.substr(5), &s.s) || s.s < 0) return bad("the Zipf exponent must be a number >= 0");
  } else if (text.rfind("zipf-drift:", 0) == 0) {
    s.kind = Kind::zipf_drift;
    std::string rest = text.substr(11);
    const size_t comma = rest.find(',');
    if (comma != std::string::npos) {
      if (!parse_number(rest.substr(comma + 1), &s.rate) || !(s.rate > 0))
        return bad("the drift rate (experts per step) must be a number > 0");
      rest = rest.substr(0, comma);
    }
    if (!parse_number(rest, &s.s) || s.s < 0) return bad("the Zipf exponent must be a number >= 0");
  } else if (text.empty()) {
    return bad("expected uniform, zipf:S, zipf-drift:S[,RATE] or a metrics .jsonl file");
  } else {
    s.kind = Kind::recorded;
    s.file = text;
  }
  *out = s;
  return Status::ok();
}

std::string LoadSpec::describe() const {
  switch (kind) {
    case Kind::uniform: return "uniform";
    case Kind::zipf: return str_cat("zipf:", s);
    case Kind::zipf_drift: return str_cat("zipf-drift:", s, ",", rate);
    case Kind::recorded: return str_cat("recorded ", file);
  }
  return "?";
}

Status Load::make(const LoadSpec& spec, const ModelConfig& cfg, int ranks, int64_t tokens_per_rank, Load* out) {
  if (Status s = cfg.validate(); !s) return s;
  if (ranks < 1 || tokens_per_rank < 1) return Status::error("load: ranks and tokens per rank must be >= 1");
  Load l;
  l.spec_ = spec;
  l.cfg_ = cfg;
  l.ranks_ = ranks;
  l.tokens_ = tokens_per_rank;
  for (int64_t b = 0; b < cfg.n_layers; ++b)
    if (cfg.is_moe_layer(b)) l.moe_blocks_.push_back(static_cast<int>(b));
  l.moe_layers_ = static_cast<int>(l.moe_blocks_.size());
  if (spec.kind == LoadSpec::Kind::recorded) {
    // A layer's counts sum to one step's assignments (tokens x top_k over every rank: millions). The
    // bound keeps what fill_ep_costs makes of them, 4 * d_model * rows with rows up to n_experts
    // times a count (padded exchange), inside int64; it is above 2^28 for the largest valid model.
    const int64_t max_layer_count = (int64_t{1} << 60) / (cfg.d_model * cfg.n_experts);
    std::ifstream in(spec.file);
    if (!in) return Status::error(str_cat("load: cannot read ", spec.file));
    std::string line;
    for (int64_t n = 1; std::getline(in, line); ++n) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        return Status::error(str_cat("load: ", spec.file, " line ", n, ": not JSON (", e.what(), ")"));
      }
      if (!j.is_object() || !j.contains("tokens_per_expert")) continue;  // validation lines etc.
      // Element by element, not get<std::vector<std::vector<int64_t>>>(): that converts a float
      // (1e300) to int64 with undefined behaviour instead of failing.
      const nlohmann::json& recorded = j.at("tokens_per_expert");
      bool integers = recorded.is_array();
      for (size_t i = 0; integers && i < recorded.size(); ++i)
        integers = recorded[i].is_array() && std::all_of(recorded[i].begin(), recorded[i].end(),
                                                          [](const nlohmann::json& c) { return c.is_number_integer(); });
      if (!integers)
        return Status::error(str_cat("load: ", spec.file, " line ", n, ": tokens_per_expert is not a list of lists of integers"));
      std::vector<std::vector<int64_t>> layers = recorded.get<std::vector<std::vector<int64_t>>>();
      if (static_cast<int>(layers.size()) != l.moe_layers_)
        return Status::error(str_cat("load: ", spec.file, " line ", n, " has ", layers.size(),
                                     " MoE layers, the model has ", l.moe_layers_));
      for (const auto& counts : layers) {
        if (static_cast<int64_t>(counts.size()) != cfg.n_experts)
          return Status::error(str_cat("load: ", spec.file, " line ", n, " has ", counts.size(),
                                       " experts per layer, the model has ", cfg.n_experts));
        int64_t total = 0;
        for (int64_t c : counts) {
          if (c < 0) return Status::error(str_cat("load: ", spec.file, " line ", n, ": a negative count"));
          if (__builtin_add_overflow(total, c, &total) || total > max_layer_count)
            return Status::error(str_cat("load: ", spec.file, " line ", n, ": a layer's counts sum to more than ",
                                         max_layer_count, " assignments, more than one step of any run"));
        }
      }
      std::vector<std::vector<int64_t>> sources;  // [layer][r * E + e]
      if (j.contains("tokens_per_source") && !j.at("tokens_per_source").empty()) {
        const nlohmann::json& src = j.at("tokens_per_source");
        bool ok = src.is_array() && static_cast<int>(src.size()) == l.moe_layers_;
        for (size_t i = 0; ok && i < src.size(); ++i) {
          ok = src[i].is_array() && !src[i].empty();
          for (size_t r = 0; ok && r < src[i].size(); ++r)
            ok = src[i][r].is_array() && static_cast<int64_t>(src[i][r].size()) == cfg.n_experts &&
                 src[i][r].size() == src[i][0].size() && src[i].size() == src[0].size() &&
                 std::all_of(src[i][r].begin(), src[i][r].end(), [&](const nlohmann::json& c) {
                   return c.is_number_integer() && c.get<int64_t>() >= 0 && c.get<int64_t>() <= max_layer_count;
                 });
        }
        if (!ok)
          return Status::error(str_cat("load: ", spec.file, " line ", n, ": tokens_per_source is not [", l.moe_layers_,
                                       " layers][ranks][", cfg.n_experts, " experts] of counts in [0, ", max_layer_count, "]"));
        if (static_cast<int>(src[0].size()) == ranks)
          for (const nlohmann::json& layer : src) {
            std::vector<int64_t> flat;
            for (const nlohmann::json& rank : layer)
              for (const nlohmann::json& c : rank) flat.push_back(c.get<int64_t>());
            sources.push_back(std::move(flat));
          }
      }
      l.recorded_.push_back(std::move(layers));
      l.recorded_source_.push_back(std::move(sources));
    }
    if (l.recorded_.empty())
      return Status::error(str_cat("load: ", spec.file, " has no line with \"tokens_per_expert\" (a `moe train --metrics` file?)"));
  }
  *out = std::move(l);
  return Status::ok();
}

StepLoad Load::step(int64_t step) const {
  if (step < 0) throw std::logic_error("sim::Load::step: step must be >= 0");
  const int64_t E = cfg_.n_experts, K = cfg_.top_k, N = tokens_;
  const int R = ranks_;
  StepLoad out(moe_layers_, std::vector<int64_t>(static_cast<size_t>(R) * E, 0));
  for (int i = 0; i < moe_layers_; ++i) {
    std::vector<int64_t>& t = out[i];
    if (spec_.kind == LoadSpec::Kind::recorded) {
      const std::vector<std::vector<int64_t>>& sources = recorded_source_[step % recorded_.size()];
      if (!sources.empty()) {
        t = sources[i];
        continue;
      }
      const std::vector<int64_t>& global = recorded_[step % recorded_.size()][i];
      for (int r = 0; r < R; ++r)
        for (int64_t e = 0; e < E; ++e) t[r * E + e] = global[e] / R + (r < global[e] % R ? 1 : 0);
      continue;
    }
    if (spec_.kind == LoadSpec::Kind::uniform) {
      for (int r = 0; r < R; ++r)
        for (int64_t e = 0; e < E; ++e) t[r * E + e] = N * K / E + (((e - r) % E + E) % E < (N * K) % E ? 1 : 0);
    } else {
      const int64_t shift =
          spec_.kind == LoadSpec::Kind::zipf_drift ? static_cast<int64_t>(std::floor(spec_.rate * step)) : 0;
      std::vector<double> w(E);
      for (int64_t j = 0; j < E; ++j) w[(moe_blocks_[i] + j + shift) % E] = 1.0 / std::pow(j + 1.0, spec_.s);
      const std::vector<int64_t> per_rank = apportion(N * K, w, N);
      for (int r = 0; r < R; ++r) std::copy(per_rank.begin(), per_rank.end(), t.begin() + r * E);
    }
    if (cfg_.capacity_factor > 0) {
      const int64_t cap = static_cast<int64_t>(std::ceil(cfg_.capacity_factor * static_cast<double>(N * R * K) / E));
      for (int64_t e = 0; e < E; ++e) {
        int64_t left = cap;
        for (int r = 0; r < R; ++r) {
          int64_t& c = t[r * E + e];
          c = std::min(c, left);
          left -= c;
        }
      }
    }
  }
  return out;
}

std::vector<std::vector<int>> op_exchange_chunks(const graph::Op& op, const plan::LayerPlacement& holders) {
  const bool chunked = op.n_micro > 1 && (op.kind == OpKind::dispatch_a2a || op.kind == OpKind::expert_fwd);
  return chunked ? plan::exchange_chunks(holders, op.n_micro) : std::vector<std::vector<int>>{};
}

void fill_ep_costs(const ModelConfig& cfg, const graph::EpStepOptions& opt, const StepLoad& load, int rank,
                   graph::StepGraph* g) {
  if (graph::gathers_replicas(opt)) throw std::logic_error("sim::fill_ep_costs: placement options are not modeled");
  const int R = opt.world, G = opt.ep_size;
  const int64_t E = cfg.n_experts, C = cfg.d_model, F = cfg.d_ffn, K = cfg.top_k, El = E / G;
  const int64_t N = opt.batch * cfg.seq_len;
  if (rank < 0 || rank >= R) throw std::logic_error("sim::fill_ep_costs: rank out of range");
  std::vector<int> moe_index(cfg.n_layers, -1);
  int n_moe = 0;
  for (int64_t b = 0; b < cfg.n_layers; ++b)
    if (cfg.is_moe_layer(b)) moe_index[b] = n_moe++;
  if (static_cast<int>(load.size()) != n_moe)
    throw std::logic_error(str_cat("sim::fill_ep_costs: load has ", load.size(), " layers, the model ", n_moe));
  for (const auto& t : load)
    if (static_cast<int64_t>(t.size()) != R * E) throw std::logic_error("sim::fill_ep_costs: load of the wrong size");
  const int group0 = rank / G * G, me = rank % G;
  const double mats = cfg.activation == "swiglu" ? 3 : 2;
  constexpr int64_t kFloat = sizeof(float);
  for (graph::Op& op : g->ops) {
    if (op.layer < 0 || moe_index[op.layer] < 0 || R == 1) continue;
    const std::vector<int64_t>& t = load[moe_index[op.layer]];
    // Padded (DeepSpeed-MoE's fixed-size exchange, MoeLayer::set_padded_exchange): every rank sends
    // each expert the group's largest (rank, expert) count of rows.
    int64_t slots = 0;
    if (opt.padded_exchange)
      for (int j = 0; j < G; ++j)
        for (int64_t e = 0; e < E; ++e) slots = std::max(slots, t[(group0 + j) * E + e]);
    const std::vector<std::vector<int>> chunk = op_exchange_chunks(op, plan::even_placement(static_cast<int>(E), G));
    auto in_chunk = [&](int j, int64_t e) { return chunk.empty() || chunk[j][e] == op.micro; };
    // Rows this rank sends to ep rank j, and rows ep rank j sends here.
    auto sent = [&](int j) {
      int64_t rows = 0;
      for (int64_t e = j * El; e < (j + 1) * El; ++e)
        if (in_chunk(j, e)) rows += opt.padded_exchange ? slots : t[rank * E + e];
      return rows;
    };
    auto received = [&](int j) {
      int64_t rows = 0;
      for (int64_t e = me * El; e < (me + 1) * El; ++e)
        if (in_chunk(me, e)) rows += opt.padded_exchange ? slots : t[(group0 + j) * E + e];
      return rows;
    };
    auto exchange = [&](bool to_experts) {
      op.cost.peer_bytes.assign(G, 0);
      op.cost.bytes = 0;
      for (int j = 0; j < G; ++j) {
        op.cost.peer_bytes[j] = kFloat * C * (to_experts ? sent(j) : received(j));
        op.cost.bytes += op.cost.peer_bytes[j];
      }
    };
    auto expert = [&](double passes, double balanced_bytes) {
      int64_t rows = 0;
      for (int j = 0; j < G; ++j) rows += received(j);
      op.cost.flops = passes * 2 * mats * static_cast<double>(rows) * static_cast<double>(C) * static_cast<double>(F);
      op.cost.bytes = static_cast<int64_t>(std::llround(balanced_bytes * static_cast<double>(rows) /
                                                        static_cast<double>(N * K)));
    };
    const double NKd = static_cast<double>(N * K);
    switch (op.kind) {
      case OpKind::dispatch_a2a:
      case OpKind::combine_a2a_bwd: exchange(true); break;
      case OpKind::combine_a2a:
      case OpKind::dispatch_a2a_bwd: exchange(false); break;
      // The builder's balanced estimates (ep_builder.cpp), scaled.
      case OpKind::expert_fwd: expert(1, 4 * NKd * (4.0 * C + 3.0 * F)); break;
      case OpKind::expert_bwd: expert(2, 8 * NKd * (4.0 * C + 3.0 * F)); break;
      case OpKind::gate_sync: op.cost.bytes = 8 * K * E; break;
      default: break;
    }
  }
}

}  // namespace moe::sim
