// ep: static expert parallelism. Expert e lives on rank e / (E / R) of its expert-parallel group
// (the largest that divides both the experts and the ranks; the other ranks hold data-parallel
// copies), tokens go to their expert's rank, nothing is placed or moved.
#include "strategy/strategy.h"

namespace moe::strategy {
namespace {

class Ep : public Strategy {
 public:
  const char* name() const override { return "ep"; }
  bool uses_placements() const override { return false; }
};

}  // namespace

std::unique_ptr<Strategy> make_ep(const Setup&) { return std::make_unique<Ep>(); }

}  // namespace moe::strategy
