// Inference (src/serve) against references: the KV-cache decode against the training forward run on
// the whole prefix; sequences batched together against each alone; the sampler against the softmax
// it samples from; `moe generate` through the real binary on 1, 2 and 4 ranks, and its errors;
// `moe serve` on 2 ranks under concurrent HTTP requests against `moe generate`'s answers.
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "comm/mpi_communicator.h"
#include "model/model.h"
#include "serve/engine.h"
#include "serve/job.h"
#include "serve/lockstep.h"
#include "serve/profile.h"
#include "serve/sampler.h"
#include "serve/server.h"
#include "util/quantile.h"
#include "util/shell.h"

#include <httplib.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <thread>

namespace fs = std::filesystem;
using moe::Model;
using moe::ModelConfig;
using moe::serve::InferenceEngine;
using moe::serve::Row;

namespace {

ModelConfig small_config(bool swiglu_rms_dense) {
  ModelConfig c;
  c.seq_len = 24;
  c.d_model = 32;
  c.n_layers = 3;
  c.n_heads = 4;
  c.d_ffn = 48;
  c.n_experts = 4;
  c.top_k = 2;
  c.router_skew = 1.0;
  if (swiglu_rms_dense) {
    c.activation = "swiglu";
    c.norm = "rmsnorm";
    c.dense_every_other = true;
  }
  return c;
}

// Largest |a - b| / max(1, |b|) over n values; NaN/Inf anywhere counts as infinite.
double max_rel_diff(const float* a, const float* b, int64_t n) {
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    worst = std::max(worst, std::abs(double(a[i]) - b[i]) / std::max(1.0, std::abs(double(b[i]))));
  }
  return worst;
}

std::vector<int32_t> some_tokens(int64_t n, uint32_t seed) {
  std::vector<int32_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>((seed * 2654435761u + i * 40503u) % 256);
  return t;
}

class Decode : public ::testing::TestWithParam<bool> {};

// Prefill a prompt, then decode token by token (greedy); at every step the logits equal those of the
// training forward over the whole prefix (no cache), up to the float rounding of GEMMs over a
// different number of rows.
TEST_P(Decode, KvCacheDecodeEqualsRecomputingThePrefix) {
  const ModelConfig cfg = small_config(GetParam());
  const int64_t T = cfg.seq_len, V = cfg.vocab_size;
  Model model(cfg, 1);
  model.init(11);
  InferenceEngine engine(model, 2, T);
  std::vector<int32_t> tokens = some_tokens(5, 7);
  std::vector<Row> rows;
  for (int32_t i = 0; i < 5; ++i) rows.push_back({1, i, tokens[i], i == 4});
  std::vector<float> logits(V);
  engine.forward(rows, logits.data());
  double worst = 0;
  for (int64_t pos = 5; pos < T; ++pos) {
    model.forward(tokens.data(), nullptr, 1, pos);
    const double d = max_rel_diff(logits.data(), model.logits() + (pos - 1) * V, V);
    worst = std::max(worst, d);
    ASSERT_LT(d, 1e-4) << "logits of position " << pos - 1;
    const int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    tokens.push_back(next);
    const Row decode{1, static_cast<int32_t>(pos), next, true};
    engine.forward({&decode, 1}, logits.data());
  }
  std::printf("KV-cache decode vs full recompute, %lld positions: max relative logit diff %.3g\n",
              static_cast<long long>(T - 5), worst);
}

INSTANTIATE_TEST_SUITE_P(Configs, Decode, ::testing::Values(false, true), [](const auto& info) {
  return info.param ? std::string("SwigluRmsnormDenseEveryOther") : std::string("GeluLayernorm");
});

// Two sequences in one forward (one prefilling while the other decodes: continuous batching) give
// each the logits it gets alone, up to GEMM rounding over more rows.
TEST(Batching, RaggedRowsOfSeveralSequencesEqualEachAlone) {
  const ModelConfig cfg = small_config(false);
  const int64_t V = cfg.vocab_size;
  Model model(cfg, 2);
  model.init(5);
  const std::vector<int32_t> a = some_tokens(9, 1), b = some_tokens(6, 2);
  // Alone: a's 9 tokens in slot 0 of one engine, b's 6 in slot 0 of another.
  auto alone = [&](const std::vector<int32_t>& t) {
    InferenceEngine e(model, 1, cfg.seq_len);
    std::vector<Row> rows;
    for (int32_t i = 0; i < static_cast<int32_t>(t.size()); ++i) rows.push_back({0, i, t[i], true});
    std::vector<float> out(t.size() * V);
    e.forward(rows, out.data());
    return out;
  };
  const std::vector<float> la = alone(a), lb = alone(b);
  // Together: a prefills its first 7 tokens; then a decodes tokens 8, 9 while b prefills all 6 in
  // between (a in slot 1, b in slot 0).
  InferenceEngine e(model, 2, 2 * cfg.seq_len);
  std::vector<float> out(9 * V);
  std::vector<Row> rows;
  for (int32_t i = 0; i < 7; ++i) rows.push_back({1, i, a[i], true});
  e.forward(rows, out.data());
  EXPECT_LT(max_rel_diff(out.data(), la.data(), 7 * V), 1e-5);
  rows.clear();
  rows.push_back({1, 7, a[7], true});
  for (int32_t i = 0; i < 6; ++i) rows.push_back({0, i, b[i], true});
  e.forward(rows, out.data());
  EXPECT_LT(max_rel_diff(out.data(), la.data() + 7 * V, V), 1e-5);
  EXPECT_LT(max_rel_diff(out.data() + V, lb.data(), 6 * V), 1e-5);
  const Row last{1, 8, a[8], true};
  e.forward({&last, 1}, out.data());
  EXPECT_LT(max_rel_diff(out.data(), la.data() + 8 * V, V), 1e-5);
}

