// Tokenizer and TextDataset: load order, split, determinism of batches, every error path.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "model/data.h"

namespace fs = std::filesystem;
using moe::DataOptions;
using moe::Status;
using moe::TextDataset;

namespace {

// A fresh folder under the system temp dir, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("moe_test_data_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string path() const { return path_.string(); }
  std::string write(const std::string& rel, const std::string& content) const {
    fs::path p = path_ / rel;
    fs::create_directories(p.parent_path());
    std::ofstream f(p, std::ios::binary);
    f << content;
    return p.string();
  }

 private:
  fs::path path_;
};

std::string pattern(size_t n, uint32_t seed) {
  std::string s(n, '\0');
  uint64_t x = seed;
  for (size_t i = 0; i < n; ++i) {
    x = moe::splitmix64(x);
    s[i] = static_cast<char>(x & 0xff);
  }
  return s;
}

DataOptions opts(int64_t T, double val = 0.1, std::string suffix = "", uint64_t seed = 0) {
  DataOptions o;
  o.seq_len = T;
  o.val_fraction = val;
  o.suffix = std::move(suffix);
  o.seed = seed;
  return o;
}

}  // namespace

TEST(Tokenizer, ByteRoundTrip) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  std::vector<int32_t> t = moe::tokenize(all);
  ASSERT_EQ(t.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(t[b], b);
  EXPECT_EQ(moe::detokenize(t.data(), 256), all);
  EXPECT_EQ(moe::byte_to_token(0xE9), 233);
  EXPECT_EQ(moe::token_to_byte(233), 0xE9);
}

