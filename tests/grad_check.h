// Finite-difference gradient checking shared by the op, layer and model tests.
#pragma once

#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace moe::testing {

// Fills x with normal(0, std) from a fixed seed.
inline void fill_normal(float* x, size_t n, uint64_t seed, float std = 1.0f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> d(0.0f, std);
  for (size_t i = 0; i < n; ++i) x[i] = d(g);
}

struct GradCheckResult {
  double max_abs_err = 0;   // max |analytic - numeric|
  double max_rel_err = 0;   // max |a - n| / max(|a|, |n|, floor)
  size_t checked = 0;
  bool finite = true;       // every analytic and numeric value is finite
};

// Compares analytic[i] with the central difference (loss(x+eps) - loss(x-eps)) / 2eps for up to
// `max_checks` entries of x (evenly strided, so large tensors stay cheap). `loss` must recompute the
// scalar from the current x in double precision where it can. x is restored after each probe.
// Relative error uses max(|a|, |n|, floor) as denominator so near-zero gradients compare absolutely.
inline GradCheckResult check_gradient(const std::function<double()>& loss, float* x, const float* analytic,
                                      size_t n, float eps = 1e-2f, size_t max_checks = 64,
                                      double floor = 1e-2) {
  GradCheckResult r;
  size_t stride = n <= max_checks ? 1 : n / max_checks;
  for (size_t i = 0; i < n; i += stride) {
    float orig = x[i];
    x[i] = orig + eps;
    double lp = loss();
    x[i] = orig - eps;
    double lm = loss();
    x[i] = orig;
    double num = (lp - lm) / (2.0 * eps);
    double a = analytic[i];
    if (!std::isfinite(num) || !std::isfinite(a)) r.finite = false;
    double err = std::fabs(a - num);
    double den = std::max({std::fabs(a), std::fabs(num), floor});
    r.max_abs_err = std::max(r.max_abs_err, err);
    r.max_rel_err = std::max(r.max_rel_err, err / den);
    ++r.checked;
  }
  return r;
}

inline bool all_finite(const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

}  // namespace moe::testing