// The replica cache (InferenceEngine::set_replica_cache) on 2 ranks, as one rank of `mpirun -n 2 <this
// binary>` (MOE_ENGINE_CHILD set; the parent test below starts it). The same batches, each rank its
// own rows, through ep and through lina-no-estimate without a price (every replica the popularity
// asks for is gathered) with the cache off and on, each on its own copy of the model: the logits equal
// ep's up to GEMM rounding (a replica computes an expert's rows in other batches), the cache holds
// replicas the plan does not use, and it gathers fewer bytes than without it.
TEST(EngineChild, ReplicaCacheKeepsTheMathematicsAndGathersLess) {
  if (!std::getenv("MOE_ENGINE_CHILD")) GTEST_SKIP() << "runs under the parent test (MOE_ENGINE_CHILD)";
  std::unique_ptr<moe::comm::MpiSession> session;
  ASSERT_TRUE(moe::comm::MpiSession::start(&session));
  std::unique_ptr<moe::comm::Communicator> world;
  ASSERT_TRUE(session->world(&world));
  ASSERT_EQ(world->size(), 2);
  ModelConfig cfg = small_config(false);
  cfg.router_skew = 0;  // the tokens, not a bias, decide which experts are popular
  const int64_t V = cfg.vocab_size, B = 6, kBatches = 12;
  // Batch i: B rows of one repeated byte (slot i % 2, positions 0..B-1), another byte on each rank and
  // in each batch, so that a few experts are popular and which ones moves from batch to batch.
  auto run = [&](moe::serve::Schedule schedule, int cache, moe::serve::ScheduleStats* stats,
                 moe::serve::StageSeconds* stages = nullptr) {
    Model model(cfg, 2);
    model.init(5);
    model.set_expert_parallel(world.get(), world.get());
    InferenceEngine engine(model, 2, cfg.seq_len);
    engine.set_schedule(schedule, nullptr, world.get());
    engine.set_replica_cache(cache);
    // Lina's replicas take the shares of their expert's tokens that level the ranks, the load its
    // planner prices.
    const bool replicates = schedule != moe::serve::Schedule::ep && schedule != moe::serve::Schedule::ideal;
    const moe::plan::DispatchRule rule =
        replicates ? moe::plan::DispatchRule::balanced : moe::plan::DispatchRule::nearest;
    for (int64_t l = 0; l < cfg.n_layers; ++l) {
      if (moe::MoeLayer* moe = model.moe_layer(l)) {
        EXPECT_EQ(moe->dispatch_rule(), rule) << "block " << l;
      }
    }
    std::vector<float> all;
    for (int64_t i = 0; i < kBatches; ++i) {
      const int32_t byte = static_cast<int32_t>((53 * i + 101 * world->rank() + 7) % 256);
      std::vector<Row> rows;
      for (int32_t j = 0; j < B; ++j) rows.push_back({static_cast<int32_t>(i % 2), j, byte, true});
      std::vector<float> out(B * V);
      engine.forward(rows, out.data());
      all.insert(all.end(), out.begin(), out.end());
      // The forward's expert time block by block, what each block's exchange waits for across ranks.
      const std::vector<double>& blocks = engine.last_block_expert_seconds();
      EXPECT_EQ(static_cast<int64_t>(blocks.size()), engine.moe_blocks());
      double sum = 0;
      for (double s : blocks) {
        EXPECT_GT(s, 0);
        sum += s;
      }
      EXPECT_NEAR(sum, engine.last_stage_seconds().experts, 1e-12);
    }
    if (stats) *stats = engine.schedule_stats();
    if (stages) *stages = engine.stage_seconds();
    return all;
  };
  moe::serve::ScheduleStats ep_stats, ideal_stats;
  moe::serve::StageSeconds ep_stages, lina_stages;
  const std::vector<float> ep = run(moe::serve::Schedule::ep, 0, &ep_stats, &ep_stages);
  (void)run(moe::serve::Schedule::ideal, 0, &ideal_stats);
  // The ranks' expert rows, closed form: each rank's B rows x K choices are the mean (nothing is
  // dropped), in every one of the 3 MoE layers' forwards; the balanced gate spreads each rank's 12
  // choices 3 per expert, so both ranks run 2 experts x 3 x 2 sources = 12 rows: busiest = mean.
  const int64_t layer_forwards = kBatches * cfg.n_layers;
  for (const moe::serve::ScheduleStats* st : {&ep_stats, &ideal_stats}) {
    EXPECT_EQ(st->layer_steps, layer_forwards);
    EXPECT_DOUBLE_EQ(st->mean_rank_rows, static_cast<double>(layer_forwards * B * cfg.top_k));
  }
  EXPECT_EQ(ideal_stats.busiest_rank_rows, layer_forwards * B * cfg.top_k);
  EXPECT_GT(ep_stats.busiest_rank_rows, ep_stats.mean_rank_rows) << "ep left the ranks' loads even: nothing to balance";
  moe::serve::ScheduleStats off, on;
  const std::vector<float> plain = run(moe::serve::Schedule::lina_no_estimate, 0, &off, &lina_stages);
  // Each forward's wall time by stage: every MoE stage ran, the parts fit in the whole, and only a
  // Lina schedule spends time of its own (ep runs MoeLayer::forward, Lina the engine's phases).
  for (const moe::serve::StageSeconds* st : {&ep_stages, &lina_stages}) {
    EXPECT_EQ(st->forwards, kBatches);
    EXPECT_GT(st->experts, 0);
    EXPECT_GT(st->exchange, 0);
    EXPECT_GT(st->gate, 0);
    EXPECT_GT(st->other(), 0);
  }
  EXPECT_EQ(ep_stages.schedule, 0);
  EXPECT_GT(lina_stages.schedule, 0);
  const std::vector<float> cached = run(moe::serve::Schedule::lina_no_estimate, 4, &on);
  const int64_t n = static_cast<int64_t>(ep.size());
  const double d_plain = max_rel_diff(plain.data(), ep.data(), n), d_cached = max_rel_diff(cached.data(), ep.data(), n);
  EXPECT_LT(d_plain, 1e-5);
  EXPECT_LT(d_cached, 1e-5);
  EXPECT_GT(off.replicas, 0) << "the plan placed no replica: nothing to cache";
  EXPECT_EQ(off.cached, 0);
  EXPECT_GT(on.cached, 0) << "no replica was kept while unused";
  EXPECT_LT(on.gathered_bytes, off.gathered_bytes);
  // Priced, the curve follows the experts' own runs: after kRefitForwards forwards, started from a
  // price far off (a second an expert), every rank holds the same refitted curve (the ranks must plan
  // alike), near the kernel's microseconds, with a spread measured from the runs.
  {
    Model model(cfg, 2);
    model.init(5);
    model.set_expert_parallel(world.get(), world.get());
    InferenceEngine engine(model, 2, cfg.seq_len);
    engine.set_schedule(moe::serve::Schedule::lina_no_estimate, nullptr, world.get());
    engine.set_replica_cache(4);
    engine.set_lina_cost(moe::plan::LinaCost{{1, 4, 16}, {1.0, 1.0, 1.0}, 1.0});
    std::vector<float> out(B * V);
    for (int64_t i = 0; i < InferenceEngine::kRefitForwards; ++i) {
      const int32_t byte = static_cast<int32_t>((53 * i + 101 * world->rank() + 7) % 256);
      std::vector<Row> rows;
      for (int32_t j = 0; j < B; ++j) rows.push_back({static_cast<int32_t>(i % 2), j, byte, true});
      engine.forward(rows, out.data());
    }
    const moe::plan::LinaCost& now = *engine.lina_cost();
    ASSERT_EQ(now.seconds.size(), 3u);
    // Each rank's rows of a batch choose 2 of the 4 experts: 6 or 12 rows an expert, the rows the runs
    // pin down (the points between them are drawn towards the prior as well).
    EXPECT_LT(now.expert_seconds(6), 0.01) << "not refitted from the runs";
    EXPECT_LT(now.expert_seconds(12), 0.01) << "not refitted from the runs";
    std::printf("rank %d: refitted price at 6 and 12 rows %.1f and %.1f us, spread %.1f us\n", world->rank(),
                now.expert_seconds(6) * 1e6, now.expert_seconds(12) * 1e6, now.noise_seconds * 1e6);
    EXPECT_GT(now.noise_seconds, 0);
    std::vector<double> lo = now.seconds, hi = now.seconds;
    lo.push_back(now.noise_seconds), hi.push_back(now.noise_seconds);
    ASSERT_TRUE(world->allreduce(lo.data(), static_cast<int64_t>(lo.size()), moe::comm::ReduceOp::min));
    ASSERT_TRUE(world->allreduce(hi.data(), static_cast<int64_t>(hi.size()), moe::comm::ReduceOp::max));
    EXPECT_EQ(lo, hi) << "the ranks refitted different curves";
  }
  std::printf("rank %d: %lld layer forwards; replicas per layer forward %.2f; cache off: gathered %lld bytes, "
              "max rel logit diff to ep %.2e; cache of 4: %.2f unused replicas held per layer forward, gathered "
              "%lld bytes, diff %.2e; busiest rank's expert rows / mean: ep %.2f, cache off %.2f, on %.2f\n",
              world->rank(), static_cast<long long>(on.layer_steps), double(off.replicas) / off.layer_steps,
              static_cast<long long>(off.gathered_bytes), d_plain, double(on.cached) / on.layer_steps,
              static_cast<long long>(on.gathered_bytes), d_cached, ep_stats.busiest_rank_rows / ep_stats.mean_rank_rows,
              off.busiest_rank_rows / off.mean_rank_rows, on.busiest_rank_rows / on.mean_rank_rows);
}

