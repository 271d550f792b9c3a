#include "model/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <map>

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
  int fd = ::open(p.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// Copies the tensors named by `expected` (name -> destination) out of `loaded`, after checking
// that the two sets of names and every shape agree. Copies nothing on error.
Status match(const std::string& what, std::map<std::string, LoadedTensor>& loaded,
             const std::vector<std::pair<std::string, Tensor*>>& expected, bool copy) {
  for (const auto& [name, dst] : expected) {
    auto it = loaded.find(name);
    if (it == loaded.end()) return Status::error(what + ": tensor " + name + " is missing");
    if (it->second.shape != dst->shape())
      return Status::error(what + ": tensor " + name + " has shape " + shape_str(it->second.shape) +
                           ", the model expects " + shape_str(dst->shape()));
  }
  if (loaded.size() != expected.size()) {
    std::map<std::string, int> names;
    for (const auto& e : expected) names[e.first] = 1;
    for (const auto& [name, t] : loaded)
      if (!names.count(name)) return Status::error(what + ": has tensor " + name + ", which the model does not");
  }
  if (copy)
    for (const auto& [name, dst] : expected) {
      const LoadedTensor& t = loaded.at(name);
      std::copy(t.data.begin(), t.data.end(), dst->data());
    }
  return Status::ok();
}

}  // namespace

Status save_checkpoint(const std::string& dir, const std::vector<Param*>& params, const AdamW& opt,
                       const json& state) {
  std::vector<TensorRef> weights, moments;
  for (size_t i = 0; i < params.size(); ++i) {
    const Param* p = params[i];
    weights.push_back({p->name, p->value.shape(), p->value.data()});
    moments.push_back({p->name + ".m", p->value.shape(), opt.m(i).data()});
    moments.push_back({p->name + ".v", p->value.shape(), opt.v(i).data()});
  }
  std::string model_bytes, opt_bytes;
  if (Status s = encode_safetensors(weights, {{"format", "moe"}}, &model_bytes); !s) return s;
  if (Status s = encode_safetensors(moments, {{"format", "moe"}, {"step", std::to_string(opt.steps())}}, &opt_bytes);
      !s)
    return s;
  json st = state;
  st["optimizer_step"] = opt.steps();
  st["files"] = {{kModelFile, {{"bytes", model_bytes.size()}, {"fnv1a64", hex64(fnv1a64(model_bytes.data(), model_bytes.size()))}}},
                 {kOptimizerFile, {{"bytes", opt_bytes.size()}, {"fnv1a64", hex64(fnv1a64(opt_bytes.data(), opt_bytes.size()))}}}};

  const fs::path final_dir = fs::absolute(dir);
  const fs::path tmp = final_dir.string() + ".tmp-" + std::to_string(::getpid());
  const fs::path old = final_dir.string() + ".old-" + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(tmp, ec);
  if (!fs::create_directories(tmp, ec)) return Status::error("checkpoint: cannot create " + tmp.string());
  Status s = write_file_atomic((tmp / kModelFile).string(), model_bytes);
  if (s) s = write_file_atomic((tmp / kOptimizerFile).string(), opt_bytes);
  if (s) s = write_file_atomic((tmp / kStateFile).string(), st.dump(2) + "\n");
  if (!s) {
    fs::remove_all(tmp, ec);
    return s;
  }
  fsync_dir(tmp);
  const bool had_old = fs::exists(final_dir);
  if (had_old) {
    fs::remove_all(old, ec);
    fs::rename(final_dir, old, ec);
    if (ec) return Status::error("checkpoint: cannot move the old " + final_dir.string() + " aside: " + ec.message());
  }
  fs::rename(tmp, final_dir, ec);
  if (ec) return Status::error("checkpoint: cannot rename " + tmp.string() + " to " + final_dir.string() + ": " + ec.message());
  fsync_dir(final_dir.parent_path());
  if (had_old) fs::remove_all(old, ec);
  return Status::ok();
}

Status load_checkpoint(const std::string& dir, const std::vector<Param*>& params, AdamW* opt, json* state) {
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
  std::map<std::string, LoadedTensor> weights, moments;
  for (const char* file : {kModelFile, kOptimizerFile}) {
    std::string bytes;
    const std::string path = (fs::path(dir) / file).string();
    if (Status s = read_file(path, &bytes); !s) return Status::error(what + ": " + s.message());
    try {
      const json& f = st.at("files").at(file);
      if (bytes.size() != f.at("bytes").get<size_t>())
        return Status::error(what + ": " + file + " has " + std::to_string(bytes.size()) + " bytes, state.json says " +
                             std::to_string(f.at("bytes").get<size_t>()) + " (truncated or replaced)");
      if (hex64(fnv1a64(bytes.data(), bytes.size())) != f.at("fnv1a64").get<std::string>())
        return Status::error(what + ": " + file + " fails its checksum (corrupted)");
    } catch (const json::exception&) {
      return Status::error(what + ": state.json lacks the size and checksum of " + file);
    }
    if (Status s = decode_safetensors(bytes, what + "/" + file, file == std::string(kModelFile) ? &weights : &moments,
                                      nullptr);
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
  if (Status s = match(what + "/" + kModelFile, weights, want_w, false); !s) return s;
  if (opt) {
    if (Status s = match(what + "/" + kOptimizerFile, moments, want_m, false); !s) return s;
    if (!st.contains("optimizer_step") || !st["optimizer_step"].is_number_integer())
      return Status::error(what + ": state.json lacks optimizer_step");
  }
  match(what, weights, want_w, true);
  if (opt) {
    match(what, moments, want_m, true);
    opt->set_steps(st["optimizer_step"].get<int64_t>());
  }
  if (state) *state = std::move(st);
  return Status::ok();
}

}  // namespace moe
