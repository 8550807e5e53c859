// A reader for the safetensors format (what transformers' save_pretrained
// writes): an 8-byte little-endian header length N, N bytes of JSON
// ({"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
// "__metadata__": {..}}), then the data section, which the offsets index.
//
// Nothing here trusts the file: the header length must fit the file, the
// header must be a JSON object of well-formed entries, each tensor's byte
// range must lie inside the data section and hold exactly shape x element
// size bytes (computed without overflow), and no two tensors may overlap. A
// violation throws InputError naming the file, the tensor and the problem,
// so a truncated or corrupt checkpoint never reads out of bounds. Tensors
// are copied out of the file (mapped read-only) into fresh, aligned tensors.
#pragma once

#include <ATen/ATen.h>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "errors.hpp"

namespace llama {

/// One tensor's entry in a safetensors header.
struct TensorEntry {
  std::string dtype;           ///< safetensors' name: "F32", "BF16", "I64", ...
  std::vector<int64_t> shape;  ///< every dim >= 0
  uint64_t begin = 0;          ///< byte offset inside the data section
  uint64_t end = 0;            ///< one past the last byte (end - begin = numel x element size)
};

/// Bytes per element of a safetensors dtype name; 0 for an unknown name.
inline uint64_t element_size(const std::string& dtype) {
  static const std::map<std::string, uint64_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

/// The torch dtype a weight of this safetensors dtype loads as; Undefined
/// for the dtypes a Llama checkpoint does not use for weights.
inline at::ScalarType weight_dtype(const std::string& dtype) {
  if (dtype == "F32") return at::kFloat;
  if (dtype == "F16") return at::kHalf;
  if (dtype == "BF16") return at::kBFloat16;
  return at::ScalarType::Undefined;
}

/// A validated safetensors header: every entry's range lies inside a file
/// of the size it was parsed against.
class SafetensorsHeader {
 public:
  /// The header length field plus the header: where the data section starts.
  uint64_t data_start() const noexcept { return data_start_; }
  const std::map<std::string, TensorEntry>& tensors() const noexcept { return tensors_; }
  /// "__metadata__", or an empty object.
  const nlohmann::json& metadata() const noexcept { return metadata_; }

  /// Parses and checks the header of a file of `size` bytes starting at
  /// `data` (`file` names it in messages). Throws InputError.
  static SafetensorsHeader parse(const std::string& file, const uint8_t* data, uint64_t size) {
    // The format's own limit (safetensors' MAX_HEADER_SIZE): a larger length is corruption.
    constexpr uint64_t kMaxHeader = 100u << 20;
    if (size < 8) fail(file, ": ", size, " bytes, shorter than the 8-byte header length (truncated?)");
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];
    if (n > size - 8) {
      fail(file, ": header length ", n, " runs past the end of the file (", size, " bytes; truncated?)");
    }
    if (n > kMaxHeader) fail(file, ": header length ", n, " exceeds the format's limit of ", kMaxHeader, " bytes");
    SafetensorsHeader h;
    h.data_start_ = 8 + n;
    const uint64_t data_size = size - h.data_start_;
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(data + 8, data + 8 + n);
    } catch (const nlohmann::json::exception& e) {
      fail(file, ": the header is not valid JSON (", e.what(), ")");
    }
    if (!header.is_object()) fail(file, ": the header is not a JSON object but ", header.type_name());
    h.metadata_ = nlohmann::json::object();
    for (const auto& [name, value] : header.items()) {
      if (name == "__metadata__") {
        if (!value.is_object()) fail(file, ": __metadata__ is not an object but ", value.type_name());
        h.metadata_ = value;
        continue;
      }
      h.tensors_.emplace(name, parse_entry(file, name, value, data_size));
    }
    no_overlap(file, h.tensors_);
    return h;
  }