TEST(Engine, ReplicaCacheOnTwoRanks) {
  const moe::ShellResult r = moe::run_shell(
      std::string(moe::kMpirunEnv) + "MOE_ENGINE_CHILD=1 OMP_NUM_THREADS=1 MOE_GEMM=onednn timeout -k 5 240 " +
      std::string(MOE_MPIEXEC) + " -n 2 " + moe::self_exe("") +
      " --gtest_color=no --gtest_filter=EngineChild.ReplicaCacheKeepsTheMathematicsAndGathersLess 2>&1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[  PASSED  ] 1 test"), std::string::npos) << r.output;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("rank ", 0) == 0) std::printf("%s\n", line.c_str());
}

// Lina's price of running an expert: the expert kernel's own time at a few row counts (timed, so only
// its shape is checked here: every point took time, 256 rows more than 1; no rows or 0 rows refused).
TEST(Engine, ExpertSecondsAreTheKernelsTimeAtEachRowCount) {
  const ModelConfig cfg = small_config(false);
  Model model(cfg, 1);
  model.init(3);
  const InferenceEngine e(model, 1, 4);
  const std::vector<int64_t> rows{1, 16, 256};
  const std::vector<double> t = e.measure_expert_seconds(rows);
  ASSERT_EQ(t.size(), rows.size());
  for (double s : t) EXPECT_GT(s, 0);
  EXPECT_GT(t[2], t[0]);
  std::printf("an expert of C%lld F%lld: 1 row %.2f us, 16 rows %.2f us, 256 rows %.2f us\n",
              static_cast<long long>(cfg.d_model), static_cast<long long>(cfg.d_ffn), t[0] * 1e6, t[1] * 1e6,
              t[2] * 1e6);
  EXPECT_THROW(e.measure_expert_seconds({}), std::logic_error);
  EXPECT_THROW(e.measure_expert_seconds({0}), std::logic_error);
}

