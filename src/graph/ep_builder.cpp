#include "graph/ep_builder.h"

namespace moe::graph {

EpStep build_ep_step(const ModelConfig& cfg, const EpStepOptions& opt) {
  StepBuilder b(cfg, opt);
  int x = b.embed_forward();
  for (int64_t l = 0; l < cfg.n_layers; ++l) x = b.block_forward(l, x);
  x = b.head(x);
  for (int64_t l = cfg.n_layers - 1; l >= 0; --l) x = b.block_backward(l, x);
  b.embed_backward(x);
  return b.finish();
}

}  // namespace moe::graph
