// The training losses `moe train` printed on its progress lines ("step   3/6  loss 5.2669 ..."), in
// order: what the tests that run the command compare across runs.
#pragma once

#include <regex>
#include <string>
#include <vector>

inline std::vector<double> progress_losses(const std::string& out) {
  std::vector<double> v;
  const std::regex re(R"(step\s+\d+/\d+\s+loss ([0-9.]+))");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it) v.push_back(std::stod((*it)[1]));
  return v;
}
