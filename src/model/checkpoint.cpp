#include "model/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

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

// Whether an existing `dir` may be replaced: a folder holding only what save_checkpoint writes.
Status replaceable(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return Status::error("checkpoint: " + dir.string() + " exists and is not a directory; refusing to replace it");
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    bool ours = false;
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

}  // namespace

Status save_checkpoint(const std::string& dir, const std::vector<Param*>& params, const AdamW& opt,
                       const json& state) {
  check_optimizer("save_checkpoint", params, opt);
  if (!state.is_object() && !state.is_null())
    return Status::error("checkpoint " + dir + ": the state must be a JSON object, not " + state.type_name());
  std::vector<TensorRef> weights, moments;
  for (size_t i = 0; i < params.size(); ++i) {
    const Param* p = params[i];
    weights.push_back({p->name, p->value.shape(), p->value.data()});
    moments.push_back({p->name + ".m", p->value.shape(), opt.m(i).data()});
    moments.push_back({p->name + ".v", p->value.shape(), opt.v(i).data()});
  }
  std::map<std::string, std::string> model_meta{{"format", "moe"}};
  std::string model_bytes, opt_bytes, state_text;
  json st = state.is_null() ? json::object() : state;
  try {
    if (st.contains("config") && st["config"].is_object() && st["config"].contains("model"))
      model_meta["model_config"] = st["config"]["model"].dump();
  } catch (const json::exception&) {
    return Status::error("checkpoint " + dir + ": the model config in the state is not valid UTF-8");
  }
  if (Status s = encode_safetensors(weights, model_meta, &model_bytes); !s)
    return Status::error("checkpoint " + dir + ": " + s.message());
  if (Status s = encode_safetensors(moments, {{"format", "moe"}, {"step", std::to_string(opt.steps())}}, &opt_bytes);
      !s)
    return Status::error("checkpoint " + dir + ": " + s.message());
  st["optimizer_step"] = opt.steps();
  st["files"] = {
      {kModelFile, {{"bytes", model_bytes.size()}, {"fnv1a64", hex64(fnv1a64(model_bytes.data(), model_bytes.size()))}}},
      {kOptimizerFile, {{"bytes", opt_bytes.size()}, {"fnv1a64", hex64(fnv1a64(opt_bytes.data(), opt_bytes.size()))}}}};
  try {
    state_text = st.dump(2) + "\n";
  } catch (const json::exception&) {
    return Status::error("checkpoint " + dir + ": the state holds a string that is not valid UTF-8");
  }

  const fs::path final_dir = folder_path(dir);
  const fs::path tmp = final_dir.string() + ".tmp-" + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) return Status::error("checkpoint: cannot create " + tmp.string() + ": " + ec.message());
  Status s = write_file_atomic((tmp / kModelFile).string(), model_bytes);
  if (s) s = write_file_atomic((tmp / kOptimizerFile).string(), opt_bytes);
  if (s) s = write_file_atomic((tmp / kStateFile).string(), state_text);
  if (s) {
    fsync_dir(tmp);
    s = install(tmp, final_dir);
  }
  if (!s) {
    fs::remove_all(tmp, ec);
    return Status::error(s.message().rfind("checkpoint", 0) == 0 ? s.message() : "checkpoint: " + s.message());
  }
  return Status::ok();
}

Status load_checkpoint(const std::string& dir, const std::vector<Param*>& params, AdamW* opt, json* state) {
  if (opt) check_optimizer("load_checkpoint", params, *opt);
  const std::string what = "checkpoint " + dir;
  if (!fs::is_directory(dir)) return Status::error(what + ": no such directory");
  std::string state_text;
  if (Status s = read_file((fs::path(dir) / kStateFile).string(), &state_text); !s)
    return Status::error(what + ": " + s.message());
  json st;
  try {
    st = json::parse(state_text);
  } catch (const json::exception&) {
    return Status::error(what + ": state.json is not valid JSON");
  }
  if (!st.is_object()) return Status::error(what + ": state.json is not a JSON object");
  std::map<std::string, LoadedTensor> weights, moments;
  std::map<std::string, std::string> opt_meta;
  for (const char* file : {kModelFile, kOptimizerFile}) {
    const bool is_model = file == std::string(kModelFile);
    if (!is_model && !opt) break;  // weights only
    std::string bytes;
    const std::string path = (fs::path(dir) / file).string();
    if (Status s = read_file(path, &bytes); !s) return Status::error(what + ": " + s.message());
    size_t want_bytes = 0;
    std::string want_sum;
    try {
      const json& f = st.at("files").at(file);
      want_bytes = f.at("bytes").get<size_t>();
      want_sum = f.at("fnv1a64").get<std::string>();
    } catch (const json::exception&) {
      return Status::error(what + ": state.json lacks the size and checksum of " + file);
    }
    if (bytes.size() != want_bytes)
      return Status::error(what + ": " + file + " has " + std::to_string(bytes.size()) + " bytes, state.json says " +
                           std::to_string(want_bytes) + " (truncated or replaced)");
    const std::string sum = hex64(fnv1a64(bytes.data(), bytes.size()));
    if (sum != want_sum)
      return Status::error(what + ": " + file + " fails its checksum (FNV-1a 64 " + sum + ", state.json says " +
                           want_sum + "): corrupted");
    if (Status s = decode_safetensors(bytes, what + "/" + file, is_model ? &weights : &moments,
                                      is_model ? nullptr : &opt_meta);
        !s)
      return s;
  }
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