TEST(Hash, Fnv1aKnownValues) {
  // Reference values of FNV-1a 64 (http://www.isthe.com/chongo/tech/comp/fnv/).
  EXPECT_EQ(moe::fnv1a64("", 0), 0xcbf29ce484222325ull);
  EXPECT_EQ(moe::fnv1a64("a", 1), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(moe::fnv1a64("foobar", 6), 0x85944171f73967e8ull);
  // Hashing in pieces equals hashing the whole.
  EXPECT_EQ(moe::fnv1a64("bar", 3, moe::fnv1a64("foo", 3)), moe::fnv1a64("foobar", 6));
}

TEST(TextDataset, FolderOrderSuffixAndSplit) {
  TempDir d;
  const std::string a = pattern(1000, 1), b = pattern(333, 2), c = pattern(500, 3), z = pattern(200, 4);
  d.write("b.txt", b);
  d.write("a/z.txt", z);
  d.write("a/b.rst.txt", a);
  d.write("c.rst.txt", c);
  d.write("sub/empty.rst.txt", "");

  TextDataset ds;
  Status s = TextDataset::open(d.path(), opts(16, 0.1), &ds);
  ASSERT_TRUE(s) << s.message();
  std::vector<std::string> rel;
  for (const auto& f : ds.files()) rel.push_back(fs::relative(f, d.path()).generic_string());
  EXPECT_EQ(rel, (std::vector<std::string>{"a/b.rst.txt", "a/z.txt", "b.txt", "c.rst.txt", "sub/empty.rst.txt"}));

  // Each file: first n - floor(0.1 n) bytes to train, the rest to validation.
  std::string train = a.substr(0, 900) + z.substr(0, 180) + b.substr(0, 300) + c.substr(0, 450);
  std::string val = a.substr(900) + z.substr(180) + b.substr(300) + c.substr(450);
  EXPECT_EQ(ds.train_bytes(), 900 + 180 + 300 + 450);
  EXPECT_EQ(ds.val_bytes(), 100 + 20 + 33 + 50);
  EXPECT_EQ(ds.total_bytes(), 1000 + 333 + 500 + 200);
  EXPECT_EQ(std::string(ds.train_data().begin(), ds.train_data().end()), train);
  EXPECT_EQ(std::string(ds.val_data().begin(), ds.val_data().end()), val);
  std::string all = a + z + b + c;
  EXPECT_EQ(ds.content_hash(), moe::fnv1a64(all.data(), all.size()));

  // Suffix filter: only *.rst.txt, still in path order.
  TextDataset rst;
  s = TextDataset::open(d.path(), opts(16, 0.1, ".rst.txt"), &rst);
  ASSERT_TRUE(s) << s.message();
  ASSERT_EQ(rst.files().size(), 3u);
  EXPECT_EQ(rst.total_bytes(), 1500);
  std::string ac = a + c;
  EXPECT_EQ(rst.content_hash(), moe::fnv1a64(ac.data(), ac.size()));

  // A single file path is taken as is (no suffix filter) and is split like a folder of one file.
  TextDataset one;
  s = TextDataset::open(d.path() + "/b.txt", opts(16, 0.1, ".rst.txt"), &one);
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(one.train_bytes(), 300);
  EXPECT_EQ(one.val_bytes(), 33);
}

TEST(TextDataset, HashIndependentOfSplitAndSeed) {
  TempDir d;
  d.write("x.txt", pattern(4000, 7));
  TextDataset p, q;
  ASSERT_TRUE(TextDataset::open(d.path(), opts(32, 0.05, "", 1), &p));
  ASSERT_TRUE(TextDataset::open(d.path(), opts(64, 0.2, "", 2), &q));
  EXPECT_EQ(p.content_hash(), q.content_hash());
  d.write("x.txt", pattern(4000, 8));
  TextDataset r;
  ASSERT_TRUE(TextDataset::open(d.path(), opts(32, 0.05, "", 1), &r));
  EXPECT_NE(p.content_hash(), r.content_hash());
}

TEST(TextDataset, BatchIsPureFunctionOfSeedStepRow) {
  TempDir d;
  d.write("x.txt", pattern(20000, 11));
  const int64_t T = 32, B = 4;
  TextDataset p, q, other_seed;
  ASSERT_TRUE(TextDataset::open(d.path(), opts(T, 0.1, "", 5), &p));
  ASSERT_TRUE(TextDataset::open(d.path(), opts(T, 0.1, "", 5), &q));
  ASSERT_TRUE(TextDataset::open(d.path(), opts(T, 0.1, "", 6), &other_seed));

  std::vector<int32_t> tok1(B * T), tgt1(B * T), tok2(B * T), tgt2(B * T);
  p.batch(7, B, tok1.data(), tgt1.data());
  q.batch(7, B, tok2.data(), tgt2.data());
  EXPECT_EQ(tok1, tok2);
  EXPECT_EQ(tgt1, tgt2);
  p.batch(7, B, tok2.data(), tgt2.data());  // again, same instance (no hidden state)
  EXPECT_EQ(tok1, tok2);
  p.batch(8, B, tok2.data(), tgt2.data());
  EXPECT_NE(tok1, tok2);
  other_seed.batch(7, B, tok2.data(), tgt2.data());
  EXPECT_NE(tok1, tok2);

  // Rows are windows of the training split at train_offset(), targets shifted by one.
  const auto& train = p.train_data();
  for (int64_t r = 0; r < B; ++r) {
    int64_t off = p.train_offset(7, B, r);
    ASSERT_GE(off, 0);
    ASSERT_LE(off + T + 1, p.train_bytes());
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(tok1[r * T + t], train[off + t]);
      EXPECT_EQ(tgt1[r * T + t], train[off + t + 1]);
      if (t + 1 < T) {
        EXPECT_EQ(tgt1[r * T + t], tok1[r * T + t + 1]);
      }
    }
  }

  // Any rank can make its rows of the global batch: rows [1, 3) equal rows 1, 2 of the full batch.
  std::vector<int32_t> tok3(2 * T), tgt3(2 * T);
  p.batch_rows(7, B, 1, 2, tok3.data(), tgt3.data());
  EXPECT_TRUE(std::equal(tok3.begin(), tok3.end(), tok1.begin() + T));
  EXPECT_TRUE(std::equal(tgt3.begin(), tgt3.end(), tgt1.begin() + T));
}

TEST(TextDataset, TrainOffsetsCoverTheSplit) {
  TempDir d;
  d.write("x.txt", pattern(1000, 12));
  const int64_t T = 8;
  TextDataset p;
  ASSERT_TRUE(TextDataset::open(d.path(), opts(T, 0.1), &p));
  const int64_t windows = p.train_bytes() - T;  // offsets 0 .. n-T-1
  std::set<int64_t> seen;
  for (int64_t step = 0; step < 5000; ++step)
    for (int64_t r = 0; r < 4; ++r) {
      int64_t off = p.train_offset(step, 4, r);
      ASSERT_GE(off, 0);
      ASSERT_LT(off, windows);
      seen.insert(off);
    }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), windows);  // 20000 draws over 892 offsets: P(any missed) ~ 892 e^-22
}

