// Helpers every benchmark uses: see bench.h.
#include <unistd.h>

#include <algorithm>

#include "bench/bench.h"

namespace moe::bench {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string self_exe() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, n) : "moe";
}

}  // namespace moe::bench
