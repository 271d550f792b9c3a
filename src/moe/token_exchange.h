// One step's token exchange of one expert-parallel MoE layer, as one rank sees it: planned by
// MoeLayer::ep_dispatch from the synced counts, then read by every later phase of that layer's step
// (the exchanges, the experts, the combine and their backward). The step owns it and hands it from op
// to op (the runtime keeps one per MoE layer, runtime/ep_step_bodies.h), so what an exchange op reads
// is wired where the graph wires the ops, and a strategy can cut an exchange into chunks
// (chunk_counts) without new state in the layer.
//
// Row orders: this rank's rows leave destination-major, experts ascending within a destination; rows
// arrive source-major, experts ascending within a source. So the rows of any set of experts that is
// contiguous in each rank's held list are one run inside every block: a chunk.
// Thread safety: none; the step's ops use it one at a time (the graph orders them).
#pragma once

#include <cstdint>
#include <vector>

#include "plan/placement.h"

namespace moe {

struct TokenExchange {
  int rank = 0, ranks = 0;         // this rank and P, in the ep group
  int64_t row_floats = 0;          // C: floats per row
  plan::LayerPlacement placement;  // the holders rows go to this step
  // Unpadded: rows[s][e][d] rows rank s sends rank d for expert e (plan::dispatch_plan), [P][E][P].
  std::vector<std::vector<std::vector<int64_t>>> rows;
  // DeepSpeed-MoE's padded exchange: every rank sends every expert `slots` rows (kept rows, then zeros).
  bool padded = false;
  int64_t slots = 0;
  // The whole exchange to the experts, in floats, per ep rank (the way back swaps send and recv).
  std::vector<int64_t> send_counts, send_displs, recv_counts, recv_displs;
  // When the send order is the layout's expert-major order the exchanges read and write the layer's
  // row buffers directly; else destination-major row i <- expert-major row send_perm[i].
  bool send_in_place = true;
  std::vector<int32_t> send_perm, inv_send_perm;
  int64_t send_rows = 0;      // rows of the send order (padded: held experts x slots per rank)
  int64_t received_rows = 0;  // rows this rank's experts run
  // Set by the step's first ep_experts: the received rows held-expert-major.
  std::vector<int> held_order;         // [H] my held experts in compute order (owned ascending, then slots)
  std::vector<int64_t> local_offset;   // [H+1] rows of held expert h: [local_offset[h], local_offset[h+1])
  std::vector<int32_t> perm, inv_perm; // expert-major row i <- source-major row perm[i]

  // Rows rank s sends rank d for expert e (padded: slots to e's owner).
  int64_t rows_between(int s, int e, int d) const;
  // Chunk c of n of the exchange to the experts (plan::exchange_chunks over placement): alltoallv
  // counts and displacements in floats, per ep rank. REQUIRES: 0 <= c < n (std::logic_error).
  void chunk_counts(int c, int n, std::vector<int64_t>* send_counts, std::vector<int64_t>* send_displs,
                    std::vector<int64_t>* recv_counts, std::vector<int64_t>* recv_displs) const;
  // Bytes this rank sends each ep rank: to the experts (chunk c of n) or back (the whole exchange).
  std::vector<int64_t> peer_bytes(bool to_experts, int chunk = 0, int n_chunks = 1) const;
};

}  // namespace moe
