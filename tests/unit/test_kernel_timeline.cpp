// decode_bench --kernels' analysis (bench/kernel_timeline.cpp) on records made up here: steps
// split at their marks, exclusive times, the idle time, and the layers found and grouped by
// the kernels they run (CUPTI itself is needed only to collect records, on the GPU machine).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernel_timeline.h"

using kvlm::bench::KernelRecord;
using kvlm::bench::print_timeline;

namespace {

std::string render(const std::vector<KernelRecord>& records, const std::vector<uint64_t>& marks, int layers) {
  char* buf = nullptr;
  size_t len = 0;
  std::FILE* f = open_memstream(&buf, &len);
  print_timeline(f, "made up", layers, records, marks);
  std::fclose(f);
  std::string s(buf, len);
  std::free(buf);
  return s;
}

// Two steps of: embed; 4 layers of [qkv, (v in layer 1 only), rope, down, norm]; 1 us idle;
// the head. Times in ns. qkv and down start 1 us before the kernel before them ends (as PDL
// launches them), so their exclusive time is 1 us less than their duration.
std::vector<KernelRecord> made_up_steps(std::vector<uint64_t>& marks) {
  std::vector<KernelRecord> r;
  uint64_t t = 1000000;  // the last kernel's end
  auto add = [&](const char* name, uint64_t start, uint64_t dur, int grid, int block) {
    r.push_back({name, start, start + dur, grid, block});
    t = start + dur;
  };
  add("before the first mark", t - 500000, 100000, 1, 1);  // dropped
  t = 1000000;
  for (int s = 0; s < 2; ++s) {
    marks.push_back(t);
    add("embed", t + 50000, 10000, 1, 256);  // 50 us of the host's lead
    for (int l = 0; l < 4; ++l) {
      add("qkv<4>", t - 1000, 8000, 264, 256);
      if (l == 1) add("v<8>", t, 5000, 64, 256);
      add("rope", t, 4000, 10, 128);
      add("down<4>", t - 1000, 10000, 264, 256);
      add("norm", t, 3000, 1, 1024);
    }
    add("head", t + 1000, 20000, 264, 256);
    t += 100000;  // the host between steps
  }
  return r;
}

}  // namespace

TEST(KernelTimeline, SplitsStepsAndGroupsLayersByTheirKernels) {
  std::vector<uint64_t> marks;
  const auto records = made_up_steps(marks);
  const std::string out = render(records, marks, 4);
  EXPECT_EQ(out.find("before the first mark"), std::string::npos) << out;
  // span: embed 10 + layers (7 + 4 + 9 + 3) x 4 + v 5 + 1 idle + head 20 = 128 us
  EXPECT_NE(out.find("spans 0.128 ms"), std::string::npos) << out;
  EXPECT_NE(out.find("runs for 0.127 ms"), std::string::npos) << out;
  EXPECT_NE(out.find("nothing for 0.001 ms"), std::string::npos) << out;
  EXPECT_NE(out.find("19 kernels and copies a step"), std::string::npos) << out;
  EXPECT_NE(out.find("50.0 us after the host began"), std::string::npos) << out;
  // by name: qkv 4 a step, 8 us start to end, 7 us exclusive each
  EXPECT_NE(out.find("| qkv<4> | 4.0 | 8.00 | 28.0 |"), std::string::npos) << out;
  // layers from one qkv to the next: layers 0 and 2 alike, layer 1 with v; layer 3 is the last
  EXPECT_NE(out.find("2 layers like this (the first from #1): 23.0 us exclusive each"), std::string::npos) << out;
  EXPECT_NE(out.find("1 layer like this (the first from #5): 28.0 us exclusive each"), std::string::npos) << out;
  EXPECT_NE(out.find("| 1 | qkv<4> | 264 x 256 | 8.00 | 7.00 | -1.00 |"), std::string::npos) << out;
  EXPECT_NE(out.find("| 6 | v<8> | 64 x 256 | 5.00 | 5.00 | 0.00 |"), std::string::npos) << out;
  EXPECT_NE(out.find("| 2 | rope | 10 x 128 | 4.00 | 4.00 | 0.00 |"), std::string::npos) << out;
  EXPECT_NE(out.find("| 3 | down<4> | 264 x 256 | 10.00 | 9.00 | -1.00 |"), std::string::npos) << out;
  EXPECT_NE(out.find("the last layer and after it"), std::string::npos) << out;
  EXPECT_NE(out.find("| 18 | head | 264 x 256 | 20.00 | 20.00 | 1.00 |"), std::string::npos) << out;
}

TEST(KernelTimeline, WithoutAKernelOncePerLayerPrintsTheWholeStep) {
  std::vector<uint64_t> marks;
  const auto records = made_up_steps(marks);
  const std::string out = render(records, marks, 5);  // nothing runs 5 times a step
  EXPECT_NE(out.find("the whole step in order"), std::string::npos) << out;
  EXPECT_NE(out.find("| 0 | embed | 1 x 256 | 10.00 | 10.00 | 0.00 |"), std::string::npos) << out;
}

TEST(KernelTimeline, StepsThatRanDifferentKernelsGetNoSequence) {
  std::vector<uint64_t> marks;
  auto records = made_up_steps(marks);
  records.back().name = "another head";  // the second step's last kernel
  const std::string out = render(records, marks, 4);
  EXPECT_NE(out.find("different kernel sequences"), std::string::npos) << out;
}
