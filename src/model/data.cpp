#include "model/data.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <system_error>

namespace moe {

namespace fs = std::filesystem;

std::vector<int32_t> tokenize(std::string_view text) {
  std::vector<int32_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = byte_to_token(static_cast<uint8_t>(text[i]));
  return out;
}

std::string detokenize(const int32_t* tokens, int64_t n) {
  std::string out(static_cast<size_t>(n), '\0');
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= kByteVocab)
      throw std::logic_error("detokenize: token " + std::to_string(tokens[i]) + " out of [0, 256)");
    out[i] = static_cast<char>(token_to_byte(tokens[i]));
  }
  return out;
}

namespace {

Status read_file(const std::string& path, std::vector<uint8_t>* out) {
  out->clear();
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return Status::error("data: cannot read " + path + ": " + std::strerror(errno));
  uint8_t buf[1 << 16];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), f)) > 0) out->insert(out->end(), buf, buf + got);
  bool err = std::ferror(f);
  int e = errno;
  std::fclose(f);
  if (err) return Status::error("data: cannot read " + path + ": " + std::strerror(e));
  return Status::ok();
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The corpus files under `path`, sorted by path string. A file path is taken as is (no suffix filter).
Status list_files(const std::string& path, const std::string& suffix, std::vector<std::string>* files) {
  std::error_code ec;
  fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) {
    return Status::error("data: corpus path " + path + " does not exist" + (ec ? " (" + ec.message() + ")" : ""));
  }
  if (!fs::is_directory(st)) {
    files->push_back(path);
    return Status::ok();
  }
  fs::recursive_directory_iterator it(path, fs::directory_options::none, ec);
  if (ec) return Status::error("data: cannot read folder " + path + ": " + ec.message());
  for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) break;
    std::error_code ec2;
    if (!it->is_regular_file(ec2)) continue;  // folders, links to folders, sockets, dangling links
    std::string p = it->path().generic_string();
    if (!ends_with(it->path().filename().string(), suffix)) continue;
    files->push_back(std::move(p));
  }
  if (ec) return Status::error("data: cannot read folder under " + path + ": " + ec.message());
  std::sort(files->begin(), files->end());
  return Status::ok();
}

}  // namespace

Status TextDataset::open(const std::string& path, const DataOptions& opt, TextDataset* out) {
  if (opt.seq_len < 1) return Status::error("data: seq_len (" + std::to_string(opt.seq_len) + ") must be >= 1");
  if (!(opt.val_fraction > 0 && opt.val_fraction < 1)) {
    std::ostringstream m;
    m << "data: val_fraction (" << opt.val_fraction << ") must be in (0, 1)";
    return Status::error(m.str());
  }
  TextDataset d;
  d.opt_ = opt;
  if (Status s = list_files(path, opt.suffix, &d.files_); !s) return s;

  std::vector<uint8_t> bytes;
  for (const std::string& f : d.files_) {
    if (Status s = read_file(f, &bytes); !s) return s;
    d.content_hash_ = fnv1a64(bytes.data(), bytes.size(), d.content_hash_);
    size_t n_val = static_cast<size_t>(std::floor(static_cast<double>(bytes.size()) * opt.val_fraction));
    size_t n_train = bytes.size() - n_val;
    d.train_.insert(d.train_.end(), bytes.begin(), bytes.begin() + n_train);
    d.val_.insert(d.val_.end(), bytes.begin() + n_train, bytes.end());
  }
  if (d.train_.empty() && d.val_.empty()) {
    std::string what = d.files_.empty()
                           ? "no file" + (opt.suffix.empty() ? std::string() : " ending in \"" + opt.suffix + "\"")
                           : std::to_string(d.files_.size()) + " empty file(s)";
    return Status::error("data: empty corpus at " + path + " (" + what + ")");
  }
  const size_t need = static_cast<size_t>(opt.seq_len) + 1;
  if (d.train_.size() < need || d.val_.size() < need) {
    const bool train = d.train_.size() < need;
    return Status::error("data: the " + std::string(train ? "training" : "validation") + " split of " + path +
                         " has " + std::to_string(train ? d.train_.size() : d.val_.size()) +
                         " bytes, fewer than seq_len + 1 = " + std::to_string(need) + " (corpus " +
                         std::to_string(d.train_.size() + d.val_.size()) + " bytes, val_fraction " +
                         (std::ostringstream() << opt.val_fraction).str() + ")");
  }

  int64_t counts[256] = {};
  for (uint8_t b : d.train_) ++counts[b];
  double h = 0;
  const double n = static_cast<double>(d.train_.size());
  for (int64_t c : counts)
    if (c > 0) h -= (c / n) * std::log(c / n);
  d.unigram_entropy_ = h;

  *out = std::move(d);
  return Status::ok();
}

int64_t TextDataset::train_offset(int64_t step, int64_t B, int64_t row) const {
  const uint64_t index = static_cast<uint64_t>(step) * static_cast<uint64_t>(B) + static_cast<uint64_t>(row);
  const uint64_t windows = train_.size() - static_cast<uint64_t>(opt_.seq_len);  // offsets 0 .. n-T-1
  return static_cast<int64_t>(splitmix64(splitmix64(opt_.seed) ^ index) % windows);
}

int64_t TextDataset::val_offset(int64_t j) const {
  const uint64_t frac = static_cast<uint64_t>(j) * 0x9E3779B97F4A7C15ull;  // frac(j / golden ratio) * 2^64
  const uint64_t windows = val_.size() - static_cast<uint64_t>(opt_.seq_len);
  return static_cast<int64_t>((static_cast<unsigned __int128>(frac) * windows) >> 64);
}

namespace {
void fill_window(const uint8_t* data, int64_t T, int32_t* tokens, int32_t* targets) {
  for (int64_t t = 0; t < T; ++t) {
    tokens[t] = byte_to_token(data[t]);
    targets[t] = byte_to_token(data[t + 1]);
  }
}
}  // namespace

void TextDataset::batch_rows(int64_t step, int64_t B, int64_t row_begin, int64_t rows, int32_t* tokens,
                             int32_t* targets) const {
  if (train_.empty()) throw std::logic_error("TextDataset::batch_rows: dataset not loaded");
  if (step < 0 || B < 1 || row_begin < 0 || rows < 0 || row_begin + rows > B)
    throw std::logic_error("TextDataset::batch_rows: bad step/B/rows");
  const int64_t T = opt_.seq_len;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t off = train_offset(step, B, row_begin + r);
    fill_window(train_.data() + off, T, tokens + r * T, targets + r * T);
  }
}

void TextDataset::val_batch(int64_t i, int64_t B, int32_t* tokens, int32_t* targets) const {
  if (val_.empty()) throw std::logic_error("TextDataset::val_batch: dataset not loaded");
  if (i < 0 || B < 1) throw std::logic_error("TextDataset::val_batch: bad i/B");
  const int64_t T = opt_.seq_len;
  for (int64_t r = 0; r < B; ++r) {
    int64_t off = val_offset(i * B + r);
    fill_window(val_.data() + off, T, tokens + r * T, targets + r * T);
  }
}

}  // namespace moe