 private:
  static TensorEntry parse_entry(const std::string& file, const std::string& name, const nlohmann::json& value,
                                 uint64_t data_size) {
    const std::string where = file + ": tensor '" + name + "'";
    if (!value.is_object()) fail(where, ": entry is not an object but ", value.type_name());
    TensorEntry t;
    const auto dtype = value.find("dtype");
    if (dtype == value.end() || !dtype->is_string()) fail(where, ": 'dtype' is missing or not a string");
    t.dtype = dtype->get<std::string>();
    const uint64_t elem = element_size(t.dtype);
    if (elem == 0) fail(where, ": unknown dtype '", t.dtype, "'");
    const auto shape = value.find("shape");
    if (shape == value.end() || !shape->is_array()) fail(where, ": 'shape' is missing or not an array");
    // numel x element size, refusing anything past 2^62 bytes (no overflow below)
    constexpr uint64_t kMaxBytes = uint64_t{1} << 62;
    uint64_t bytes = elem;
    for (const auto& dim : *shape) {
      if (!dim.is_number_unsigned()) fail(where, ": 'shape' ", shape->dump(), " holds ", dim.dump(), ", not a dim >= 0");
      const uint64_t d = dim.get<uint64_t>();
      if (d != 0 && bytes > kMaxBytes / d) fail(where, ": 'shape' ", shape->dump(), " is impossibly large");
      bytes *= d;
      t.shape.push_back(static_cast<int64_t>(d));
    }
    const auto offsets = value.find("data_offsets");
    if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
        !(*offsets)[1].is_number_unsigned()) {
      fail(where, ": 'data_offsets' is missing or not two integers >= 0");
    }
    t.begin = (*offsets)[0].get<uint64_t>();
    t.end = (*offsets)[1].get<uint64_t>();
    if (t.begin > t.end) fail(where, ": data_offsets [", t.begin, ", ", t.end, "] end before they begin");
    if (t.end > data_size) {
      fail(where, ": data_offsets [", t.begin, ", ", t.end, "] run past the data section (", data_size,
           " bytes; truncated?)");
    }
    if (t.end - t.begin != bytes) {
      fail(where, ": data_offsets [", t.begin, ", ", t.end, "] hold ", t.end - t.begin, " bytes, but ", t.dtype,
           " of shape ", shape->dump(), " needs ", bytes);
    }
    return t;
  }

  /// Tensors may leave gaps but must not share bytes.
  static void no_overlap(const std::string& file, const std::map<std::string, TensorEntry>& tensors) {
    std::vector<std::pair<const std::string*, const TensorEntry*>> by_start;
    for (const auto& [name, t] : tensors) {
      if (t.end > t.begin) by_start.emplace_back(&name, &t);
    }
    std::sort(by_start.begin(), by_start.end(),
              [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
    for (size_t i = 1; i < by_start.size(); ++i) {
      const TensorEntry& prev = *by_start[i - 1].second;
      const TensorEntry& next = *by_start[i].second;
      if (next.begin < prev.end) {
        fail(file, ": tensors '", *by_start[i - 1].first, "' [", prev.begin, ", ", prev.end, ") and '",
             *by_start[i].first, "' [", next.begin, ", ", next.end, ") overlap");
      }
    }
  }

  uint64_t data_start_ = 0;
  std::map<std::string, TensorEntry> tensors_;
  nlohmann::json metadata_;
};

/// A tensor of a parsed file as a fresh CPU tensor of its own dtype (F32,
/// F16 or BF16; anything else throws). `data` / `size`: the whole file the
/// header was parsed from.
inline at::Tensor read_tensor(const std::string& file, const uint8_t* data, uint64_t size,
                              const SafetensorsHeader& header, const std::string& name) {
  const auto it = header.tensors().find(name);
  if (it == header.tensors().end()) fail(file, ": no tensor '", name, "'");
  const TensorEntry& t = it->second;
  const at::ScalarType type = weight_dtype(t.dtype);
  if (type == at::ScalarType::Undefined) {
    fail(file, ": tensor '", name, "' has dtype ", t.dtype, "; weights must be F32, F16 or BF16");
  }
  // parse() checked this against the same size; a caller passing another buffer must not read past it
  if (header.data_start() > size || t.end > size - header.data_start()) {
    fail(file, ": tensor '", name, "' lies outside the ", size, "-byte buffer");
  }
  at::Tensor out = at::empty(t.shape, at::TensorOptions().dtype(type));
  if (t.end > t.begin) std::memcpy(out.data_ptr(), data + header.data_start() + t.begin, t.end - t.begin);
  return out;
}

/// A whole file mapped read-only (an empty file maps nothing).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(path, ": cannot open (", std::strerror(errno), ")");
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      fail(path, ": not a regular file");
    }
    size_ = static_cast<uint64_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        ::close(fd);
        fail(path, ": cannot map ", size_, " bytes (", std::strerror(errno), ")");
      }
      data_ = static_cast<const uint8_t*>(p);
    }
    ::close(fd);
  }
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const noexcept { return path_; }
  const uint8_t* data() const noexcept { return data_; }
  uint64_t size() const noexcept { return size_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

/// One safetensors file on disk: mapped, header checked.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path)
      : file_(std::make_unique<MappedFile>(path)),
        header_(SafetensorsHeader::parse(path, file_->data(), file_->size())) {}

  const std::string& path() const noexcept { return file_->path(); }
  const std::map<std::string, TensorEntry>& tensors() const noexcept { return header_.tensors(); }
  at::Tensor read(const std::string& name) const {
    return read_tensor(file_->path(), file_->data(), file_->size(), header_, name);
  }

 private:
  std::unique_ptr<MappedFile> file_;
  SafetensorsHeader header_;
};

}  // namespace llama