TEST(TextDataset, ValidationSetIsFixed) {
  TempDir d;
  d.write("x.txt", pattern(20000, 13));
  const int64_t T = 16;
  TextDataset p, q;
  ASSERT_TRUE(TextDataset::open(d.path(), opts(T, 0.1, "", 1), &p));
  ASSERT_TRUE(TextDataset::open(d.path(), opts(T, 0.1, "", 99), &q));  // training seed does not matter

  std::vector<int32_t> a(4 * T), at(4 * T), b(4 * T), bt(4 * T);
  p.val_batch(0, 4, a.data(), at.data());
  q.val_batch(0, 4, b.data(), bt.data());
  EXPECT_EQ(a, b);
  EXPECT_EQ(at, bt);
  // The first k*B windows do not depend on B: batch 0 of B=4 == batches 0 and 1 of B=2.
  q.val_batch(0, 2, b.data(), bt.data());
  q.val_batch(1, 2, b.data() + 2 * T, bt.data() + 2 * T);
  EXPECT_EQ(a, b);
  EXPECT_EQ(at, bt);

  const auto& val = p.val_data();
  for (int64_t r = 0; r < 4; ++r) {
    int64_t off = p.val_offset(r);
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(a[r * T + t], val[off + t]);
      EXPECT_EQ(at[r * T + t], val[off + t + 1]);
    }
  }
  // Windows spread over the whole split: 20 windows land in 20 distinct twentieths of it.
  const int64_t windows = p.val_bytes() - T;
  std::set<int64_t> bins;
  for (int64_t j = 0; j < 20; ++j) {
    int64_t off = p.val_offset(j);
    ASSERT_GE(off, 0);
    ASSERT_LT(off, windows);
    bins.insert(off * 20 / windows);
  }
  EXPECT_GE(bins.size(), 17u);
}

TEST(TextDataset, UnigramEntropy) {
  TempDir d;
  std::string ab;
  for (int i = 0; i < 500; ++i) ab += "ab";
  d.write("ab.txt", ab);
  TextDataset p;
  ASSERT_TRUE(TextDataset::open(d.path(), opts(8, 0.1), &p));
  EXPECT_NEAR(p.unigram_entropy(), std::log(2.0), 1e-12);

  std::string all;
  for (int rep = 0; rep < 10; ++rep)
    for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  TempDir e;
  e.write("all.bin", all);
  TextDataset q;
  ASSERT_TRUE(TextDataset::open(e.path(), opts(8, 0.1), &q));
  // The training split is the first 2304 bytes = 9 full cycles: uniform.
  EXPECT_NEAR(q.unigram_entropy(), std::log(256.0), 1e-12);
}

// ---- errors -------------------------------------------------------------------------------------

void expect_error(const Status& s, const std::string& needle) {
  ASSERT_FALSE(s) << "expected an error containing: " << needle;
  EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  std::printf("  error: %s\n", s.message().c_str());
}

TEST(TextDatasetErrors, MissingPath) {
  TextDataset p;
  expect_error(TextDataset::open("/nonexistent/moe/corpus", opts(8), &p), "does not exist");
}

TEST(TextDatasetErrors, UnreadableFile) {
  TempDir d;
  std::string f = d.write("x.txt", pattern(1000, 1));
  std::string unreadable = f;
  if (::geteuid() == 0) {
    // root reads any mode bits; /proc/self/mem opens but its first page cannot be read (EIO).
    unreadable = "/proc/self/mem";
  } else {
    fs::permissions(f, fs::perms::none);
  }
  TextDataset p;
  expect_error(TextDataset::open(unreadable, opts(8), &p), "cannot read");
  // Also inside a folder (a link to the unreadable file is listed as a regular file).
  TempDir e;
  e.write("a.txt", pattern(1000, 2));
  fs::create_symlink(unreadable, fs::path(e.path()) / "b.txt");
  expect_error(TextDataset::open(e.path(), opts(8), &p), "cannot read");
}

