#include "serve/profile.h"

#include <vector>

#include "model/data.h"
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

Status start_schedule(InferenceEngine& engine, comm::Communicator* world, const std::string& name,
                      const std::string& corpus, std::unique_ptr<plan::PathProfile>* profile) {
  Schedule s;
  if (!parse_schedule(name, &s))
    return Status::error("--schedule '" + name + "' is not ep, lina, lina-no-estimate, lina-no-phase2 or ideal");
  if (s == Schedule::lina || s == Schedule::lina_no_phase2) {
    *profile = std::make_unique<plan::PathProfile>(engine.moe_blocks(), engine.config().n_experts);
    if (Status st = profile_routing(engine, world, corpus, 64, profile->get()); !st) return st;
  }
  engine.set_schedule(s, profile->get(), world);
  return Status::ok();
}

}  // namespace moe::serve
