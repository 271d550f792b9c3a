// Fuzz target: the data loader (model/data.h: TextDataset::open over a corpus folder, then batches).
// The input: 4 option bytes, then the corpus files cut at fuzz_util.h's kFileSeparator:
//   byte 0: seq_len = 1 + byte % 64          byte 1: val_fraction = (byte + 1) / 258, in (0, 1)
//   byte 2: bit 0 = only files ending ".txt"  byte 3: the batch order seed
//   file i is written as "<i>.txt" when i is even, "sub/<i>.md" when odd (a folder corpus, recursive).
// Every batch of an opened dataset must hold byte tokens of its own corpus.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "model/data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using moe::fuzz::require;
  if (size < 4) return 0;
  moe::DataOptions opt;
  opt.seq_len = 1 + data[0] % 64;
  opt.val_fraction = (data[1] + 1.0) / 258.0;
  opt.suffix = (data[2] & 1) ? ".txt" : "";
  opt.seed = data[3];

  const std::filesystem::path dir = moe::fuzz::fresh_dir("corpus");
  std::filesystem::create_directories(dir / "sub");
  const std::vector<std::string_view> files =
      moe::fuzz::split_files(std::string_view(reinterpret_cast<const char*>(data) + 4, size - 4));
  int64_t corpus_bytes = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    const bool txt = i % 2 == 0;
    moe::fuzz::write_file(txt ? dir / (std::to_string(i) + ".txt") : dir / "sub" / (std::to_string(i) + ".md"),
                          files[i]);
    if (txt || opt.suffix.empty()) corpus_bytes += static_cast<int64_t>(files[i].size());
  }

  moe::TextDataset ds;
  if (!moe::TextDataset::open(dir.string(), opt, &ds)) return 0;
  require(ds.total_bytes() == corpus_bytes, "every byte of the matching files is in a split");
  require(ds.train_bytes() > opt.seq_len && ds.val_bytes() > opt.seq_len, "both splits hold a window");
  const int64_t T = opt.seq_len, B = 3;
  std::vector<int32_t> tokens(B * T), targets(B * T);
  for (int64_t step = 0; step < 3; ++step) {
    ds.batch(step, B, tokens.data(), targets.data());
    for (int64_t i = 0; i < B * T; ++i) require(tokens[i] >= 0 && tokens[i] < 256 && targets[i] >= 0 && targets[i] < 256, "byte tokens");
  }
  ds.val_batch(0, B, tokens.data(), targets.data());
  ds.val_batch(1000, B, tokens.data(), targets.data());
  const int64_t last = ds.train_offset(7, B, B - 1);
  require(last >= 0 && last + T < ds.train_bytes(), "training windows lie inside the split");
  return 0;
}
