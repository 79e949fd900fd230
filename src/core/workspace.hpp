// The transient device memory of a rank's layer calls: one stack of buffers that every layer of
// every Stage instance takes its temporaries from (backward gradients, the bf16 runs' fp32
// staging, the expert-parallel transfer buffers) and gives back when the call returns. Layer
// calls on a rank never overlap (one pipeline op at a time, the layers of an op one after the
// other), and nothing a call leaves in the workspace is read by a later call, so the
// workspace is as large as the deepest call needs, not the sum of every layer's temporaries.
//
//   Workspace::Frame frame(ws);        // everything taken below is given back at its end
//   Mat d_a = frame.mat(N, F);         // (N, F) floats, valid until the frame closes
//
// Frames nest (a block's frame holds the gradients that pass between its layers; each layer
// opens its own on top). Memory is reserved up front from the model's sizes (reserve()); a
// frame that needs more than is left (expert-parallel rows that depend on the routing) gets a
// further chunk, and when the outermost frame closes the chunks become one allocation of the
// deepest stack seen, so a steady run allocates in its first steps only. Device work is ordered
// on the execution space, so a buffer reused by a later kernel is never read early.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/kokkos_types.hpp"

namespace kmoe {

class Workspace {
 public:
  explicit Workspace(std::string label = "workspace");
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  // Makes one allocation of at least `bytes` (outside every frame; smaller requests keep the
  // capacity). Frames take from it first.
  void reserve(std::int64_t bytes);

  class Frame {
   public:
    explicit Frame(Workspace& ws);
    ~Frame();
    Frame(const Frame&) = delete;
    Frame& operator=(const Frame&) = delete;

    float* floats(std::int64_t n) { return static_cast<float*>(ws_.take(4 * n)); }
    int* ints(std::int64_t n) { return static_cast<int*>(ws_.take(4 * n)); }
    std::uint16_t* words(std::int64_t n) { return static_cast<std::uint16_t*>(ws_.take(2 * n)); }
    Mat mat(int rows, int cols) { return Mat(floats(std::int64_t(rows) * cols), rows, cols); }

   private:
    Workspace& ws_;
    std::size_t chunk_;
    std::int64_t used_, live_;
  };

  // Bytes allocated now (every chunk), and the deepest stack of takes so far.
  std::int64_t capacity() const;
  std::int64_t high_water() const { return high_water_; }

  // Bytes a take of `bytes` occupies, what size estimates add: buffers start 256-byte aligned
  // and at least 256 bytes past the previous one's end, so buffers of power-of-two sizes do
  // not start at addresses equal modulo 4 KiB (loops over several of them would contend for
  // the same cache sets).
  static std::int64_t rounded(std::int64_t bytes) { return (bytes + 255) / 256 * 256 + 256; }

 private:
  void* take(std::int64_t bytes);
  void consolidate();
  // An allocation of size() usable bytes from a 256-byte boundary.
  struct Chunk {
    Chunk(const std::string& label, std::int64_t bytes);
    Kokkos::View<char*, Layout, MemSpace> data;  // size() + 255 bytes
    char* base;
    std::int64_t size() const { return static_cast<std::int64_t>(data.extent(0)) - 255; }
  };
  std::string label_;
  std::vector<Chunk> chunks_;
  std::size_t chunk_ = 0;    // the chunk takes come from
  std::int64_t used_ = 0;    // bytes taken from it
  std::int64_t live_ = 0;    // bytes taken in open frames, over all chunks
  std::int64_t high_water_ = 0;
  int depth_ = 0;            // open frames
};

}  // namespace kmoe