TEST(TextDatasetErrors, UnreadableFolder) {
  if (::geteuid() == 0) GTEST_SKIP() << "running as root: mode bits do not stop reading a folder";
  TempDir d;
  d.write("a.txt", pattern(1000, 2));
  d.write("sub/b.txt", pattern(1000, 3));
  fs::permissions(fs::path(d.path()) / "sub", fs::perms::none);
  TextDataset p;
  Status s = TextDataset::open(d.path(), opts(8), &p);
  fs::permissions(fs::path(d.path()) / "sub", fs::perms::owner_all);
  expect_error(s, "cannot read");
}

TEST(TextDatasetErrors, EmptyCorpus) {
  TextDataset p;
  TempDir empty_folder;
  expect_error(TextDataset::open(empty_folder.path(), opts(8), &p), "empty corpus");
  TempDir no_match;
  no_match.write("a.txt", pattern(1000, 1));
  expect_error(TextDataset::open(no_match.path(), opts(8, 0.1, ".rst.txt"), &p), "no file ending in \".rst.txt\"");
  TempDir empty_files;
  std::string f = empty_files.write("a.txt", "");
  empty_files.write("b/c.txt", "");
  expect_error(TextDataset::open(empty_files.path(), opts(8), &p), "2 empty file(s)");
  expect_error(TextDataset::open(f, opts(8), &p), "empty corpus");
}

TEST(TextDatasetErrors, SplitShorterThanWindow) {
  TempDir d;
  d.write("x.txt", pattern(100, 1));  // train 90, val 10 bytes
  TextDataset p;
  ASSERT_TRUE(TextDataset::open(d.path(), opts(9, 0.1), &p));  // both splits hold exactly T + 1
  expect_error(TextDataset::open(d.path(), opts(10, 0.1), &p), "validation split");
  expect_error(TextDataset::open(d.path(), opts(10, 0.1), &p), "has 10 bytes, fewer than seq_len + 1 = 11");
  expect_error(TextDataset::open(d.path(), opts(60, 0.5), &p), "training split");
}

TEST(TextDatasetErrors, BadOptions) {
  TempDir d;
  d.write("x.txt", pattern(1000, 1));
  TextDataset p;
  expect_error(TextDataset::open(d.path(), opts(0), &p), "seq_len (0)");
  expect_error(TextDataset::open(d.path(), opts(8, 0.0), &p), "val_fraction");
  expect_error(TextDataset::open(d.path(), opts(8, 1.0), &p), "val_fraction");
  expect_error(TextDataset::open(d.path(), opts(8, std::nan("")), &p), "val_fraction");
}

TEST(TextDatasetErrors, FailedOpenLeavesTargetUnchanged) {
  TempDir d;
  d.write("x.txt", pattern(1000, 1));
  TextDataset p;
  ASSERT_TRUE(TextDataset::open(d.path(), opts(8), &p));
  uint64_t h = p.content_hash();
  EXPECT_FALSE(TextDataset::open("/nonexistent/moe/corpus", opts(8), &p));
  EXPECT_EQ(p.content_hash(), h);
  EXPECT_EQ(p.total_bytes(), 1000);
}

TEST(TextDataset, DefaultCorpus) {
  const std::string root = "/usr/share/doc/python3.11/html/_sources";
  if (!fs::exists(root)) GTEST_SKIP() << root << " not installed";
  DataOptions o;  // defaults: T 128, val 0.05
  o.suffix = ".rst.txt";
  TextDataset p;
  Status s = TextDataset::open(root, o, &p);
  ASSERT_TRUE(s) << s.message();
  std::printf("  default corpus: %zu files, %lld bytes (train %lld, val %lld), hash %016llx, "
              "unigram entropy %.4f nats\n",
              p.files().size(), (long long)p.total_bytes(), (long long)p.train_bytes(), (long long)p.val_bytes(),
              (unsigned long long)p.content_hash(), p.unigram_entropy());
  EXPECT_GT(p.files().size(), 100u);
  EXPECT_GT(p.total_bytes(), 1'000'000);
  EXPECT_GT(p.unigram_entropy(), 2.0);
  EXPECT_LT(p.unigram_entropy(), std::log(256.0));
}
