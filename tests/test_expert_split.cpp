// The expert-parallel split: every routed expert on exactly one rank, ranks balanced.
#include <gtest/gtest.h>

#include <algorithm>

#include "plan/expert_split.h"
#include "synth/synth.h"

namespace keel {
namespace {

TEST(ExpertSplit, EveryExpertOnceAndBalanced) {
  for (int ranks : {1, 2, 3, 4, 8}) {
    for (int64_t experts : {8, 32, 256, 257}) {
      const ExpertSplit split{ranks};
      std::vector<int> seen(experts, 0);
      size_t fewest = experts, most = 0;
      for (int r = 0; r < ranks; ++r) {
        const auto held = split.experts_of(r, experts);
        fewest = std::min(fewest, held.size());
        most = std::max(most, held.size());
        for (int64_t e : held) {
          ++seen[e];
          EXPECT_EQ(split.owner(e), r);
        }
      }
      for (int64_t e = 0; e < experts; ++e) EXPECT_EQ(seen[e], 1) << "expert " << e << ", " << ranks << " ranks";
      EXPECT_LE(most - fewest, 1u) << experts << " experts over " << ranks << " ranks";
    }
  }
}

TEST(ExpertSplit, DescribesFlashOverFourGpus) {
  const ModelConfig flash = synth_config({.shape = "flash"});
  const std::string text = ExpertSplit{4}.describe(flash);
  EXPECT_NE(text.find("rank 3: GPU 3, 64 of 256 routed experts per layer (3,7,11,..,255)"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 0: GPU 0, 64 of 256 routed experts per layer (0,4,8,..,252), runs the shared expert"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("43 per token"), std::string::npos) << text;
}

TEST(ExpertSplit, NamesEachRanksHostAndGpu) {
  const ModelConfig flash = synth_config({.shape = "flash"});
  const std::string text = ExpertSplit{.ranks = 4, .hosts = 2}.describe(flash);
  EXPECT_NE(text.find("over 4 GPUs (2 hosts of 2)"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 1: host 0 GPU 1, 64 of 256"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 2: host 1 GPU 0, 64 of 256 routed experts per layer (2,6,10,..,254)"), std::string::npos)
      << text;
}

}  // namespace
}  // namespace keel
