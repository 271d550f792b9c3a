#include "model/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <stdexcept>

#include "model/data.h"
#include "model/safetensors.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kStateFile = "state.json";

std::string hex64(uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(s[i]);
  }
  return out + "]";
}

void fsync_dir(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// REQUIRES of both entry points: opt's moments belong to params, in order.
void check_optimizer(const char* fn, const std::vector<Param*>& params, const AdamW& opt) {
  bool ok = opt.params().size() == params.size();
  for (size_t i = 0; ok && i < params.size(); ++i)
    ok = opt.params()[i] == params[i] && opt.m(i).shape() == params[i]->value.shape() &&
         opt.v(i).shape() == params[i]->value.shape();
  if (!ok) throw std::logic_error(std::string(fn) + ": the optimizer was not built over these parameters");
}

// The absolute path of a checkpoint folder without a trailing separator ("ck/" is "ck").
fs::path folder_path(const std::string& dir) {
  fs::path p = fs::absolute(dir).lexically_normal();
  if (p.filename().empty() && p.has_parent_path()) p = p.parent_path();
  return p;
}

// The files of part p of n (n == 1: the single-file names).
std::string part_file(const char* kind, int p, int n) {
  if (n == 1) return std::string(kind) + ".safetensors";
  return std::string(kind) + "-" + std::to_string(p) + "-of-" + std::to_string(n) + ".safetensors";
}

// "model-3-of-4.safetensors" or "optimizer-0-of-2.safetensors".
bool is_part_file(const std::string& n) {
  for (const char* kind : {"model-", "optimizer-"}) {
    const size_t k = std::strlen(kind);
    if (n.compare(0, k, kind) != 0 || n.size() < k + 16) continue;
    if (n.compare(n.size() - 12, 12, ".safetensors") != 0) continue;
    const std::string mid = n.substr(k, n.size() - 12 - k);  // "3-of-4"
    const size_t of = mid.find("-of-");
    if (of == std::string::npos || of == 0 || of + 4 == mid.size()) continue;
    bool digits = true;
    for (size_t i = 0; i < mid.size(); ++i)
      if (i < of || i >= of + 4) digits = digits && std::isdigit(static_cast<unsigned char>(mid[i]));
    if (digits) return true;
  }
  return false;
}

// Whether an existing `dir` may be replaced: a folder holding only what save_checkpoint writes.
Status replaceable(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return Status::error("checkpoint: " + dir.string() + " exists and is not a directory; refusing to replace it");
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    bool ours = is_part_file(n) || (n.size() > 4 && n.compare(n.size() - 4, 4, ".tmp") == 0 &&
                                    is_part_file(n.substr(0, n.size() - 4)));
    for (const char* f : {kModelFile, kOptimizerFile, kStateFile})
      ours = ours || n == f || n == std::string(f) + ".tmp";
    if (!ours)
      return Status::error("checkpoint: " + dir.string() + " exists and holds " + n +
                           ", which is not a checkpoint file; refusing to replace it");
  }
  if (ec) return Status::error("checkpoint: cannot list " + dir.string() + ": " + ec.message());
  return Status::ok();
}

// Moves the complete folder `tmp` to `dst`, replacing an existing `dst` (see the top of the header).
Status install(const fs::path& tmp, const fs::path& dst) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(dst, ec))) {
    if (std::rename(tmp.c_str(), dst.c_str()) != 0)
      return Status::error("checkpoint: cannot rename " + tmp.string() + " to " + dst.string() + ": " +
                           std::strerror(errno));
    fsync_dir(dst.parent_path());
    return Status::ok();
  }
  if (Status s = replaceable(dst); !s) return s;
  // One atomic step: dst holds the new checkpoint and tmp the old one.
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dst.c_str(), RENAME_EXCHANGE) == 0) {
    fsync_dir(dst.parent_path());
    fs::remove_all(tmp, ec);
    return Status::ok();
  }
  if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
    return Status::error("checkpoint: cannot swap " + tmp.string() + " into " + dst.string() + ": " +
                         std::strerror(errno));
  // No RENAME_EXCHANGE on this file system: move the old one aside, the new one in, delete the old.
  const fs::path old = dst.string() + ".old-" + std::to_string(::getpid());
  fs::remove_all(old, ec);
  if (std::rename(dst.c_str(), old.c_str()) != 0)
    return Status::error("checkpoint: cannot move the old " + dst.string() + " aside: " + std::strerror(errno));
  if (std::rename(tmp.c_str(), dst.c_str()) != 0) {
    const int e = errno;
    std::rename(old.c_str(), dst.c_str());  // put the old one back
    return Status::error("checkpoint: cannot rename " + tmp.string() + " to " + dst.string() + ": " + std::strerror(e));
  }
  fsync_dir(dst.parent_path());
  fs::remove_all(old, ec);
  return Status::ok();
}

