#include "moe/token_exchange.h"

#include <stdexcept>

#include "util/str_cat.h"

namespace moe {

int64_t TokenExchange::rows_between(int s, int e, int d) const {
  if (padded) return placement.owner[e] == d ? slots : 0;
  return rows[s][e][d];
}

void TokenExchange::chunk_counts(int c, int n, std::vector<int64_t>* sc, std::vector<int64_t>* sd,
                                 std::vector<int64_t>* rc, std::vector<int64_t>* rd) const {
  if (c < 0 || c >= n) throw std::logic_error(str_cat("TokenExchange: chunk ", c, " of ", n));
  const std::vector<std::vector<int>> chunk = plan::exchange_chunks(placement, n);
  const int E = placement.n_experts();
  sc->assign(ranks, 0), sd->assign(ranks, 0), rc->assign(ranks, 0), rd->assign(ranks, 0);
  for (int p = 0; p < ranks; ++p) {
    int64_t send_before = 0, send = 0, recv_before = 0, recv = 0;
    for (int e = 0; e < E; ++e) {
      const int64_t out = rows_between(rank, e, p), in = rows_between(p, e, rank);
      if (chunk[p][e] < c) send_before += out;
      if (chunk[p][e] == c) send += out;
      if (chunk[rank][e] < c) recv_before += in;
      if (chunk[rank][e] == c) recv += in;
    }
    (*sc)[p] = send * row_floats, (*sd)[p] = send_displs[p] + send_before * row_floats;
    (*rc)[p] = recv * row_floats, (*rd)[p] = recv_displs[p] + recv_before * row_floats;
  }
}

std::vector<int64_t> TokenExchange::peer_bytes(bool to_experts, int chunk, int n_chunks) const {
  std::vector<int64_t> b(to_experts ? send_counts : recv_counts);
  if (n_chunks > 1) {
    if (!to_experts) throw std::logic_error("TokenExchange::peer_bytes: only the exchange to the experts is chunked");
    std::vector<int64_t> sd, rc, rd;
    chunk_counts(chunk, n_chunks, &b, &sd, &rc, &rd);
  }
  for (int64_t& x : b) x *= static_cast<int64_t>(sizeof(float));
  return b;
}

}  // namespace moe
