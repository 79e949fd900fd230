// Pipeline schedules (RUNTIME.md section 2) and the stop signals' record.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/stop_signal.hpp"
#include "parallel/pipeline_schedule.hpp"

#include "train_units_util.hpp"

namespace kmoe {
namespace {

using namespace unit;

// Pipeline schedules: every micro-batch forward once and backward once, backward after its
// forward, the in-flight count bounded as RUNTIME.md section 2 and parallel/pipeline_schedule.hpp
// say.
TEST(Schedule, OneFOneBAndGPipe) {
  for (const char* kind : {"1f1b", "gpipe"})
    for (int P : {1, 2, 4})
      for (int s = 0; s < P; ++s)
        for (int M : {1, 2, 3, 8}) {
          const auto ops = pipeline_schedule(choice_from<PipeSchedule>(kind), P, s, M);
          std::vector<int> f(M, -1), b(M, -1);
          for (std::size_t k = 0; k < ops.size(); ++k)
            (ops[k].forward ? f : b)[ops[k].micro] = static_cast<int>(k);
          for (int i = 0; i < M; ++i) {
            EXPECT_GE(f[i], 0);
            EXPECT_GT(b[i], f[i]) << kind << " P " << P << " s " << s << " M " << M;
          }
          EXPECT_EQ(ops.size(), std::size_t(2 * M));
          const int in_flight = max_in_flight(ops);
          const bool gpipe = std::string(kind) == "gpipe" && P > 1;
          EXPECT_EQ(in_flight, P == 1 ? 1 : (gpipe ? M : std::min(P - s, M)));
          // Micro-batch i runs on Stage instance i mod in_flight: free again once micro-batch
          // i - in_flight is backwarded.
          for (int i = in_flight; i < M; ++i) EXPECT_GT(f[i], b[i - in_flight]);
        }
  EXPECT_THROW(choice_from<PipeSchedule>("interleaved"), Error);  // no such schedule
}

// The named kinds of tensor declaration carry exactly the fields the modules used to spell
// positionally (initialization, decay, learning-rate group, optimizer state, placement).

TEST(StopSignals, RecordTheStrongestRequest) {
  install_stop_handlers();
  ASSERT_EQ(requested_stop(), StopKind::None);
  std::raise(SIGUSR1);
  EXPECT_EQ(requested_stop(), StopKind::Requeue);
  EXPECT_STREQ(stop_signal_name(), "SIGUSR1");
  std::raise(SIGUSR2);
  EXPECT_EQ(requested_stop(), StopKind::Cancel);
  EXPECT_STREQ(stop_signal_name(), "SIGUSR2");
  std::raise(SIGUSR1);  // a requeue does not undo a stop
  EXPECT_EQ(requested_stop(), StopKind::Cancel);
}

}  // namespace
}  // namespace kmoe