// Lina's start-up runs 64 profiling windows through forward(); serving's figures (/metrics, bench
// serve's per-forward stage times) must not count them, or every lina schedule reads slower than ep.
TEST(Engine, ServingCountersStartAfterTheProfile) {
  const ModelConfig cfg = small_config(false);
  Model model(cfg, 1);
  model.init(3);
  InferenceEngine e(model, 1, cfg.seq_len);
  std::unique_ptr<moe::plan::PathProfile> profile;
  const std::string corpus = (fs::path(MOE_TEST_DIR) / ".." / "docs" / "model.md").string();
  const moe::Status s = moe::serve::start_schedule(e, nullptr, "lina", corpus, -1, &profile);
  ASSERT_TRUE(s) << s.message();
  ASSERT_TRUE(profile);
  EXPECT_GT(profile->tokens(), 0);  // the profile ran its windows through forward()
  EXPECT_EQ(e.stage_seconds().forwards, 0);
  EXPECT_EQ(e.stage_seconds().total, 0);
  auto assignments = [&] {  // every expert load since the last call, summed over the blocks
    int64_t sum = 0;
    for (const auto& layer : e.take_expert_loads())
      for (int64_t n : layer) sum += n;
    return sum;
  };
  EXPECT_EQ(assignments(), 0) << "the profile's routing counted in the expert loads";
  const std::vector<Row> rows{{0, 0, 'a', true}};
  std::vector<float> logits(cfg.vocab_size);
  e.forward(rows, logits.data());
  EXPECT_EQ(e.stage_seconds().forwards, 1);
  EXPECT_EQ(assignments(), e.moe_blocks() * cfg.top_k);  // the one row's top-k at each MoE block
}

// What a step waits for: each MoE block's exchange waits for that block's slowest rank, and the
// slowest rank changes from block to block, so the sum of per-block maxima exceeds the busiest rank's
// total (a schedule that evens each block shortens the step though every rank's total stays equal).
TEST(Lockstep, ExpertTimeOverRanksSumsEachBlocksSlowestRank) {
  const std::vector<float> seconds{3, 1, 2,   // rank 0's three blocks
                                   1, 3, 2};  // rank 1's
  const moe::serve::BlockTimes t = moe::serve::expert_time_over_ranks(seconds, 2);
  EXPECT_DOUBLE_EQ(t.busiest, 3 + 3 + 2);  // each rank's total is 6
  EXPECT_DOUBLE_EQ(t.mean, 6);
  EXPECT_DOUBLE_EQ(moe::serve::expert_time_over_ranks(seconds, 1).busiest, 12);  // one rank: its total
  EXPECT_DOUBLE_EQ(moe::serve::expert_time_over_ranks({}, 2).busiest, 0);        // no MoE block
  EXPECT_THROW(moe::serve::expert_time_over_ranks(seconds, 4), std::logic_error);
  EXPECT_THROW(moe::serve::expert_time_over_ranks(seconds, 0), std::logic_error);
}

