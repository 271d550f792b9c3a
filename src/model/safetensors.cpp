#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

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

// prod(shape) * 4 in *nbytes; false when a dimension is negative or the product overflows.
bool byte_size(const std::vector<int64_t>& shape, uint64_t* nbytes) {
  uint64_t n = sizeof(float);
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  *nbytes = n;
  return true;
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
  uint64_t offset = 0;
  for (const TensorRef& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || header.contains(t.name))
      return Status::error("safetensors: empty, duplicate or reserved tensor name '" + t.name + "'");
    uint64_t nbytes = 0;
    if (!byte_size(t.shape, &nbytes))
      return Status::error("safetensors: tensor " + t.name + " has an invalid shape " + shape_str(t.shape));
    if (nbytes > 0 && t.data == nullptr) return Status::error("safetensors: tensor " + t.name + " has no data");
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string h;
  try {
    h = header.dump();  // strict: throws on invalid UTF-8
  } catch (const json::exception&) {
    return Status::error("safetensors: a tensor name or metadata string is not valid UTF-8");
  }
  h.append((8 - h.size() % 8) % 8, ' ');
  const uint64_t hl = h.size();
  bytes->clear();
  bytes->reserve(8 + h.size() + offset);
  bytes->append(reinterpret_cast<const char*>(&hl), 8);
  bytes->append(h);
  for (const TensorRef& t : tensors) {
    uint64_t nbytes = 0;
    byte_size(t.shape, &nbytes);
    if (nbytes) bytes->append(reinterpret_cast<const char*>(t.data), nbytes);
  }
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
  const uint64_t data_start = 8 + hl, data_size = bytes.size() - data_start;

  std::map<std::string, LoadedTensor> out;
  std::map<std::string, std::string> meta;
  struct Range {
    uint64_t begin, end;
    std::string name;
    bool operator<(const Range& o) const { return begin != o.begin ? begin < o.begin : end < o.end; }
  };
  std::vector<Range> ranges;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return fail("__metadata__ is not an object");
      for (auto& [k, v] : entry.items()) {
        if (!v.is_string()) return fail("__metadata__." + k + " is not a string");
        meta[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string tn = "tensor " + name;
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets"))
      return fail(tn + " has a malformed header entry (needs an object with dtype, shape and data_offsets)");
    const json& dtype = entry["dtype"];
    if (!dtype.is_string()) return fail(tn + ": dtype is not a string");
    if (dtype.get<std::string>() != "F32")
      return fail(tn + " has dtype " + dtype.get<std::string>() + "; only F32 is supported");
    const json& shape = entry["shape"];
    if (!shape.is_array()) return fail(tn + ": shape is not an array");
    LoadedTensor t;
    for (const json& d : shape) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        return fail(tn + ": shape " + shape.dump() + " has a dimension that is not a non-negative integer");
      t.shape.push_back(d.get<int64_t>());
    }
    const json& off = entry["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      return fail(tn + ": data_offsets " + off.dump() + " is not a pair of non-negative integers");
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    if (b > e || e > data_size)
      return fail(tn + " has data_offsets [" + std::to_string(b) + "," + std::to_string(e) + "] outside the data (" +
                  std::to_string(data_size) + " bytes): truncated or corrupted");
    uint64_t nbytes = 0;
    if (!byte_size(t.shape, &nbytes) || nbytes != e - b)
      return fail(tn + " of shape " + shape_str(t.shape) + " (F32) has " + std::to_string(e - b) +
                  " bytes of data, its shape needs " + (byte_size(t.shape, &nbytes) ? std::to_string(nbytes) : "more"));
    t.data.resize(nbytes / sizeof(float));
    if (nbytes) std::memcpy(t.data.data(), bytes.data() + data_start + b, nbytes);
    ranges.push_back({b, e, name});
    out.emplace(name, std::move(t));
  }
  // The byte ranges must tile [0, data_size) exactly, as the reference implementation requires.
  std::sort(ranges.begin(), ranges.end());
  uint64_t pos = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (ranges[i].begin < pos)
      return fail("tensors " + ranges[i - 1].name + " and " + ranges[i].name + " overlap in the data");
    if (ranges[i].begin > pos)
      return fail("data bytes [" + std::to_string(pos) + "," + std::to_string(ranges[i].begin) +
                  ") belong to no tensor");
    pos = ranges[i].end;
  }
  if (pos != data_size)
    return fail(std::to_string(data_size - pos) + " bytes after the last tensor's data belong to no tensor");
  *tensors = std::move(out);
  if (metadata) *metadata = std::move(meta);
  return Status::ok();
}

Status save_safetensors(const std::string& path, const std::vector<TensorRef>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  std::string bytes;
  if (Status s = encode_safetensors(tensors, metadata, &bytes); !s) return Status::error(path + ": " + s.message());
  return write_file_atomic(path, bytes);
}

Status load_safetensors(const std::string& path, std::map<std::string, LoadedTensor>* tensors,
                        std::map<std::string, std::string>* metadata) {
  std::string bytes;
  if (Status s = read_file(path, &bytes); !s) return s;
  return decode_safetensors(bytes, path, tensors, metadata);
}

Status write_file_atomic(const std::string& path, const std::string& bytes) {
  namespace fs = std::filesystem;
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::error("cannot create " + tmp + ": " + std::strerror(errno));
  Status s = write_all(fd, bytes.data(), bytes.size(), tmp);
  if (s && ::fsync(fd) != 0) s = Status::error("cannot fsync " + tmp + ": " + std::strerror(errno));
  if (::close(fd) != 0 && s) s = Status::error("cannot close " + tmp + ": " + std::strerror(errno));
  if (s && std::rename(tmp.c_str(), path.c_str()) != 0)
    s = Status::error("cannot rename " + tmp + " to " + path + ": " + std::strerror(errno));
  if (!s) {
    ::unlink(tmp.c_str());
    return s;
  }
  std::error_code ec;
  const std::string folder = fs::absolute(path, ec).parent_path().string();
  int dfd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return Status::ok();
}

Status read_file(const std::string& path, std::string* bytes) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::error("cannot open " + path + ": " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::error("cannot read " + path + ": not a regular file");
  }
  std::string out;
  out.resize(static_cast<size_t>(st.st_size));
  size_t got = 0;
  for (;;) {
    if (got == out.size()) out.resize(out.size() + 65536);  // the file may have grown
    ssize_t r = ::read(fd, out.data() + got, out.size() - got);
    if (r < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      ::close(fd);
      return Status::error("cannot read " + path + ": " + std::strerror(e));
    }
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  ::close(fd);
  out.resize(got);
  *bytes = std::move(out);
  return Status::ok();
}

}  // namespace moe
