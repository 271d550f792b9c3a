// str_cat: a message built from strings and numbers, as `operator<<` prints them. Used instead of
// chains of `operator+` on a literal and a temporary, which trip GCC 12's -Wrestrict false positive.
#pragma once

#include <sstream>
#include <string>

namespace moe {

template <typename... A>
std::string str_cat(const A&... a) {
  std::ostringstream s;
  (s << ... << a);
  return s.str();
}

}  // namespace moe