TEST(Engine, RejectsRowsOutOfRange) {
  const ModelConfig cfg = small_config(false);
  Model model(cfg, 1);
  InferenceEngine e(model, 1, 4);
  std::vector<float> out(cfg.vocab_size);
  const Row bad_pos{0, static_cast<int32_t>(cfg.seq_len), 1, true}, bad_slot{1, 0, 1, true}, bad_token{0, 0, 256, true};
  EXPECT_THROW(e.forward({&bad_pos, 1}, out.data()), std::logic_error);
  EXPECT_THROW(e.forward({&bad_slot, 1}, out.data()), std::logic_error);
  EXPECT_THROW(e.forward({&bad_token, 1}, out.data()), std::logic_error);
  std::vector<Row> many(5, Row{0, 0, 1, false});
  EXPECT_THROW(e.forward(many, out.data()), std::logic_error);
}

// ---- sampler -------------------------------------------------------------------------------

const std::vector<float> kLogits = {1.0f, 3.0f, 2.5f, -1.0f, 0.0f, 2.9f};

// The quantile /metrics and moe bench serve report: nearest rank, on closed-form cases.
TEST(Quantile, NearestRank) {
  const std::vector<double> v{10, 9, 8, 7, 6, 5, 4, 3, 2, 1};  // unsorted on purpose
  EXPECT_EQ(moe::nearest_rank_quantile(v, 0.5), 5);    // ceil(5.0) = 5th
  EXPECT_EQ(moe::nearest_rank_quantile(v, 0.51), 6);   // ceil(5.1) = 6th
  EXPECT_EQ(moe::nearest_rank_quantile(v, 0.95), 10);  // ceil(9.5) = 10th
  EXPECT_EQ(moe::nearest_rank_quantile(v, 0.0), 1);
  EXPECT_EQ(moe::nearest_rank_quantile(v, 1.0), 10);
  EXPECT_EQ(moe::nearest_rank_quantile({42}, 0.99), 42);
  EXPECT_THROW(moe::nearest_rank_quantile({}, 0.5), std::logic_error);
  EXPECT_THROW(moe::nearest_rank_quantile(v, 1.5), std::logic_error);
}

// Admission by rows: a prompt joins the rank with the fewest rows this step, so two prompts arriving
// together are prefilled on two ranks; then the most free slots; never past a rank's budget.
TEST(Admission, FewestRowsThenMostFreeSlotsWithinTheBudget) {
  using moe::serve::admission_rank;
  // Rank 1 has more free slots but already prefills 100 rows: the prompt goes to rank 0.
  EXPECT_EQ(admission_rank({20, 118}, {12, 13}, 100, 512), 0);
  // Equal rows: the most free slots, then the lowest index.
  EXPECT_EQ(admission_rank({5, 5, 5}, {2, 4, 4}, 10, 512), 1);
  // A rank without a free slot, or whose budget the prompt would exceed, is skipped; none: -1.
  EXPECT_EQ(admission_rank({0, 30}, {0, 3}, 10, 64), 1);
  EXPECT_EQ(admission_rank({60, 30}, {3, 3}, 40, 64), -1);
  EXPECT_EQ(admission_rank({0, 0}, {0, 0}, 1, 64), -1);
  EXPECT_THROW(admission_rank({0, 0}, {1}, 1, 64), std::logic_error);
}

TEST(Sampler, GreedyIsTheArgmaxAndTopK1IsGreedy) {
  moe::serve::Sampler greedy({0.0, 0, 1.0, 1}, 0);
  EXPECT_EQ(greedy.next(kLogits.data(), 6), 1);
  moe::serve::Sampler k1({2.0, 1, 1.0, 9}, 3);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(k1.next(kLogits.data(), 6), 1);
}

