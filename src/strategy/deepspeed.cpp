// deepspeed: DeepSpeed-MoE's expert parallelism, the baseline of the Hecate, Parm, Lina and Pro-Prophet
// papers. Experts live as in ep; the all-to-all is fixed-size: every rank sends each expert the same
// number of slots (its kept rows, then zero padding) and the experts compute over every slot
// (MoeLayer::set_padded_exchange). The slot count is the most rows any rank keeps for any expert this
// step, what DeepSpeed's dropless mode agrees on with an allreduce-max.
// Deviation: with --capacity-factor, DeepSpeed drops per rank (capacity cf * local tokens * K / E,
// slots of that size); here dropping follows the global rule every strategy shares (moe/moe_layer.h),
// so deepspeed computes ep's mathematics (invariant 1) and only its exchange and expert sizes differ.
#include "strategy/strategy.h"

namespace moe::strategy {
namespace {

class DeepSpeed : public Strategy {
 public:
  const char* name() const override { return "deepspeed"; }
  bool uses_placements() const override { return false; }
  void configure(graph::EpStepOptions* opt) const override { opt->padded_exchange = true; }
};

}  // namespace

std::unique_ptr<Strategy> make_deepspeed(const Setup&) { return std::make_unique<DeepSpeed>(); }

}  // namespace moe::strategy
