#include "graph/ep_builder.h"

namespace moe::graph {

EpStep build_ep_step(const ModelConfig& cfg, const EpStepOptions& opt) {
  return StepBuilder(cfg, opt).compose([](StepBuilder& b, int64_t l, int x) { return b.moe_forward(l, x); });
}

}  // namespace moe::graph
