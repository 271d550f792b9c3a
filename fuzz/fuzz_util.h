// Helpers shared by the fuzz targets (fuzz/README.md): a scratch folder for parsers that read files,
// splitting one input into several files, and a check that turns a broken invariant into a crash
// libFuzzer reports.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace moe::fuzz {

// Between the pieces of an input that holds several files (a checkpoint folder, a corpus folder).
// A line of its own, so the seed inputs stay readable.
inline constexpr std::string_view kFileSeparator = "\n--moe-fuzz-next-file--\n";

// This process's own folder (libFuzzer's -jobs/-fork run several processes at once) under $TMPDIR
// when set, else /dev/shm where it exists (memory: creating and deleting files each input on a disk
// file system, /tmp here, is 30 times slower and dominated the targets' time), else /tmp. Created on
// first use and removed at exit.
inline const std::filesystem::path& scratch_dir() {
  // Removed by its destructor at exit. (An atexit handler registered while this static was being built
  // ran after it was destroyed and removed nothing: every replay test left its folder behind.)
  struct Folder {
    std::filesystem::path path;
    ~Folder() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Folder folder{[] {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path base = std::getenv("TMPDIR") ? fs::path(std::getenv("TMPDIR"))
                          : fs::is_directory("/dev/shm", ec) ? fs::path("/dev/shm")
                                                             : fs::temp_directory_path();
    const fs::path p = base / ("moe-fuzz-" + std::to_string(::getpid()));
    fs::remove_all(p);
    fs::create_directories(p);
    return p;
  }()};
  return folder.path;
}

// A fresh, empty folder `name` under scratch_dir().
inline std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path p = scratch_dir() / name;
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p;
}

// Writes bytes to path; a failure here is the harness's, not the parser's: abort.
inline void write_file(const std::filesystem::path& path, std::string_view bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size() || std::fclose(f) != 0) {
    std::fprintf(stderr, "fuzz harness: cannot write %s\n", path.c_str());
    std::abort();
  }
}

// The input cut at every kFileSeparator (one piece when there is none).
inline std::vector<std::string_view> split_files(std::string_view input) {
  std::vector<std::string_view> pieces;
  for (;;) {
    const size_t at = input.find(kFileSeparator);
    if (at == std::string_view::npos) break;
    pieces.push_back(input.substr(0, at));
    input.remove_prefix(at + kFileSeparator.size());
  }
  pieces.push_back(input);
  return pieces;
}

// An invariant of the code under test that the input broke: a crash for libFuzzer to keep.
inline void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz invariant broken: %s\n", what);
    std::abort();
  }
}

}  // namespace moe::fuzz
