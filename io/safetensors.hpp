// safetensors files, the Hugging Face weight format: an 8-byte little-endian header length N, N
// bytes of JSON ({"__metadata__": {...}, name: {"dtype", "shape", "data_offsets": [begin,
// end]}}, padded with spaces), then the tensors' raw little-endian bytes, offsets counted from
// the end of the header; the data section is covered by the tensors without holes or overlaps.
// A model directory holds model.safetensors, or shards model-0000k-of-0000n.safetensors with
// model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map": {name: file}}).
//
// Every check a reader makes names the file and, where there is one, the tensor: a header
// length past the end of the file, JSON that does not parse, an unknown dtype, a shape whose
// size does not match its byte range, ranges outside the data section, overlapping or leaving
// holes, a shard the index names that is missing.
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace kmoe {

enum class StDtype { F32, BF16, F16 };
const char* st_dtype_name(StDtype t);  // "F32", "BF16", "F16"
int st_dtype_bytes(StDtype t);

struct StTensor {
  std::string name;
  StDtype dtype = StDtype::F32;
  std::vector<std::int64_t> shape;
  std::int64_t begin = 0, end = 0;  // byte range in the data section
  std::int64_t numel() const;
};

class SafetensorsReader {
 public:
  // Opens and validates `path` (the header and the byte ranges; the data is read on demand).
  explicit SafetensorsReader(const std::string& path);
  const std::string& path() const { return path_; }
  const std::vector<StTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const StTensor* find(const std::string& name) const;  // null when absent
  // The tensor's values as fp32 (bf16 and f16 widened exactly) into out[0, numel).
  void read_f32(const std::string& name, float* out) const;

 private:
  std::string path_;
  std::vector<StTensor> tensors_;
  std::map<std::string, std::string> metadata_;
  std::int64_t data_start_ = 0;
  mutable std::ifstream in_;
};

// Writes one file: the tensors are planned first (names, shapes, dtypes, in file order), then
// their values are given one by one in that order, as fp32 (converted to the tensor's dtype,
// bf16 rounded to nearest even). The file appears under its name only when finish() completes.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<StTensor> plan,
                    const std::map<std::string, std::string>& metadata);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  // The next planned tensor's values (its name, as a check).
  void write_next(const std::string& name, const float* values, std::int64_t n);
  void finish();
  // Bytes of the data section.
  std::int64_t data_bytes() const { return data_bytes_; }

 private:
  std::string path_, tmp_;
  std::vector<StTensor> plan_;
  std::size_t next_ = 0;
  std::int64_t data_bytes_ = 0;
  std::ofstream out_;
  bool finished_ = false;
};

// The weights of a Hugging Face model directory: model.safetensors, or the shards its
// model.safetensors.index.json names (each opened when first needed; a missing one is an error
// naming it and the tensor asked for).
class HfWeights {
 public:
  explicit HfWeights(const std::string& dir);
  // The tensor's file and header entry; throws naming the directory when no file has it.
  const StTensor& tensor(const std::string& name) const;
  void read_f32(const std::string& name, float* out) const;
  // Every tensor name the directory holds (the index's or the file's).
  std::vector<std::string> names() const;

 private:
  const SafetensorsReader& file_of(const std::string& name) const;
  std::string dir_;
  std::map<std::string, std::string> weight_map_;  // name -> file (empty: one file)
  mutable std::map<std::string, std::unique_ptr<SafetensorsReader>> files_;
};

}  // namespace kmoe