// Frequencies of 40,000 draws against the closed-form probabilities of softmax(logits / temperature)
// restricted to what top-k / top-p keep: every token within 5 standard deviations, the dropped never.
TEST(Sampler, DrawsFollowTheTruncatedSoftmax) {
  struct Case {
    double temperature;
    int64_t top_k;
    double top_p;
  };
  for (const Case& c : {Case{1.0, 0, 1.0}, Case{0.5, 0, 1.0}, Case{1.0, 3, 1.0}, Case{1.0, 0, 0.7}}) {
    // Expected: sorted by logit 1 (3.0), 5 (2.9), 2 (2.5), 0, 4, 3; keep top_k; then the smallest
    // prefix whose mass reaches top_p.
    const std::vector<int> order = {1, 5, 2, 0, 4, 3};
    std::vector<double> w(6, 0.0);
    double sum = 0;
    size_t keep = c.top_k > 0 ? c.top_k : 6;
    for (size_t i = 0; i < keep; ++i) sum += w[order[i]] = std::exp((kLogits[order[i]] - 3.0) / c.temperature);
    if (c.top_p < 1) {
      double mass = 0;
      size_t i = 0;
      while (i < keep && mass < c.top_p * sum) mass += w[order[i++]];
      for (size_t j = i; j < 6; ++j) w[order[j]] = 0;
      sum = mass;
    }
    moe::serve::Sampler s({c.temperature, c.top_k, c.top_p, 42}, 0);
    const int draws = 40000;
    std::vector<int> count(6, 0);
    for (int i = 0; i < draws; ++i) ++count[s.next(kLogits.data(), 6)];
    for (int t = 0; t < 6; ++t) {
      const double p = w[t] / sum, expect = p * draws, sd = std::sqrt(draws * p * (1 - p));
      if (p == 0) {
        EXPECT_EQ(count[t], 0) << "token " << t << " should be cut (T " << c.temperature << ")";
      } else {
        EXPECT_NEAR(count[t], expect, 5 * sd + 1) << "token " << t << " T " << c.temperature << " k " << c.top_k
                                                  << " p " << c.top_p;
      }
    }
  }
}

TEST(Sampler, TheSameSeedAndStreamDrawTheSameTokens) {
  auto draw = [](uint64_t seed, uint64_t stream) {
    moe::serve::Sampler s({1.0, 0, 1.0, seed}, stream);
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.next(kLogits.data(), 6));
    return out;
  };
  EXPECT_EQ(draw(7, 3), draw(7, 3));
  EXPECT_NE(draw(7, 3), draw(7, 4));
  EXPECT_NE(draw(7, 3), draw(8, 3));
}

TEST(Sampler, BadParametersAreNamed) {
  auto message = [](double temperature, int64_t top_k, double top_p) {
    moe::serve::SamplingParams p;
    p.temperature = temperature, p.top_k = top_k, p.top_p = top_p;
    return p.validate().message();
  };
  EXPECT_NE(message(-1.0, 0, 1.0).find("temperature"), std::string::npos);
  EXPECT_NE(message(1.0, -2, 1.0).find("top_k"), std::string::npos);
  EXPECT_NE(message(1.0, 0, 0.0).find("top_p"), std::string::npos);
  EXPECT_TRUE(moe::serve::SamplingParams{}.validate());
}

// ---- moe generate, through the binary -------------------------------------------------------

class InferenceCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("moe_generate_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ifstream in(fs::path(MOE_TEST_DIR) / ".." / "docs" / "model.md", std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    std::ofstream(dir_ / "corpus.txt", std::ios::binary) << text.str() << text.str();
    // A small model (4 experts: 1, 2 and 4 ranks share them) trained a few steps, with a checkpoint.
    const moe::ShellResult r = run("train --data " + (dir_ / "corpus.txt").string() +
                                   " --seq-len 32 --d-model 32 --layers 2 --heads 2 --d-ffn 64 --experts 4 --top-k 2"
                                   " --batch-size 8 --steps 40 --eval-batches 1 --threads 1 --router-skew 1"
                                   " --checkpoint-dir " + (dir_ / "ck").string());
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  static moe::ShellResult run(const std::string& args) { return moe::run_shell(std::string(MOE_BIN) + " " + args); }
  // stdout only (the continuation); stderr goes to a file, returned in *err.
  static std::string generated(const std::string& args, std::string* err = nullptr) {
    const fs::path e = dir_ / "err.txt";
    const moe::ShellResult r =
        run("generate --checkpoint " + (dir_ / "ck").string() + " " + args + " 2>" + e.string());
    std::ifstream f(e);
    std::stringstream s;
    s << f.rdbuf();
    EXPECT_EQ(r.exit_code, 0) << r.output << s.str();
    if (err) *err = s.str();
    return r.output;
  }
  static fs::path dir_;
};
fs::path InferenceCli::dir_;

// The same tokens on 1, 2 and 4 ranks, greedy and sampled, past the 32-token context (refilled).
TEST_F(InferenceCli, TheSameTokensOnOneTwoAndFourRanks) {
  for (const std::string mode : {"--temperature 0", "--temperature 0.9 --top-k 50 --top-p 0.95 --seed 4"}) {
    std::string err;
    const std::string one = generated("--prompt 'The ' --max-tokens 70 --threads 1 " + mode, &err);
    EXPECT_EQ(one.size(), 70u) << one;
    EXPECT_NE(err.find("70 tokens"), std::string::npos) << err;
    EXPECT_NE(err.find("context refilled"), std::string::npos) << err;
    for (int ranks : {2, 4}) {
      const std::string many =
          generated("--prompt 'The ' --max-tokens 70 " + mode + " --ranks " + std::to_string(ranks), &err);
      EXPECT_EQ(many, one) << ranks << " ranks, " << mode;
      EXPECT_NE(err.find(std::to_string(ranks) + " rank(s)"), std::string::npos) << err;
    }
    // Lina's schedules move experts between ranks, never the mathematics: the same tokens.
    for (const std::string schedule : {"lina", "lina-no-estimate", "lina-no-phase2"}) {
      const std::string many =
          generated("--prompt 'The ' --max-tokens 70 " + mode + " --ranks 2 --schedule " + schedule, &err);
      EXPECT_EQ(many, one) << schedule << ", " << mode;
      EXPECT_NE(err.find("schedule " + schedule + ": "), std::string::npos) << err;
    }
    std::string shown = one.substr(0, 40);
    for (char& ch : shown) ch = std::isprint(static_cast<unsigned char>(ch)) ? ch : '.';
    std::printf("%s: \"%s\" on 1, 2 and 4 ranks\n", mode.c_str(), shown.c_str());
  }
  // Another seed draws another continuation.
  EXPECT_NE(generated("--prompt 'The ' --max-tokens 40 --temperature 1 --seed 1"),
            generated("--prompt 'The ' --max-tokens 40 --temperature 1 --seed 2"));
}