// Checks that `loaded` holds exactly the tensors of `expected` (name -> destination) with the same
// shapes. `kind` prefixes tensor names in messages ("tensor", "optimizer tensor").
Status match(const std::string& what, const char* kind, const std::map<std::string, LoadedTensor>& loaded,
             const std::vector<std::pair<std::string, Tensor*>>& expected) {
  for (const auto& [name, dst] : expected) {
    auto it = loaded.find(name);
    if (it == loaded.end()) return Status::error(what + ": " + kind + " " + name + " is missing");
    if (it->second.shape != dst->shape())
      return Status::error(what + ": " + kind + " " + name + " has shape " + shape_str(it->second.shape) +
                           ", the model expects " + shape_str(dst->shape()));
  }
  if (loaded.size() != expected.size()) {
    std::map<std::string, int> names;
    for (const auto& e : expected) names[e.first] = 1;
    for (const auto& [name, t] : loaded)
      if (!names.count(name))
        return Status::error(what + ": has " + kind + " " + name + ", which the model does not have");
  }
  return Status::ok();
}

void copy_into(const std::map<std::string, LoadedTensor>& loaded,
               const std::vector<std::pair<std::string, Tensor*>>& expected) {
  for (const auto& [name, dst] : expected) {
    const LoadedTensor& t = loaded.at(name);
    std::copy(t.data.begin(), t.data.end(), dst->data());
  }
}

// One file of a part: the tensors (a sharded parameter's rows under its own name) and the metadata
// "rows" for the sharded ones: {name: [first, full_rows]} for rows [first, first + n), or
// {name: {"full": full_rows, "rows": [r0, r1, ...]}} for rows held in that order (re-sharded experts).
Status encode_part(const std::vector<TensorRef>& tensors, const json& rows, std::map<std::string, std::string> meta,
                   std::string* bytes) {
  if (!rows.empty()) meta["rows"] = rows.dump();
  return encode_safetensors(tensors, meta, bytes);
}

