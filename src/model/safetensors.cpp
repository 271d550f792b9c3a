#include "model/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace moe {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian; port the byte swap");

namespace {

using json = nlohmann::json;

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(s[i]);
  }
  return out + "]";
}

int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Status write_all(int fd, const char* p, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Status::error("cannot write " + path + ": " + std::strerror(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::ok();
}

}  // namespace

Status encode_safetensors(const std::vector<TensorRef>& tensors, const std::map<std::string, std::string>& metadata,
                          std::string* bytes) {
  json header = json::object();
  size_t offset = 0;
  for (const TensorRef& t : tensors) {
    if (t.name == "__metadata__" || header.contains(t.name))
      return Status::error("safetensors: duplicate or reserved tensor name '" + t.name + "'");
    size_t nbytes = static_cast<size_t>(numel(t.shape)) * sizeof(float);
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');
  uint64_t hl = h.size();
  bytes->clear();
  bytes->reserve(8 + h.size() + offset);
  bytes->append(reinterpret_cast<const char*>(&hl), 8);
  bytes->append(h);
  for (const TensorRef& t : tensors)
    bytes->append(reinterpret_cast<const char*>(t.data), static_cast<size_t>(numel(t.shape)) * sizeof(float));
  return Status::ok();
}

Status decode_safetensors(const std::string& bytes, const std::string& what, std::map<std::string, LoadedTensor>* tensors,
                          std::map<std::string, std::string>* metadata) {
  auto fail = [&](const std::string& m) { return Status::error(what + ": " + m); };
  if (bytes.size() < 8) return fail("too short to be a safetensors file (" + std::to_string(bytes.size()) + " bytes)");
  uint64_t hl;
  std::memcpy(&hl, bytes.data(), 8);
  if (hl > bytes.size() - 8)
    return fail("header length " + std::to_string(hl) + " exceeds the file (" + std::to_string(bytes.size()) +
                " bytes): truncated or not safetensors");
  json header;
  try {
    header = json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(hl));
  } catch (const json::exception&) {
    return fail("header is not valid JSON");
  }
  if (!header.is_object()) return fail("header is not a JSON object");
  const size_t data_start = 8 + hl, data_size = bytes.size() - data_start;
  std::map<std::string, LoadedTensor> out;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (metadata) {
        if (!entry.is_object()) return fail("__metadata__ is not an object");
        for (auto& [k, v] : entry.items()) {
          if (!v.is_string()) return fail("__metadata__." + k + " is not a string");
          (*metadata)[k] = v.get<std::string>();
        }
      }
      continue;
    }
    try {
      if (entry.at("dtype").get<std::string>() != "F32")
        return fail("tensor " + name + " has dtype " + entry.at("dtype").get<std::string>() + ", expected F32");
      LoadedTensor t;
      t.shape = entry.at("shape").get<std::vector<int64_t>>();
      for (int64_t d : t.shape)
        if (d < 0) return fail("tensor " + name + " has a negative dimension");
      auto off = entry.at("data_offsets").get<std::vector<uint64_t>>();
      if (off.size() != 2 || off[0] > off[1] || off[1] > data_size)
        return fail("tensor " + name + " has data_offsets outside the data (" + std::to_string(data_size) +
                    " bytes): truncated?");
      if (off[1] - off[0] != static_cast<uint64_t>(numel(t.shape)) * sizeof(float))
        return fail("tensor " + name + " of shape " + shape_str(t.shape) + " has " + std::to_string(off[1] - off[0]) +
                    " bytes");
      t.data.resize(static_cast<size_t>(numel(t.shape)));
      std::memcpy(t.data.data(), bytes.data() + data_start + off[0], off[1] - off[0]);
      ranges.emplace_back(off[0], off[1]);
      out.emplace(name, std::move(t));
    } catch (const json::exception&) {
      return fail("tensor " + name + " has a malformed header entry");
    }
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second) return fail("tensor data ranges overlap");
  *tensors = std::move(out);
  return Status::ok();
}

Status write_file_atomic(const std::string& path, const std::string& bytes) {
  namespace fs = std::filesystem;
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return Status::error("cannot create " + tmp + ": " + std::strerror(errno));
  Status s = write_all(fd, bytes.data(), bytes.size(), tmp);
  if (s && ::fsync(fd) != 0) s = Status::error("cannot fsync " + tmp + ": " + std::strerror(errno));
  ::close(fd);
  if (s && std::rename(tmp.c_str(), path.c_str()) != 0)
    s = Status::error("cannot rename " + tmp + " to " + path + ": " + std::strerror(errno));
  if (!s) {
    std::error_code ec;
    fs::remove(tmp, ec);
    return s;
  }
  std::string folder = fs::absolute(path).parent_path().string();
  int dfd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return Status::ok();
}

Status read_file(const std::string& path, std::string* bytes) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status::error("cannot open " + path);
  std::ostringstream s;
  s << f.rdbuf();
  if (f.bad()) return Status::error("cannot read " + path);
  *bytes = s.str();
  return Status::ok();
}

}  // namespace moe