// A checkpoint trained with a drifting router skew serves with the bias its last training step used
// (the model as trained), not step 0's.
TEST_F(InferenceCli, ADriftingSkewServesWithItsLastStepsBias) {
  const fs::path ck = dir_ / "drift";
  const moe::ShellResult r = run("train --data " + (dir_ / "corpus.txt").string() +
                                 " --seq-len 16 --d-model 16 --layers 2 --heads 2 --d-ffn 16 --experts 4 --top-k 1"
                                 " --batch-size 4 --steps 5 --eval-batches 1 --threads 1 --router-skew 2"
                                 " --router-skew-drift 0.5 --checkpoint-dir " + ck.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::unique_ptr<Model> model;
  const moe::Status s = moe::serve::load_inference_model(ck.string(), 0, &model, nullptr);
  ASSERT_TRUE(s) << s.message();
  const ModelConfig& cfg = model->config();
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    // Steps 0-4 ran; step 4 turned the order by floor(0.5 * 4) = 2 experts, which step 0's bias has not.
    EXPECT_EQ(model->moe_layer(l)->config().router_bias, cfg.router_bias(l, 4)) << "block " << l;
    EXPECT_NE(model->moe_layer(l)->config().router_bias, cfg.router_bias(l, 0)) << "block " << l;
  }
}

TEST_F(InferenceCli, BadInputGetsOneClearError) {
  struct Case {
    std::string args, needle;
  };
  const std::string ck = " --checkpoint " + (dir_ / "ck").string();
  for (const Case& c : {Case{"--checkpoint " + (dir_ / "nope").string() + " --prompt x", "no such directory"},
                        Case{"--checkpoint " + dir_.string() + " --prompt x", "state.json"},
                        Case{ck + " --prompt ''", "--prompt is empty"},
                        Case{ck + " --prompt " + std::string(40, 'a'), "the model's context is 32"},
                        Case{ck + " --prompt x --top-p 1.5", "top_p"},
                        Case{ck + " --prompt x --max-tokens 0", "--max-tokens"},
                        Case{ck + " --prompt x --ranks 3", "cannot share the model's 4 experts"},
                        Case{ck + " --prompt x --ranks 2 --schedule linear", "--schedule 'linear'"}}) {
    const moe::ShellResult r = run("generate " + c.args);
    EXPECT_NE(r.exit_code, 0) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.needle), std::string::npos) << "expected '" << c.needle << "' in:\n" << r.output;
  }
  // A damaged weights file is refused by the checkpoint's checksum.
  fs::copy(dir_ / "ck", dir_ / "bad", fs::copy_options::recursive);
  {
    std::fstream f(dir_ / "bad" / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-16, std::ios::end);
    f.put('\x7f');
  }
  const moe::ShellResult r = run("generate --checkpoint " + (dir_ / "bad").string() + " --prompt x");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("model.safetensors"), std::string::npos) << r.output;
}

// ---- moe serve, through the binary and HTTP ------------------------------------------------

// One completion request; its HTTP status in *status (-1: no answer).
nlohmann::json post(int port, const nlohmann::json& body, int* status) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(120, 0);
  auto res = c.Post("/v1/completions", body.dump(), "application/json");
  *status = res ? res->status : -1;
  if (!res) return {};
  return nlohmann::json::parse(res->body, nullptr, false);
}

