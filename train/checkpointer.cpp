#include "train/checkpointer.hpp"

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "core/fault_injection.hpp"

namespace kmoe {

bool Checkpointer::should_save(int step, bool stopping) const {
  const CheckpointCfg& c = cfg_.checkpoint;
  return (c.every > 0 && step % c.every == 0) ||
         (step == cfg_.train.max_steps && c.at_end) || stopping;
}

void Checkpointer::save(const TensorTable& table, const TrainState& state) const {
  const auto t0 = std::chrono::steady_clock::now();
  slow_save_if_requested();
  save_checkpoint(cfg_, grid_, table, state);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (grid_.is_root()) {
    const std::string path = cfg_.checkpoint.dir + "/" + checkpoint_file_name(state.step);
    const double mib = std::filesystem::file_size(path) / (1024.0 * 1024.0);
    std::printf("checkpoint %s: %.1f MiB in %.3f s (%.1f MiB/s)\n", path.c_str(), mib, secs,
                mib / secs);
    std::fflush(stdout);
  }
}

}  // namespace kmoe
