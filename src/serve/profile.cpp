#include "serve/profile.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "model/data.h"
#include "runtime/measure_costs.h"
#include "runtime/train_config.h"

namespace moe::serve {

Status profile_routing(InferenceEngine& engine, comm::Communicator* world, const std::string& corpus,
                       int64_t windows, plan::PathProfile* out) {
  const ModelConfig& cfg = engine.config();
  const int64_t T = std::min(cfg.seq_len, engine.max_rows()), K = cfg.top_k, Lm = engine.moe_blocks();
  DataOptions o;
  o.seq_len = T;
  o.suffix = corpus.empty() ? kDefaultCorpusSuffix : "";
  TextDataset data;
  if (Status s = TextDataset::open(corpus.empty() ? kDefaultCorpus : corpus, o, &data); !s)
    return Status::error("lina profile: " + s.message());
  const std::vector<uint8_t>& text = data.train_data();
  const int R = world ? world->size() : 1, me = world ? world->rank() : 0;
  const int64_t per_rank = (windows + R - 1) / R, stride = (static_cast<int64_t>(text.size()) - T) / (per_rank * R);
  std::vector<int64_t> mine;  // [tokens][Lm*K + Lm]: chosen experts, then first choices
  std::vector<Row> rows(T);
  for (int64_t i = 0; i < per_rank; ++i) {
    const int64_t at = (i * R + me) * stride;
    for (int64_t t = 0; t < T; ++t) rows[t] = {0, static_cast<int32_t>(t), text[at + t], false};
    engine.forward(rows, nullptr);
    const std::vector<int32_t>& routes = engine.last_routes();
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < Lm * K; ++j) mine.push_back(routes[t * Lm * K + j]);
      for (int64_t j = 0; j < Lm; ++j) mine.push_back(routes[t * Lm * K + j * K]);
    }
  }
  std::vector<int64_t> all = mine;
  if (world) {
    // Every rank ran per_rank windows of T tokens: equal contributions.
    const int64_t n = static_cast<int64_t>(mine.size());
    all.resize(n * R);
    if (Status s = world->allgather(mine.data(), n, all.data()); !s) return s;
  }
  const int64_t width = Lm * K + Lm;
  std::vector<int32_t> chosen(Lm * K), first(Lm);
  for (size_t t = 0; t + width <= all.size(); t += width) {
    for (int64_t j = 0; j < Lm * K; ++j) chosen[j] = static_cast<int32_t>(all[t + j]);
    for (int64_t j = 0; j < Lm; ++j) first[j] = static_cast<int32_t>(all[t + Lm * K + j]);
    out->add(first, chosen);
  }
  return Status::ok();
}

Status measure_lina_cost(InferenceEngine& engine, comm::Communicator* world, plan::LinaCost* out) {
  const ModelConfig& cfg = engine.config();
  const int R = world ? world->size() : 1;
  plan::Nodes nodes;  // one class of link: whatever joins the ranks is what a gather crosses
  nodes.node_of_rank.assign(R, 0);
  runtime::RawCosts mine, agreed;
  if (Status s = runtime::measure_links(world, nodes, /*quick=*/false, &mine); !s)
    return Status::error("lina cost: " + s.message());
  if (Status s = runtime::agree_costs(world, mine, &agreed); !s) return Status::error("lina cost: " + s.message());
  // An expert's time at 1, 2, 4, ... rows up to a prefill's rows per expert (a full batch's rows x K / E).
  const int64_t most = std::max<int64_t>(2, engine.max_rows() * cfg.top_k / cfg.n_experts);
  std::vector<int64_t> rows;
  for (int64_t n = 1; n < most; n *= 2) rows.push_back(n);
  rows.push_back(most);
  std::vector<double> seconds = engine.measure_expert_seconds(rows);
  if (world) {
    if (Status s = world->allreduce(seconds.data(), static_cast<int64_t>(seconds.size())); !s)
      return Status::error("lina cost: " + s.message());
    for (double& t : seconds) t /= R;
  }
  for (size_t j = 1; j < seconds.size(); ++j) seconds[j] = std::max(seconds[j], seconds[j - 1]);
  const double mats = cfg.activation == "swiglu" ? 3 : 2;
  const double expert_bytes = mats * static_cast<double>(cfg.d_model * cfg.d_ffn) * sizeof(float);
  const double bandwidth = agreed.intra_node.bandwidth;
  if (!(seconds.front() > 0) || (R > 1 && !(bandwidth > 0)))
    return Status::error("lina cost: the measurement gave no expert time or no link bandwidth");
  out->rows.assign(rows.begin(), rows.end());
  out->seconds = std::move(seconds);
  out->move_seconds = R > 1 ? agreed.intra_node.latency + expert_bytes / bandwidth : 0;
  return Status::ok();
}

Status start_schedule(InferenceEngine& engine, comm::Communicator* world, const std::string& name,
                      const std::string& corpus, int replica_cache, std::unique_ptr<plan::PathProfile>* profile) {
  Schedule s;
  if (!parse_schedule(name, &s))
    return Status::error("--schedule '" + name + "' is not ep, lina, lina-no-estimate, lina-no-phase2 or ideal");
  if (s == Schedule::lina || s == Schedule::lina_no_phase2) {
    *profile = std::make_unique<plan::PathProfile>(engine.moe_blocks(), engine.config().n_experts);
    if (Status st = profile_routing(engine, world, corpus, 64, profile->get()); !st) return st;
    engine.reset_counters();  // the profile's forwards are not serving's (/metrics, bench serve)
  }
  engine.set_schedule(s, profile->get(), world);
  if (s == Schedule::ep || s == Schedule::ideal || !world || world->size() == 1) return Status::ok();
  plan::LinaCost cost;
  if (Status st = measure_lina_cost(engine, world, &cost); !st) return st;
  engine.set_lina_cost(cost);
  engine.set_replica_cache(replica_cache >= 0 ? replica_cache
                                              : static_cast<int>(engine.config().n_experts / world->size()));
  if (world->rank() == 0) {
    std::string curve;
    char point[64];
    for (size_t j = 0; j < cost.rows.size(); ++j) {
      if (j % 2 == 1 && j + 1 < cost.rows.size()) continue;  // every other point, and the last
      std::snprintf(point, sizeof point, "%s%g rows %.0f us", curve.empty() ? "" : ", ", cost.rows[j],
                    cost.seconds[j] * 1e6);
      curve += point;
    }
    std::fprintf(stderr, "lina cost (measured): an expert on a rank %s; its weights moved %.1f us; replica cache "
                 "%d per rank and MoE layer\n", curve.c_str(), cost.move_seconds * 1e6, engine.replica_cache());
  }
  return Status::ok();
}

}  // namespace moe::serve
