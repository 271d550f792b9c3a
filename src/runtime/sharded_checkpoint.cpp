#include "runtime/sharded_checkpoint.h"

#include <algorithm>
#include <memory>
#include <vector>

#include <unistd.h>

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

Status save_sharded_checkpoint(const std::string& dir, const AdamW& opt, comm::Communicator* ep, bool writes,
                               const nlohmann::json& state) {
  if (!writes) return Status::ok();
  bool any_sharded = false;
  for (const Param* p : opt.params()) any_sharded |= p->sharded();
  if (!any_sharded || !ep || ep->size() == 1) return save_checkpoint(dir, opt.params(), opt, state);
  const bool lead = ep->rank() == 0;
  // The lead names and creates the staging folder; the parts go into it.
  int64_t id = lead ? static_cast<int64_t>(::getpid()) : 0, ok = 1;
  Status mine = lead ? begin_checkpoint(dir, checkpoint_staging_dir(dir, id)) : Status::ok();
  int64_t header[2] = {id, mine ? 1 : 0};
  if (Status s = ep->broadcast(header, 2, 0); !s) return s;
  if (!header[1]) return lead ? mine : Status::error("checkpoint: rank 0 could not start writing " + dir);
  const std::string staging = checkpoint_staging_dir(dir, header[0]);
  mine = write_checkpoint_part(staging, ep->rank(), ep->size(), opt, lead, state);
  ok = mine ? 1 : 0;
  if (Status s = ep->allreduce(&ok, 1, comm::ReduceOp::min); !s) return s;
  Status done;
  if (lead) {
    done = ok ? finish_checkpoint(dir, staging, ep->size(), opt, state) : Status::error("");
    if (!done) abandon_checkpoint(staging);
  }
  int64_t finished = lead ? (done ? 1 : 0) : 0;
  if (Status s = ep->broadcast(&finished, 1, 0); !s) return s;
  if (finished) return Status::ok();
  if (!mine) return mine;
  if (lead && ok) return done;
  return Status::error("checkpoint: another rank could not write its part of " + dir);
}

Status load_sharded_checkpoint(const std::string& dir, AdamW* opt, nlohmann::json* state) {
  FullModel full = make_full(*opt);
  if (Status s = load_checkpoint(dir, full.params, full.opt.get(), state); !s) return s;
  for (size_t i = 0; i < opt->params().size(); ++i) {
    Param* p = opt->params()[i];
    const Tensor* whole[3] = {&full.params[i]->value, &full.opt->m(i), &full.opt->v(i)};
    Tensor* mine[3] = {&p->value, &opt->m(i), &opt->v(i)};
    if (!p->sharded()) {
      for (int k = 0; k < 3; ++k) std::copy(whole[k]->data(), whole[k]->data() + mine[k]->numel(), mine[k]->data());
      continue;
    }
    const int64_t n = row_size(*whole[0]);
    for (int64_t i = 0; i < p->value.dim(0); ++i)
      for (int k = 0; k < 3; ++k)
        std::copy(whole[k]->data() + p->shard_row(i) * n, whole[k]->data() + (p->shard_row(i) + 1) * n,
                  mine[k]->data() + i * n);
  }
  opt->set_steps(full.opt->steps());
  return Status::ok();
}

}  // namespace moe::runtime
