#include "runtime/sharded_checkpoint.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "model/checkpoint.h"

namespace moe::runtime {
namespace {

// Whole-model stand-ins for a rank's parameters: sharded ones at their full size, the others
// sharing nothing (copies), in the same order, with an optimizer over them.
struct FullModel {
  std::vector<std::unique_ptr<Param>> owned;
  std::vector<Param*> params;
  std::unique_ptr<AdamW> opt;
};

FullModel make_full(const AdamW& opt) {
  FullModel f;
  for (const Param* p : opt.params()) {
    std::vector<int64_t> shape = p->value.shape();
    if (p->sharded()) shape[0] = p->full_dim0;
    f.owned.push_back(std::make_unique<Param>(p->name, shape, p->decay));
    f.params.push_back(f.owned.back().get());
  }
  f.opt = std::make_unique<AdamW>(f.params, opt.config());
  return f;
}

// Elements of one first-dimension row.
int64_t row_size(const Tensor& t) { return t.dim(0) ? static_cast<int64_t>(t.numel()) / t.dim(0) : 0; }

}  // namespace

Status save_sharded_checkpoint(const std::string& dir, const AdamW& opt, comm::Communicator* ep, bool write,
                               const nlohmann::json& state) {
  bool any_sharded = false;
  for (const Param* p : opt.params()) any_sharded |= p->sharded();
  if (!any_sharded || !ep || ep->size() == 1)
    return write ? save_checkpoint(dir, opt.params(), opt, state) : Status::ok();
  FullModel full = make_full(opt);
  for (size_t i = 0; i < opt.params().size(); ++i) {
    const Param* p = opt.params()[i];
    const Tensor* mine[3] = {&p->value, &opt.m(i), &opt.v(i)};
    Tensor* whole[3] = {&full.params[i]->value, &full.opt->m(i), &full.opt->v(i)};
    for (int k = 0; k < 3; ++k) {
      if (!p->sharded()) {
        std::copy(mine[k]->data(), mine[k]->data() + mine[k]->numel(), whole[k]->data());
        continue;
      }
      // Shards are equal and in rank order: rank r holds rows [r*rows, (r+1)*rows).
      if (Status s = ep->allgather(mine[k]->data(), static_cast<int64_t>(mine[k]->numel()), whole[k]->data()); !s)
        return s;
    }
  }
  full.opt->set_steps(opt.steps());
  return write ? save_checkpoint(dir, full.params, *full.opt, state) : Status::ok();
}

Status load_sharded_checkpoint(const std::string& dir, AdamW* opt, nlohmann::json* state) {
  FullModel full = make_full(*opt);
  if (Status s = load_checkpoint(dir, full.params, full.opt.get(), state); !s) return s;
  for (size_t i = 0; i < opt->params().size(); ++i) {
    Param* p = opt->params()[i];
    const Tensor* whole[3] = {&full.params[i]->value, &full.opt->m(i), &full.opt->v(i)};
    Tensor* mine[3] = {&p->value, &opt->m(i), &opt->v(i)};
    const int64_t first = p->sharded() ? p->shard_begin * row_size(*whole[0]) : 0;
    for (int k = 0; k < 3; ++k)
      std::copy(whole[k]->data() + first, whole[k]->data() + first + mine[k]->numel(), mine[k]->data());
  }
  opt->set_steps(full.opt->steps());
  return Status::ok();
}

}  // namespace moe::runtime