// Joins the parts' tensors: a name without "rows" metadata must come from one file only; with it,
// the pieces must cover rows [0, full_rows) exactly once and agree in their other dimensions.
struct Piece {
  int64_t first = 0, full_rows = 0;
  std::vector<int64_t> ids;  // explicit rows (else [first, first + rows))
  LoadedTensor t;
};
Status join_parts(const std::string& what, std::map<std::string, std::vector<Piece>>& pieces,
                  std::map<std::string, LoadedTensor>* out) {
  for (auto& [name, list] : pieces) {
    if (list.size() == 1 && list[0].full_rows == 0) {
      (*out)[name] = std::move(list[0].t);
      continue;
    }
    // Every piece's rows go to their place in the whole tensor; each row exactly once.
    std::vector<int64_t> shape;
    for (const Piece& p : list) {
      if (p.full_rows == 0 || p.t.shape.empty())
        return Status::error(what + ": tensor " + name + " is stored whole in one part and in pieces in another");
      std::vector<int64_t> rest(p.t.shape.begin() + 1, p.t.shape.end());
      if (shape.empty()) {
        shape = p.t.shape;
        shape[0] = p.full_rows;
      }
      if (p.full_rows != shape[0] || rest != std::vector<int64_t>(shape.begin() + 1, shape.end()))
        return Status::error(what + ": the parts of tensor " + name + " disagree on its shape");
    }
    // full_rows is a number from the file: before it sizes anything, the pieces must hold exactly
    // that many rows between them, each row at least one element, so the whole tensor is no larger
    // than the data read (else a corrupted "rows" could ask for terabytes).
    int64_t held_rows = 0;
    for (const Piece& p : list)
      if (__builtin_add_overflow(held_rows, p.t.shape[0], &held_rows)) held_rows = -1;
    if (held_rows != shape[0])
      return Status::error(what + ": the parts of tensor " + name + " hold " +
                           (held_rows < 0 ? std::string("too many") : std::to_string(held_rows)) + " rows, its full " +
                           "row count is " + std::to_string(shape[0]));
    int64_t row_elems = 1;
    for (size_t d = 1; d < shape.size(); ++d) row_elems *= shape[d];  // bounded: some piece holds a row
    if (row_elems == 0)
      return Status::error(what + ": tensor " + name + " is stored in pieces but its rows are empty (shape " +
                           shape_str(shape) + ")");
    LoadedTensor whole;
    whole.shape = shape;
    whole.data.assign(static_cast<size_t>(shape[0] * row_elems), 0.0f);
    std::vector<char> seen(static_cast<size_t>(shape[0]), 0);
    for (const Piece& p : list)
      for (int64_t i = 0; i < p.t.shape[0]; ++i) {
        const int64_t row = p.ids.empty() ? p.first + i : p.ids[i];
        if (row < 0 || row >= shape[0] || seen[row])
          return Status::error(what + ": the parts of tensor " + name + " do not cover its " +
                               std::to_string(shape[0]) + " rows exactly once (row " + std::to_string(row) + ")");
        seen[row] = 1;
        std::copy(p.t.data.begin() + i * row_elems, p.t.data.begin() + (i + 1) * row_elems,
                  whole.data.begin() + row * row_elems);
      }
    const int64_t held = std::count(seen.begin(), seen.end(), 1);
    if (held != shape[0])
      return Status::error(what + ": the parts of tensor " + name + " hold " + std::to_string(held) + " of its " +
                           std::to_string(shape[0]) + " rows");
    (*out)[name] = std::move(whole);
  }
  return Status::ok();
}