// 8 concurrent requests on 2 ranks with 3 slots each, so some wait for a slot and join the running
// batch later; every greedy answer (past the 32-token context: refilled) equals `moe generate`'s for
// its prompt, a sampled one with a seed too. Batching changes only the order of float sums
// (Batching.RaggedRowsOfSeveralSequencesEqualEachAlone bounds the logit difference at 1e-5
// relative), so a greedy token could differ only at a near-tie; none does here.
TEST_F(InferenceCli, ServeAnswersConcurrentRequestsAsGenerateDoes) {
  moe::BackgroundProcess server(std::string(MOE_BIN) + " serve --checkpoint " + (dir_ / "ck").string() +
                                    " --ranks 2 --slots-per-rank 3 --port 0",
                                (dir_ / "serve.log").string());
  const int port = server.wait_for_int_after("listening on http://127.0.0.1:", 90);
  ASSERT_GT(port, 0) << server.log();
  const int n = 8;
  std::vector<std::string> prompts, answers(n);
  for (int i = 0; i < n; ++i) prompts.push_back(std::string("The ") + "abcdefgh"[i] + " model");
  std::vector<int> status(n);
  std::vector<std::thread> clients;
  for (int i = 0; i < n; ++i)
    clients.emplace_back([&, i] {
      nlohmann::json body{{"prompt", prompts[i]}, {"max_tokens", 45}, {"temperature", 0}};
      if (i == n - 1) body = {{"prompt", prompts[i]}, {"max_tokens", 45}, {"temperature", 0.9}, {"top_k", 50}, {"seed", 4}};
      const nlohmann::json r = post(port, body, &status[i]);
      if (status[i] == 200) answers[i] = r["choices"][0]["text"].get<std::string>();
    });
  for (auto& t : clients) t.join();
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(status[i], 200) << i << "\n" << server.log();
    const std::string mode = i == n - 1 ? "--temperature 0.9 --top-k 50 --seed 4" : "--temperature 0";
    const std::string want = generated("--prompt '" + prompts[i] + "' --max-tokens 45 " + mode);
    EXPECT_EQ(answers[i].size(), 45u);
    EXPECT_EQ(answers[i], want) << "request " << i << " (" << prompts[i] << ")";
  }
  // Streamed: the events' texts put together are the whole answer.
  {
    httplib::Client c("127.0.0.1", port);
    std::string events;
    auto res = c.Post("/v1/completions",
                      nlohmann::json{{"prompt", prompts[0]}, {"max_tokens", 45}, {"temperature", 0}, {"stream", true}}.dump(),
                      "application/json");
    ASSERT_TRUE(res) << server.log();
    std::string text;
    size_t at = 0, count = 0;
    while ((at = res->body.find("data: {", at)) != std::string::npos) {
      const size_t end = res->body.find("\n\n", at);
      text += nlohmann::json::parse(res->body.substr(at + 6, end - at - 6))["choices"][0]["text"].get<std::string>();
      at = end, ++count;
    }
    EXPECT_EQ(text, answers[0]) << res->body;
    EXPECT_GT(count, 1u);
    EXPECT_NE(res->body.find("data: [DONE]"), std::string::npos);
  }
  // Malformed requests: 400 with a message; the server keeps serving.
  for (const std::string bad : {"not json", R"({"prompt": 3})", R"({"prompt": "x", "max_tokens": 0})",
                                R"({"prompt": "x", "temprature": 1})", R"({"prompt": ""})"}) {
    httplib::Client c("127.0.0.1", port);
    auto res = c.Post("/v1/completions", bad, "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 400) << bad;
    EXPECT_NE(res->body.find("\"message\""), std::string::npos) << res->body;
  }
  int again = 0;
  EXPECT_EQ(post(port, {{"prompt", prompts[1]}, {"max_tokens", 45}, {"temperature", 0}}, &again)["choices"][0]["text"],
            answers[1]);
  httplib::Client c("127.0.0.1", port);
  auto metrics = c.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("moe_requests_total 10"), std::string::npos) << metrics->body;
  EXPECT_NE(metrics->body.find("moe_requests_rejected_total 5"), std::string::npos) << metrics->body;
  EXPECT_NE(metrics->body.find("moe_request_latency_seconds{quantile=\"0.95\"}"), std::string::npos);
  for (const char* name : {"moe_forwards_total", "moe_forward_seconds_total", "moe_forward_experts_seconds_total",
                           "moe_forward_exchange_seconds_total", "moe_forward_gate_seconds_total"})
    EXPECT_NE(metrics->body.find(std::string("\n") + name + " "), std::string::npos) << name;
  // Every rank's expert time came to rank 0 with its logits.
  auto value = [&](const std::string& name) {
    const size_t at = metrics->body.find("\n" + name + " ");
    return at == std::string::npos ? -1.0 : std::atof(metrics->body.c_str() + at + name.size() + 2);
  };
  const double busiest = value("moe_expert_seconds_busiest_rank_total");
  const double mean = value("moe_expert_seconds_mean_rank_total");
  EXPECT_GT(mean, 0);
  EXPECT_GE(busiest, mean);
  EXPECT_LT(busiest, 2 * mean) << "rank 1's expert time did not arrive (2 ranks: busiest = 2 x mean when one reads 0)";
  EXPECT_GT(value("moe_forward_experts_seconds_total"), 0);
  // SIGTERM to mpirun reaches every rank: rank 0 answers what is running, tells the others, and all
  // return. (mpirun itself exits 1 after forwarding a signal, however its ranks ended.)
  EXPECT_NE(server.stop(60), -1) << "did not stop within 60 s\n" << server.log();
  EXPECT_NE(server.log().find("serve: stopped"), std::string::npos) << server.log();
  EXPECT_EQ(server.log().find("error"), std::string::npos) << server.log();
}

}  // namespace

