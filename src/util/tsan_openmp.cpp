// ThreadSanitizer builds only (the tsan preset): shows TSan the fork and join of every OpenMP parallel
// region. libgomp is not built with TSan, so the futex barriers that start a region's team and end it
// are invisible; without this every parallel loop's writes look unordered with the code before and
// after the region, and suppressing those reports (as tests/tsan.supp once did) hides any race that has
// a team thread on one side. GCC compiles every `#pragma omp parallel [for]` in moe into a call to
// GOMP_parallel(fn, data, ...), which runs fn(data) on each thread of the team and returns after the
// region's closing barrier. This definition takes the place of libgomp's (it is linked into the
// program, which the dynamic linker searches first) and wraps fn: the caller releases a sync object
// before the region, each team thread acquires it before fn and releases a second one after fn, and
// the caller acquires that after the region. moe's regions are single `parallel for` loops (no
// barrier inside), so these two edges are all the ordering libgomp provides them.
#if defined(__SANITIZE_THREAD__)

#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>

namespace {

using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);

struct Region {
  void (*fn)(void*);
  void* data;
  char start;  // the sync objects' addresses; their values are never used
  char end;
};

void run_in_team(void* p) {
  auto* r = static_cast<Region*>(p);
  __tsan_acquire(&r->start);
  r->fn(r->data);
  __tsan_release(&r->end);
}

GompParallel real_gomp_parallel() {
  static const GompParallel real = [] {
    auto f = reinterpret_cast<GompParallel>(dlsym(RTLD_NEXT, "GOMP_parallel"));
    if (f == nullptr) {
      std::fprintf(stderr, "tsan_openmp: libgomp's GOMP_parallel not found\n");
      std::abort();
    }
    return f;
  }();
  return real;
}

}  // namespace

extern "C" void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags) {
  Region r{fn, data, 0, 0};
  __tsan_release(&r.start);
  real_gomp_parallel()(run_in_team, &r, num_threads, flags);
  __tsan_acquire(&r.end);
}

#endif  // __SANITIZE_THREAD__