// Reads, verifies (size, checksum from state.json) and joins every `kind` file of the checkpoint.
Status read_kind(const std::string& dir, const json& st, const char* kind, std::map<std::string, LoadedTensor>* out,
                 std::map<std::string, std::string>* first_meta) {
  const std::string what = "checkpoint " + dir;
  int n_parts = 1;
  if (st.contains("parts")) {
    if (!st["parts"].is_number_integer() || st["parts"].get<int64_t>() < 1 || st["parts"].get<int64_t>() > 1 << 20)
      return Status::error(what + ": state.json has an invalid parts count");
    n_parts = st["parts"].get<int>();
  }
  std::map<std::string, std::vector<Piece>> pieces;
  for (int p = 0; p < n_parts; ++p) {
    const std::string file = part_file(kind, p, n_parts);
    std::string bytes;
    if (Status s = read_file((fs::path(dir) / file).string(), &bytes); !s) return Status::error(what + ": " + s.message());
    // Typed look-ups, not get<>() in a try: get<size_t>() of an out-of-range float (1e300) is
    // undefined behaviour, not an exception.
    const json* entry = nullptr;
    if (auto files = st.find("files"); files != st.end() && files->is_object())
      if (auto e = files->find(file); e != files->end() && e->is_object()) entry = &*e;
    if (!entry || !entry->contains("bytes") || !(*entry)["bytes"].is_number_unsigned() ||
        !entry->contains("fnv1a64") || !(*entry)["fnv1a64"].is_string())
      return Status::error(what + ": state.json lacks the size and checksum of " + file);
    const uint64_t want_bytes = (*entry)["bytes"].get<uint64_t>();
    const std::string want_sum = (*entry)["fnv1a64"].get<std::string>();
    if (bytes.size() != want_bytes)
      return Status::error(what + ": " + file + " has " + std::to_string(bytes.size()) + " bytes, state.json says " +
                           std::to_string(want_bytes) + " (truncated or replaced)");
    const std::string sum = hex64(fnv1a64(bytes.data(), bytes.size()));
    if (sum != want_sum)
      return Status::error(what + ": " + file + " fails its checksum (FNV-1a 64 " + sum + ", state.json says " +
                           want_sum + "): corrupted");
    std::map<std::string, LoadedTensor> tensors;
    std::map<std::string, std::string> meta;
    if (Status s = decode_safetensors(bytes, what + "/" + file, &tensors, &meta); !s) return s;
    json rows = json::object();
    if (meta.count("rows")) {
      rows = json::parse(meta["rows"], nullptr, false);
      if (!rows.is_object()) return Status::error(what + ": " + file + " has malformed \"rows\" metadata");
    }
    for (auto& [name, t] : tensors) {
      Piece piece;
      if (rows.contains(name)) {
        const json& r = rows[name];
        const bool range = r.is_array() && r.size() == 2 && r[0].is_number_integer() && r[1].is_number_integer() &&
                           r[0].get<int64_t>() >= 0 && r[1].get<int64_t>() >= 1;
        const bool listed = r.is_object() && r.contains("full") && r["full"].is_number_integer() &&
                            r["full"].get<int64_t>() >= 1 && r.contains("rows") && r["rows"].is_array() &&
                            !t.shape.empty() && static_cast<int64_t>(r["rows"].size()) == t.shape[0] &&
                            std::all_of(r["rows"].begin(), r["rows"].end(), [](const json& x) { return x.is_number_integer(); });
        if (t.shape.empty() || (!range && !listed))
          return Status::error(what + ": " + file + " has malformed \"rows\" for tensor " + name);
        if (range && r[0].get<int64_t>() > r[1].get<int64_t>() - t.shape[0])
          return Status::error(what + ": " + file + " has \"rows\" " + r.dump() + " for tensor " + name + " of " +
                               std::to_string(t.shape[0]) + " rows: past its full row count");
        if (range) {
          piece.first = r[0].get<int64_t>();
          piece.full_rows = r[1].get<int64_t>();
        } else {
          piece.full_rows = r["full"].get<int64_t>();
          piece.ids = r["rows"].get<std::vector<int64_t>>();
        }
      }
      piece.t = std::move(t);
      auto& list = pieces[name];
      if (!list.empty() && (piece.full_rows == 0 || list[0].full_rows == 0))
        return Status::error(what + ": tensor " + name + " appears in more than one part");
      list.push_back(std::move(piece));
    }
    if (p == 0 && first_meta) *first_meta = std::move(meta);
  }
  return join_parts(what, pieces, out);
}

Status state_from(const std::string& dir, json* st) {
  const std::string what = "checkpoint " + dir;
  if (!fs::is_directory(dir)) return Status::error(what + ": no such directory");
  std::string state_text;
  if (Status s = read_file((fs::path(dir) / kStateFile).string(), &state_text); !s)
    return Status::error(what + ": " + s.message());
  try {
    *st = json::parse(state_text);
  } catch (const json::exception&) {
    return Status::error(what + ": state.json is not valid JSON");
  }
  if (!st->is_object()) return Status::error(what + ": state.json is not a JSON object");
  return Status::ok();
}

}  // namespace

Status read_checkpoint_state(const std::string& dir, json* state) { return state_from(dir, state); }

namespace {

std::string model_config_text(const json& state) {
  if (state.is_object() && state.contains("config") && state["config"].is_object() &&
      state["config"].contains("model"))
    return state["config"]["model"].dump(-1, ' ', false, json::error_handler_t::replace);
  return "";
}

}  // namespace

std::string checkpoint_staging_dir(const std::string& dir, int64_t id) {
  return folder_path(dir).string() + ".tmp-" + std::to_string(id);
}

