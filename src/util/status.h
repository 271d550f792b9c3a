// Status: how the public API reports errors that a user can cause (bad config, bad file).
// Programming errors (violated REQUIRES) throw std::logic_error instead.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace moe {

class Status {
 public:
  Status() = default;  // OK
  static Status ok() { return Status(); }
  static Status error(std::string message) { return Status(std::move(message)); }
  bool is_ok() const { return message_.empty(); }
  explicit operator bool() const { return is_ok(); }
  // The message names the problem and what it concerns, e.g. "config: top_k (3) > n_experts (2)".
  const std::string& message() const { return message_; }

 private:
  explicit Status(std::string m) : message_(m.empty() ? "unknown error" : std::move(m)) {}
  std::string message_;
};

// For code whose contract is to throw (e.g. the MoE layer's exchanges, which the runtime's executor
// turns back into a Status): throws std::runtime_error with the message when s is an error.
inline void throw_if_error(const Status& s) {
  if (!s) throw std::runtime_error(s.message());
}

}  // namespace moe
