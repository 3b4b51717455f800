// Unit tests of perf/common/harness: the -b/-e/-f size sweep and ForkedChild.
#include "perf/common/harness.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace kvxfer::perf {
namespace {

using V = std::vector<uint64_t>;

TEST(PerfHarness, SizeSweepWalksMinTimesFactorWhileAtMostMax) {
  EXPECT_EQ(size_sweep(64, 256 << 10, 16), (V{64, 1024, 16384, 262144}));
  EXPECT_EQ(size_sweep(8 << 20, 64 << 20, 2), (V{8 << 20, 16 << 20, 32 << 20, 64 << 20}));
  EXPECT_EQ(size_sweep(3, 100, 4), (V{3, 12, 48}));  // max need not be on the sweep
  EXPECT_EQ(size_sweep(5, 5, 2), (V{5}));
}

TEST(PerfHarness, SizeSweepEdgeCases) {
  EXPECT_TRUE(size_sweep(10, 9, 2).empty());    // min > max
  EXPECT_EQ(size_sweep(10, 1000, 1), (V{10}));  // no step to take
  EXPECT_EQ(size_sweep(10, 1000, 0), (V{10}));
  const uint64_t top = std::numeric_limits<uint64_t>::max();
  const V v = size_sweep(uint64_t{1} << 62, top, 2);  // the next step would overflow
  EXPECT_EQ(v, (V{uint64_t{1} << 62, uint64_t{1} << 63}));
  EXPECT_EQ(size_sweep(top, top, 1024), (V{top}));
}

TEST(PerfHarness, ForkedChildReportsItsExitCode) {
  ForkedChild c;
  std::string err;
  ASSERT_TRUE(c.start([] { return 7; }, &err)) << err;
  EXPECT_TRUE(c.wait_for(30));
  EXPECT_FALSE(c.alive());
  EXPECT_FALSE(c.exited_ok());
  EXPECT_EQ(c.describe(), "exit code 7");

  ForkedChild ok;
  ASSERT_TRUE(ok.start([&ok] { return ok.parent_alive() ? 0 : 1; }, &err)) << err;
  ok.wait();
  EXPECT_TRUE(ok.exited_ok());
  EXPECT_EQ(ok.describe(), "exit code 0");
}

TEST(PerfHarness, ForkedChildIsKilledAfterItsTimeout) {
  ForkedChild c;
  EXPECT_EQ(c.describe(), "not started");
  std::string err;
  ASSERT_TRUE(c.start(
      [] {
        pause();
        return 0;
      },
      &err))
      << err;
  EXPECT_TRUE(c.alive());
  EXPECT_EQ(c.describe(), "running");
  EXPECT_FALSE(c.wait_for(0.05));
  EXPECT_FALSE(c.alive());
  EXPECT_EQ(c.describe(), "killed by signal " + std::to_string(SIGKILL));
  c.kill();  // already reaped: nothing
  EXPECT_FALSE(c.exited_ok());
}

}  // namespace
}  // namespace kvxfer::perf