Status begin_checkpoint(const std::string& dir, const std::string& staging) {
  const fs::path final_dir = folder_path(dir);
  std::error_code ec;
  // Refuse early (nothing written yet) what finish_checkpoint would refuse to replace.
  if (fs::exists(fs::symlink_status(final_dir, ec)))
    if (Status s = replaceable(final_dir); !s) return s;
  fs::remove_all(staging, ec);
  fs::create_directories(staging, ec);
  if (ec) return Status::error("checkpoint: cannot create " + staging + ": " + ec.message());
  return Status::ok();
}

Status write_checkpoint_part(const std::string& staging, int part, int n_parts, const AdamW& opt, bool with_replicated,
                             const json& state) {
  if (part < 0 || part >= n_parts) throw std::logic_error("write_checkpoint_part: REQUIRES 0 <= part < n_parts");
  std::vector<TensorRef> weights, moments;
  json rows = json::object(), moment_rows = json::object();
  for (size_t i = 0; i < opt.params().size(); ++i) {
    const Param* p = opt.params()[i];
    if (!p->sharded() && !with_replicated) continue;
    if (p->sharded() && p->value.dim(0) == 0) continue;  // this part holds none of its rows
    weights.push_back({p->name, p->value.shape(), p->value.data()});
    moments.push_back({p->name + ".m", p->value.shape(), opt.m(i).data()});
    moments.push_back({p->name + ".v", p->value.shape(), opt.v(i).data()});
    if (p->sharded()) {
      const json r = p->shard_rows.empty() ? json{p->shard_begin, p->full_dim0}
                                           : json{{"full", p->full_dim0}, {"rows", p->shard_rows}};
      rows[p->name] = r;
      moment_rows[p->name + ".m"] = r;
      moment_rows[p->name + ".v"] = r;
    }
  }
  std::map<std::string, std::string> model_meta{{"format", "moe"}};
  if (std::string cfg = model_config_text(state); !cfg.empty()) model_meta["model_config"] = cfg;
  std::string model_bytes, opt_bytes;
  if (Status s = encode_part(weights, rows, model_meta, &model_bytes); !s)
    return Status::error("checkpoint " + staging + ": " + s.message());
  if (Status s = encode_part(moments, moment_rows, {{"format", "moe"}, {"step", std::to_string(opt.steps())}},
                             &opt_bytes);
      !s)
    return Status::error("checkpoint " + staging + ": " + s.message());
  Status s = write_file_atomic((fs::path(staging) / part_file("model", part, n_parts)).string(), model_bytes);
  if (s) s = write_file_atomic((fs::path(staging) / part_file("optimizer", part, n_parts)).string(), opt_bytes);
  if (!s) return Status::error(s.message().rfind("checkpoint", 0) == 0 ? s.message() : "checkpoint: " + s.message());
  return Status::ok();
}

Status finish_checkpoint(const std::string& dir, const std::string& staging, int n_parts, const AdamW& opt,
                         const json& state) {
  if (!state.is_object() && !state.is_null())
    return Status::error("checkpoint " + dir + ": the state must be a JSON object, not " + state.type_name());
  json st = state.is_null() ? json::object() : state;
  st["optimizer_step"] = opt.steps();
  st["parts"] = n_parts;
  st["files"] = json::object();
  for (int p = 0; p < n_parts; ++p) {
    for (const char* kind : {"model", "optimizer"}) {
      const std::string file = part_file(kind, p, n_parts);
      std::string bytes;
      if (Status s = read_file((fs::path(staging) / file).string(), &bytes); !s)
        return Status::error("checkpoint " + dir + ": part " + std::to_string(p) + " is missing: " + s.message());
      st["files"][file] = {{"bytes", bytes.size()}, {"fnv1a64", hex64(fnv1a64(bytes.data(), bytes.size()))}};
    }
  }
  std::string state_text;
  try {
    state_text = st.dump(2) + "\n";
  } catch (const json::exception&) {
    return Status::error("checkpoint " + dir + ": the state holds a string that is not valid UTF-8");
  }
  Status s = write_file_atomic((fs::path(staging) / kStateFile).string(), state_text);
  if (s) {
    fsync_dir(staging);
    s = install(staging, folder_path(dir));
  }
  if (!s) return Status::error(s.message().rfind("checkpoint", 0) == 0 ? s.message() : "checkpoint: " + s.message());
  return Status::ok();
}

