// Byte-level tokenizer and the text dataset the trainer samples batches from.
//
// Corpus: one text file, or every regular file under a folder (recursively; symbolic links to
// folders are not entered), optionally only names ending in a suffix (the default corpus uses ".rst.txt"), read in
// order of their path strings (byte-wise), so the corpus is identical on every machine.
//
// Split (robust to which files exist and in what order): each file of n bytes gives its first
// n - floor(n * val_fraction) bytes to the training split and its last floor(n * val_fraction)
// bytes to the validation split; each split is the concatenation of its parts in file order.
// Every file therefore contributes to both splits, and adding or removing a file never moves
// bytes of another file between splits.
//
// Batches are pure functions of their index, so a run's data position is just its step number
// (exact resume) and any rank can produce any rows of a global batch:
//   train row r of step s, global batch B: window offset
//       o = splitmix64(splitmix64(seed) ^ (s * B + r)) % (n_train - T)
//   validation window j (= i * B + r of val_batch(i, B)): a fixed low-discrepancy (Weyl) sequence
//       o = floor(frac(j * 0x9E3779B97F4A7C15 / 2^64) * (n_val - T)),
//     independent of the training seed, spread evenly over the whole validation split for any
//     number of windows.
//   tokens = bytes[o, o+T), targets = bytes[o+1, o+T+1).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "util/status.h"

namespace moe {

// ---- stable hashes (identical on every platform) ---------------------------------------------
constexpr uint64_t kFnv1aOffset = 0xcbf29ce484222325ull;
constexpr uint64_t kFnv1aPrime = 0x100000001b3ull;
// FNV-1a 64 over n bytes, continuing from h (pass the previous result to hash a sequence of pieces).
inline uint64_t fnv1a64(const void* data, size_t n, uint64_t h = kFnv1aOffset) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * kFnv1aPrime;
  return h;
}
// The splitmix64 finalizer (Steele et al.): a bijective 64-bit mix.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// ---- byte-level tokenizer: token id = byte value, vocabulary 256 -----------------------------
constexpr int64_t kByteVocab = 256;
inline int32_t byte_to_token(uint8_t b) { return static_cast<int32_t>(b); }
// REQUIRES: 0 <= t < 256.
inline uint8_t token_to_byte(int32_t t) { return static_cast<uint8_t>(t); }
std::vector<int32_t> tokenize(std::string_view text);
std::string detokenize(const int32_t* tokens, int64_t n);

struct DataOptions {
  int64_t seq_len = 128;        // T of every window
  double val_fraction = 0.05;   // share of each file held out for validation, in (0, 1)
  std::string suffix;           // folder corpus: only files whose name ends in this ("" = all)
  uint64_t seed = 0;            // training batch order
};

// Thread safety: const methods may be called concurrently.
class TextDataset {
 public:
  TextDataset() = default;
  // Loads `path` (a file or a folder). Errors: missing path, unreadable file or folder, empty
  // corpus (no matching file, or all empty), a split shorter than seq_len + 1 bytes, bad options.
  static Status open(const std::string& path, const DataOptions& opt, TextDataset* out);

  const DataOptions& options() const { return opt_; }
  int64_t seq_len() const { return opt_.seq_len; }
  const std::vector<std::string>& files() const { return files_; }  // in load order
  int64_t total_bytes() const { return static_cast<int64_t>(train_.size() + val_.size()); }
  int64_t train_bytes() const { return static_cast<int64_t>(train_.size()); }
  int64_t val_bytes() const { return static_cast<int64_t>(val_.size()); }
  const std::vector<uint8_t>& train_data() const { return train_; }
  const std::vector<uint8_t>& val_data() const { return val_; }
  // FNV-1a 64 of the corpus bytes in file order (before the split): equal corpora, equal hash.
  uint64_t content_hash() const { return content_hash_; }
  // Entropy of the byte unigram distribution of the training split, in nats: the loss of a model
  // that knows only byte frequencies (ln 256 = 5.545 is the loss of a uniform guess).
  double unigram_entropy() const { return unigram_entropy_; }

  // Training window offset of row `row` of step `step` with global batch B (see the top of the file).
  int64_t train_offset(int64_t step, int64_t B, int64_t row) const;
  // Validation window offset of window j.
  int64_t val_offset(int64_t j) const;

  // Rows [row_begin, row_begin + rows) of the global batch of step `step` (global batch size B):
  // tokens and targets [rows, T]. batch() is all B rows. REQUIRES: step >= 0, B >= 1,
  // 0 <= row_begin, row_begin + rows <= B.
  void batch_rows(int64_t step, int64_t B, int64_t row_begin, int64_t rows, int32_t* tokens,
                  int32_t* targets) const;
  void batch(int64_t step, int64_t B, int32_t* tokens /*[B,T]*/, int32_t* targets /*[B,T]*/) const {
    batch_rows(step, B, 0, B, tokens, targets);
  }
  // Validation batch i: windows i*B .. i*B+B-1 of the fixed validation sequence. The first k*B
  // windows are the same whatever B is. REQUIRES: i >= 0, B >= 1.
  void val_batch(int64_t i, int64_t B, int32_t* tokens /*[B,T]*/, int32_t* targets /*[B,T]*/) const;

 private:
  DataOptions opt_;
  std::vector<std::string> files_;
  std::vector<uint8_t> train_, val_;
  uint64_t content_hash_ = kFnv1aOffset;
  double unigram_entropy_ = 0;
};

}  // namespace moe
