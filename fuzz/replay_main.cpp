// The replay driver of the tests (fuzz/CMakeLists.txt): links one fuzz target's source without
// libFuzzer and runs LLVMFuzzerTestOneInput over every file of the folders given (the target's
// corpus and its crash regressions). A crash, sanitizer report, uncaught exception or broken
// invariant fails the test as it failed the fuzzer; so does an empty corpus (nothing was checked).
// A folder that does not exist (a target with no crash found yet has no regressions folder) is
// skipped, named.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CORPUS_FOLDER...\n", argv[0]);
    return 2;
  }
  int64_t replayed = 0;
  for (int a = 1; a < argc; ++a) {
    if (!fs::is_directory(argv[a])) {
      std::printf("%s: no such folder, skipped\n", argv[a]);
      continue;
    }
    std::vector<fs::path> files;
    for (const fs::directory_entry& e : fs::directory_iterator(argv[a]))
      if (e.is_regular_file()) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const fs::path& f : files) {
      std::ifstream in(f, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ++replayed;
    }
    std::printf("%s: %zu inputs\n", argv[a], files.size());
  }
  std::printf("replayed %lld inputs\n", static_cast<long long>(replayed));
  return replayed > 0 ? 0 : 1;
}