void abandon_checkpoint(const std::string& staging) {
  std::error_code ec;
  fs::remove_all(staging, ec);
}

Status save_checkpoint(const std::string& dir, const std::vector<Param*>& params, const AdamW& opt,
                       const json& state) {
  check_optimizer("save_checkpoint", params, opt);
  if (!state.is_object() && !state.is_null())
    return Status::error("checkpoint " + dir + ": the state must be a JSON object, not " + state.type_name());
  for (const Param* p : params)
    if (p->sharded()) throw std::logic_error("save_checkpoint: " + p->name + " is sharded; write parts instead");
  try {
    (void)json(state).dump();
  } catch (const json::exception&) {
    return Status::error("checkpoint " + dir + ": the state holds a string that is not valid UTF-8");
  }
  const std::string staging = checkpoint_staging_dir(dir, ::getpid());
  Status s = begin_checkpoint(dir, staging);
  if (s) s = write_checkpoint_part(staging, 0, 1, opt, true, state);
  if (s) s = finish_checkpoint(dir, staging, 1, opt, state);
  if (!s) abandon_checkpoint(staging);
  return s;
}

Status read_checkpoint_weights(const std::string& dir, std::map<std::string, LoadedTensor>* weights) {
  json st;
  if (Status s = state_from(dir, &st); !s) return s;
  std::map<std::string, LoadedTensor> w;
  if (Status s = read_kind(dir, st, "model", &w, nullptr); !s) return s;
  *weights = std::move(w);
  return Status::ok();
}

Status load_checkpoint(const std::string& dir, const std::vector<Param*>& params, AdamW* opt, json* state) {
  if (opt) check_optimizer("load_checkpoint", params, *opt);
  const std::string what = "checkpoint " + dir;
  json st;
  if (Status s = state_from(dir, &st); !s) return s;
  std::map<std::string, LoadedTensor> weights, moments;
  std::map<std::string, std::string> opt_meta;
  if (Status s = read_kind(dir, st, "model", &weights, nullptr); !s) return s;
  if (opt)
    if (Status s = read_kind(dir, st, "optimizer", &moments, &opt_meta); !s) return s;
  std::vector<std::pair<std::string, Tensor*>> want_w, want_m;
  for (size_t i = 0; i < params.size(); ++i) {
    want_w.emplace_back(params[i]->name, &params[i]->value);
    if (opt) {
      want_m.emplace_back(params[i]->name + ".m", &opt->m(i));
      want_m.emplace_back(params[i]->name + ".v", &opt->v(i));
    }
  }
  if (Status s = match(what, "tensor", weights, want_w); !s) return s;
  int64_t opt_step = 0;
  if (opt) {
    if (Status s = match(what, "optimizer tensor", moments, want_m); !s) return s;
    if (!st.contains("optimizer_step") || !st["optimizer_step"].is_number_integer() ||
        st["optimizer_step"].get<int64_t>() < 0)
      return Status::error(what + ": state.json lacks a valid optimizer_step");
    opt_step = st["optimizer_step"].get<int64_t>();
    if (opt_meta.count("step") && opt_meta["step"] != std::to_string(opt_step))
      return Status::error(what + ": optimizer.safetensors is at step " + opt_meta["step"] +
                           ", state.json says optimizer_step " + std::to_string(opt_step));
  }
  // Every check passed: now modify the caller's tensors.
  copy_into(weights, want_w);
  if (opt) {
    copy_into(moments, want_m);
    opt->set_steps(opt_step);
  }
  if (state) *state = std::move(st);
  return Status::ok();
}

}  // namespace moe
