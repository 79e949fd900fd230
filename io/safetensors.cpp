#include "io/safetensors.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/bf16.hpp"
#include "core/device_memory.hpp"
#include "core/error.hpp"
#include "io/durable_file.hpp"

namespace kmoe {

namespace {
const char* const kNeedsHost =
    "safetensors files are read and written from host memory: give it a host copy";
}  // namespace

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

namespace {

// The largest header the readers of the format accept (safetensors' own limit).
constexpr std::int64_t kMaxHeader = std::int64_t(100) << 20;

float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);  // infinity, NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;  // zero
  } else {  // subnormal: normalize
    exp = 113;
    while (!(man & 0x400u)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

StDtype parse_dtype(const std::string& s, const std::string& where) {
  if (s == "BF16") return StDtype::BF16;
  if (s == "F16") return StDtype::F16;
  KMOE_REQUIRE(s == "F32", where << ": dtype " << s << " is not supported (F32, BF16, F16)");
  return StDtype::F32;
}

std::int64_t json_int(const Json& v, const std::string& where) {
  KMOE_REQUIRE(v.is_number_integer() && v.get<std::int64_t>() >= 0,
               where << " must hold non-negative integers, not " << v.dump());
  return v.get<std::int64_t>();
}

}  // namespace

const char* st_dtype_name(StDtype t) {
  return t == StDtype::F32 ? "F32" : t == StDtype::BF16 ? "BF16" : "F16";
}

int st_dtype_bytes(StDtype t) { return t == StDtype::F32 ? 4 : 2; }

std::int64_t StTensor::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  in_.open(path, std::ios::binary);
  KMOE_REQUIRE(in_, path << ": cannot open");
  std::error_code ec;
  const std::int64_t size = static_cast<std::int64_t>(fs::file_size(path, ec));
  KMOE_REQUIRE(!ec && size >= 8, path << ": not a safetensors file (" << (ec ? 0 : size)
                                      << " bytes, less than the 8-byte header length)");
  unsigned char len[8];
  in_.read(reinterpret_cast<char*>(len), 8);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  KMOE_REQUIRE(n >= 2 && n <= std::uint64_t(size - 8) && std::int64_t(n) <= kMaxHeader,
               path << ": header length " << n << " is past the end of the file (" << size
                    << " bytes) or out of range");
  std::string header(n, '\0');
  in_.read(header.data(), std::streamsize(n));
  KMOE_REQUIRE(in_, path << ": cannot read its " << n << "-byte header");
  Json j;
  try {
    j = Json::parse(header);
  } catch (const std::exception& e) {
    KMOE_FAIL(path << ": the header is not valid JSON (" << e.what() << ")");
  }
  KMOE_REQUIRE(j.is_object(), path << ": the header is not a JSON object");
  data_start_ = 8 + std::int64_t(n);
  const std::int64_t data_size = size - data_start_;
  for (const auto& [key, v] : j.items()) {
    if (key == "__metadata__") {
      KMOE_REQUIRE(v.is_object(), path << ": __metadata__ is not an object");
      for (const auto& [mk, mv] : v.items()) {
        KMOE_REQUIRE(mv.is_string(), path << ": __metadata__ value of " << mk << " is not a string");
        metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    const std::string where = path + ": tensor " + key;
    KMOE_REQUIRE(v.is_object() && v.contains("dtype") && v.contains("shape") &&
                     v.contains("data_offsets") && v["dtype"].is_string() &&
                     v["shape"].is_array() && v["data_offsets"].is_array() &&
                     v["data_offsets"].size() == 2,
                 where << ": needs dtype, shape and data_offsets [begin, end]");
    StTensor t;
    t.name = key;
    t.dtype = parse_dtype(v["dtype"].get<std::string>(), where);
    for (const auto& d : v["shape"]) t.shape.push_back(json_int(d, where + " shape"));
    t.begin = json_int(v["data_offsets"][0], where + " data_offsets");
    t.end = json_int(v["data_offsets"][1], where + " data_offsets");
    KMOE_REQUIRE(t.begin <= t.end && t.end <= data_size,
                 where << ": data_offsets [" << t.begin << ", " << t.end
                       << ") out of range (the data section has " << data_size << " bytes)");
    KMOE_REQUIRE(t.numel() * st_dtype_bytes(t.dtype) == t.end - t.begin,
                 where << ": shape " << v["shape"].dump() << " of " << st_dtype_name(t.dtype)
                       << " is " << t.numel() * st_dtype_bytes(t.dtype) << " bytes, its data_offsets "
                       << t.end - t.begin);
    tensors_.push_back(std::move(t));
  }
  // The byte ranges cover the data section exactly: in order, each starts where the last ended.
  std::vector<const StTensor*> order;
  for (const auto& t : tensors_) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const StTensor* a, const StTensor* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  std::int64_t at = 0;
  const StTensor* prev = nullptr;
  for (const StTensor* t : order) {
    KMOE_REQUIRE(t->begin >= at, path << ": tensors " << (prev ? prev->name : "") << " and "
                                      << t->name << " overlap (bytes " << t->begin << " to "
                                      << at << ")");
    KMOE_REQUIRE(t->begin == at, path << ": bytes " << at << " to " << t->begin
                                      << " of the data section belong to no tensor (before "
                                      << t->name << ")");
    at = t->end;
    prev = t;
  }
  KMOE_REQUIRE(at == data_size, path << ": the data section has " << data_size
                                     << " bytes, its tensors cover " << at);
}

const StTensor* SafetensorsReader::find(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

void SafetensorsReader::read_f32(const std::string& name, float* out) const {
  const StTensor* t = find(name);
  KMOE_REQUIRE(t, path_ << ": no tensor " << name);
  const std::int64_t n = t->numel(), bytes = t->end - t->begin;
  require_host_memory(out, static_cast<std::size_t>(n) * sizeof(float),
                      path_ + ": reading tensor " + name, kNeedsHost);
  in_.clear();
  in_.seekg(data_start_ + t->begin);
  if (t->dtype == StDtype::F32) {
    in_.read(reinterpret_cast<char*>(out), bytes);  // little-endian, as the host
  } else {
    std::vector<std::uint16_t> h(n);
    in_.read(reinterpret_cast<char*>(h.data()), bytes);
    for (std::int64_t i = 0; i < n; ++i)
      out[i] = t->dtype == StDtype::BF16 ? bf16_to_float(h[i]) : half_to_float(h[i]);
  }
  KMOE_REQUIRE(in_, path_ << ": cannot read tensor " << name << " (" << bytes << " bytes)");
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<StTensor> plan,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), tmp_(path_ + ".partial"), plan_(std::move(plan)) {
  Json header = Json::object();
  Json meta = Json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  header["__metadata__"] = meta;
  for (auto& t : plan_) {
    KMOE_REQUIRE(t.dtype != StDtype::F16, path_ << ": F16 output is not supported");
    t.begin = data_bytes_;
    t.end = t.begin + t.numel() * st_dtype_bytes(t.dtype);
    data_bytes_ = t.end;
    header[t.name] = {{"dtype", st_dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {t.begin, t.end}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  out_.open(tmp_, std::ios::binary | std::ios::trunc);
  KMOE_REQUIRE(out_, tmp_ << ": cannot create");
  unsigned char len[8];
  std::uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  out_.write(reinterpret_cast<const char*>(len), 8);
  out_.write(text.data(), std::streamsize(text.size()));
  KMOE_REQUIRE(out_, tmp_ << ": cannot write its header");
}

SafetensorsWriter::~SafetensorsWriter() {
  if (finished_) return;
  out_.close();
  std::error_code ec;
  fs::remove(tmp_, ec);  // an unfinished file never appears
}

void SafetensorsWriter::write_next(const std::string& name, const float* values, std::int64_t n) {
  KMOE_REQUIRE(next_ < plan_.size() && plan_[next_].name == name && plan_[next_].numel() == n,
               path_ << ": tensor " << name << " (" << n << " values) is not the next planned ("
                     << (next_ < plan_.size() ? plan_[next_].name : "none") << ")");
  require_host_memory(values, static_cast<std::size_t>(n) * sizeof(float),
                      path_ + ": writing tensor " + name, kNeedsHost);
  const StTensor& t = plan_[next_++];
  if (t.dtype == StDtype::F32) {
    out_.write(reinterpret_cast<const char*>(values), n * 4);
  } else {
    std::vector<std::uint16_t> h(n);
    for (std::int64_t i = 0; i < n; ++i) h[i] = bf16_bits(values[i]);
    out_.write(reinterpret_cast<const char*>(h.data()), n * 2);
  }
  KMOE_REQUIRE(out_, tmp_ << ": cannot write tensor " << name << " (disk full?)");
}

void SafetensorsWriter::finish() {
  KMOE_REQUIRE(next_ == plan_.size(),
               path_ << ": " << plan_.size() - next_ << " planned tensors were not written");
  out_.close();
  KMOE_REQUIRE(!out_.fail(), tmp_ << ": cannot finish writing (disk full?)");
  rename_durably(tmp_, path_, "file");
  finished_ = true;
}

HfWeights::HfWeights(const std::string& dir) : dir_(dir) {
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(index)) {
    std::ifstream in(index);
    Json j;
    try {
      j = Json::parse(in);
    } catch (const std::exception& e) {
      KMOE_FAIL(index.string() << ": not valid JSON (" << e.what() << ")");
    }
    KMOE_REQUIRE(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
                 index.string() << ": no weight_map object");
    for (const auto& [name, file] : j["weight_map"].items()) {
      KMOE_REQUIRE(file.is_string(), index.string() << ": weight_map[" << name
                                                    << "] is not a file name");
      weight_map_[name] = file.get<std::string>();
    }
    return;
  }
  const fs::path single = fs::path(dir) / "model.safetensors";
  KMOE_REQUIRE(fs::exists(single), dir << ": neither model.safetensors nor "
                                          "model.safetensors.index.json");
  files_["model.safetensors"] = std::make_unique<SafetensorsReader>(single.string());
}

const SafetensorsReader& HfWeights::file_of(const std::string& name) const {
  if (weight_map_.empty()) return *files_.begin()->second;
  auto it = weight_map_.find(name);
  KMOE_REQUIRE(it != weight_map_.end(),
               dir_ << "/model.safetensors.index.json: no file holds tensor " << name);
  auto& f = files_[it->second];
  if (!f) {
    const fs::path p = fs::path(dir_) / it->second;
    KMOE_REQUIRE(fs::exists(p), p.string() << ": missing (model.safetensors.index.json names it "
                                              "for tensor " << name << ")");
    f = std::make_unique<SafetensorsReader>(p.string());
  }
  return *f;
}

const StTensor& HfWeights::tensor(const std::string& name) const {
  const SafetensorsReader& f = file_of(name);
  const StTensor* t = f.find(name);
  KMOE_REQUIRE(t, f.path() << ": no tensor " << name
                           << (weight_map_.empty() ? "" : " (the index names this file for it)"));
  return *t;
}

void HfWeights::read_f32(const std::string& name, float* out) const {
  tensor(name);  // the checks, with their messages
  file_of(name).read_f32(name, out);
}

std::vector<std::string> HfWeights::names() const {
  std::vector<std::string> out;
  if (!weight_map_.empty()) {
    for (const auto& [name, file] : weight_map_) out.push_back(name);
  } else {
    for (const auto& t : files_.begin()->second->tensors()) out.push_back(t.name);
  }
  return out;
}

}  // namespace kmoe
