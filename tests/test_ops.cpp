// CPU ops against independent computations: the matrix kernel on every stored format
// against the quant/ dequantizers with f64 sums, RoPE against the spec's values, and the
// small ops against their definitions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>

#include "base/dtype.h"
#include "model/owned_weight.h"
#include "ops/attention.h"
#include "ops/compressor.h"
#include "ops/hyper.h"
#include "ops/linear.h"
#include "ops/moe.h"
#include "ops/rope.h"
#include "ops/sampling.h"
#include "ops/sampling_noise.h"
#include "quant/fp8_block.h"
#include "quant/mxfp4.h"
#include "quant/nvfp4.h"
#include "testing.h"

namespace keel {
namespace {

using testing::random_normal;

struct LinearCase {
  WeightFormat format;
  DType dtype;
  ScaleFormat scale_format;
  const char* name;
};

class LinearFormats : public ::testing::TestWithParam<LinearCase> {};

// Sizes cross the 128-wide FP8 blocks and the FP4 scale groups; a row range starting
// mid-block is what the grouped output projection asks for. Outputs are poisoned first.
TEST_P(LinearFormats, MatchesReferenceDequantizer) {
  const LinearCase& c = GetParam();
  const int64_t out = 261, in = 320;
  const OwnedWeight ow(random_normal(out * in, 7), out, in, c.format, c.dtype, c.scale_format);
  for (const int64_t tokens : {1, 3, 17}) {
    for (const RowRange range : {RowRange{}, RowRange{36, 150}}) {
      const int64_t rows = range.count < 0 ? out : range.count;
      const std::vector<float> x = random_normal(static_cast<size_t>(tokens * in), 11);
      std::vector<float> fast(tokens * rows, std::nanf("")), ref(tokens * rows, std::nanf(""));
      linear(ow.weight(), rows_of(std::span<const float>(x), in), rows_of(std::span<float>(fast), rows), range);
      linear_reference(ow.weight(), rows_of(std::span<const float>(x), in), rows_of(std::span<float>(ref), rows), range);
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_TRUE(std::isfinite(ref[i]));
        ASSERT_NEAR(fast[i], ref[i], 1e-4f * (1.0f + std::fabs(ref[i]))) << c.name << " tokens " << tokens << " at " << i;
      }
    }
  }
}

TEST_P(LinearFormats, DecodeRowEqualsReferenceRow) {
  const LinearCase& c = GetParam();
  const OwnedWeight ow(random_normal(130 * 256, 3), 130, 256, c.format, c.dtype, c.scale_format);
  std::vector<float> row(256, std::nanf("")), one(256, 0.0f), ref(1);
  for (int64_t r : {0, 127, 128, 129}) {
    decode_row(ow.weight(), r, row);
    for (int64_t k = 0; k < 256; k += 37) {  // W[r, k] = W · e_k through the reference
      std::fill(one.begin(), one.end(), 0.0f);
      one[k] = 1.0f;
      linear_reference(ow.weight(), rows_of(std::span<const float>(one), 256), Rows{ref.data(), 1, 1}, {r, 1});
      EXPECT_EQ(row[k], ref[0]) << c.name << " row " << r << " col " << k;
    }
  }
}

// Chunked rows (a batch of several sequences' tokens): every chunk bit for bit what a
// call over its rows alone gives, whichever path its size takes (up to 4 tokens each as
// a decode step, more through the decoded row in fours), next to chunks of other sizes.
TEST_P(LinearFormats, ChunksGiveTheBitsOfSeparateCalls) {
  const LinearCase& c = GetParam();
  const int64_t out = 133, in = 256;
  const OwnedWeight ow(random_normal(out * in, 5), out, in, c.format, c.dtype, c.scale_format);
  const std::vector<int64_t> chunks{1, 5, 4, 9, 2, 1, 6};
  const int64_t rows = std::accumulate(chunks.begin(), chunks.end(), int64_t{0});
  const std::vector<float> x = random_normal(static_cast<size_t>(rows * in), 13);
  std::vector<float> batched(rows * out, std::nanf("")), alone(rows * out, std::nanf(""));
  linear(ow.weight(), ConstRows{x.data(), rows, in, chunks}, rows_of(std::span<float>(batched), out));
  int64_t first = 0;
  for (const int64_t n : chunks) {
    linear(ow.weight(), ConstRows{x.data() + first * in, n, in}, Rows{alone.data() + first * out, n, out});
    first += n;
  }
  EXPECT_EQ(std::memcmp(batched.data(), alone.data(), batched.size() * sizeof(float)), 0) << c.name;
  const std::vector<int64_t> short_by_one{1, 5};
  KEEL_EXPECT_ERROR(linear(ow.weight(), ConstRows{x.data(), 7, in, short_by_one}, Rows{batched.data(), 7, out}),
                    ErrorCode::usage);
}

INSTANTIATE_TEST_SUITE_P(
    All, LinearFormats,
    ::testing::Values(LinearCase{WeightFormat::f32, DType::f32, ScaleFormat::ue8m0, "f32"},
                      LinearCase{WeightFormat::bf16, DType::bf16, ScaleFormat::ue8m0, "bf16"},
                      LinearCase{WeightFormat::bf16, DType::f16, ScaleFormat::ue8m0, "f16"},
                      LinearCase{WeightFormat::fp8_block, DType::f8_e4m3, ScaleFormat::ue8m0, "fp8_ue8m0"},
                      LinearCase{WeightFormat::fp8_block, DType::f8_e4m3, ScaleFormat::f32, "fp8_f32"},
                      LinearCase{WeightFormat::mxfp4, DType::i8, ScaleFormat::ue8m0, "mxfp4"},
                      LinearCase{WeightFormat::nvfp4, DType::u8, ScaleFormat::ue8m0, "nvfp4"}),
    [](const auto& info) { return std::string(info.param.name); });

// Every e4m3 code but the two NaNs, and every e2m1 code, through the fast decoders
// (unit scales) against base/dtype's conversions.
TEST(Linear, DecodesEveryCode) {
  std::vector<uint8_t> codes;
  for (int c = 0; c < 256; ++c)
    if ((c & 0x7f) != 0x7f) codes.push_back(static_cast<uint8_t>(c));
  codes.resize(256, 0x38);  // pad to two 128-blocks with 1.0
  TensorSpec spec{"codes.weight", {1, 256}, TensorRole::linear, WeightFormat::fp8_block};
  const uint8_t unit_scales[2] = {127, 127};  // ue8m0 2^0
  Weight w{&spec, WeightFormat::fp8_block, TensorView::contiguous(codes.data(), DType::f8_e4m3, {1, 256}, Memory::host),
           TensorView::contiguous(unit_scales, DType::f8_e8m0, {1, 2}, Memory::host)};
  std::vector<float> row(256);
  decode_row(w, 0, row);
  for (int k = 0; k < 256; ++k) EXPECT_EQ(row[k], e4m3_to_f32(codes[k])) << "code " << int(codes[k]);

  std::vector<uint8_t> packed(16);  // 32 values: codes 0..15 twice
  for (int i = 0; i < 16; ++i) packed[i] = pack_e2m1(static_cast<uint8_t>(i % 16), static_cast<uint8_t>((i + 7) % 16));
  TensorSpec fp4{"fp4.weight", {1, 32}, TensorRole::linear, WeightFormat::mxfp4};
  const uint8_t one = 127;
  Weight m{&fp4, WeightFormat::mxfp4, TensorView::contiguous(packed.data(), DType::i8, {1, 16}, Memory::host),
           TensorView::contiguous(&one, DType::f8_e8m0, {1, 1}, Memory::host)};
  std::vector<float> values(32);
  decode_row(m, 0, values);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(values[2 * i], e2m1_to_f32(static_cast<uint8_t>(i))) << i;
    EXPECT_EQ(values[2 * i + 1], e2m1_to_f32(static_cast<uint8_t>((i + 7) % 16))) << i;
  }
}

TEST(Linear, RejectsMismatchedRanges) {
  const OwnedWeight ow(random_normal(32, 1), 8, 4, WeightFormat::f32, DType::f32);
  std::vector<float> x(4, 1.0f), y(8);
  KEEL_EXPECT_ERROR(linear(ow.weight(), ConstRows{x.data(), 1, 4}, Rows{y.data(), 1, 8}, RowRange{4, 8}), ErrorCode::usage);
  KEEL_EXPECT_ERROR(linear(ow.weight(), ConstRows{x.data(), 1, 4}, Rows{y.data(), 2, 8}), ErrorCode::usage);
}

// dsv4-forward.md §2.3 lists these f32 values for DeepSeek-V4-Flash.
TEST(Rope, FlashFrequenciesMatchTheSpec) {
  const Rope compress(RopeConfig{.theta = 160000, .rope_dim = 64, .yarn = true, .yarn_factor = 16,
                                 .yarn_original_max_position = 65536, .yarn_beta_fast = 32, .yarn_beta_slow = 1});
  EXPECT_FLOAT_EQ(compress.inv_freq()[15], 3.6355385e-3f);
  EXPECT_FLOAT_EQ(compress.inv_freq()[16], 2.2656249e-3f);
  EXPECT_FLOAT_EQ(compress.inv_freq()[24], 1.9531253e-5f);
  EXPECT_FLOAT_EQ(compress.inv_freq()[31], 5.6805294e-7f);
  const Rope main(RopeConfig{.theta = 10000, .rope_dim = 64});
  EXPECT_FLOAT_EQ(main.inv_freq()[1], 0.74989420f);
  EXPECT_FLOAT_EQ(main.inv_freq()[31], 1.3335215e-4f);
}

TEST(Rope, RotatesAdjacentPairsOfTheTrailingChannels) {
  const Rope rope(RopeConfig{.theta = 10000, .rope_dim = 4});
  std::vector<float> v{5, 6, 1, 0, 0, 1};  // nope [5, 6], rope pairs (1, 0), (0, 1)
  rope.apply(v, 3);
  EXPECT_EQ(v[0], 5);
  EXPECT_EQ(v[1], 6);
  // pair 0: frequency 1, angle 3: (cos 3, sin 3); pair 1: frequency 1/100, angle 0.03
  EXPECT_NEAR(v[2], std::cos(3.0), 1e-6);
  EXPECT_NEAR(v[3], std::sin(3.0), 1e-6);
  EXPECT_NEAR(v[4], -std::sin(0.03), 1e-6);
  EXPECT_NEAR(v[5], std::cos(0.03), 1e-6);
  rope.apply(v, 3, /*inverse=*/true);
  EXPECT_NEAR(v[2], 1, 1e-6);
  EXPECT_NEAR(v[3], 0, 1e-6);
  EXPECT_NEAR(v[4], 0, 1e-6);
  EXPECT_NEAR(v[5], 1, 1e-6);
}

TEST(Hyper, SinkhornIsNearlyDoublyStochastic) {
  std::vector<float> m = random_normal(16, 5, 2.0f);
  sinkhorn(m, 4, 20, 1e-6f);
  for (int i = 0; i < 4; ++i) {
    float row = 0, col = 0;
    for (int j = 0; j < 4; ++j) {
      row += m[i * 4 + j];
      col += m[j * 4 + i];
    }
    EXPECT_NEAR(row, 1.0f, 1e-3f);
    EXPECT_NEAR(col, 1.0f, 1e-5f);  // the last pass normalizes columns
  }
}

TEST(Hyper, OneIterationIsSoftmaxThenColumnNormalization) {
  std::vector<float> m{0, 1, 2, 3};
  sinkhorn(m, 2, 1, 0.0f);
  const double a = 1 / (1 + std::exp(1.0)), b = 1 - a;  // both rows softmax to (a, b)
  EXPECT_NEAR(m[0], a / (2 * a), 1e-6);
  EXPECT_NEAR(m[1], b / (2 * b), 1e-6);
}

TEST(Attention, SinkTakesItsShare) {
  // One head, two keys; q·k = 1 and 0 with scale 1, sink logit 0.
  const std::vector<float> q{1, 0}, k0{1, 0}, k1{0, 1}, sinks{0};
  const std::vector<const float*> keys{k0.data(), k1.data()};
  std::vector<float> out(2, std::nanf(""));
  attend(q, 1, 2, keys, sinks, 1.0f, out);
  const double e = std::exp(1.0), total = e + 1 + 1;
  EXPECT_NEAR(out[0], e / total, 1e-6);
  EXPECT_NEAR(out[1], 1 / total, 1e-6);
}

TEST(Attention, IndexerPicksHighestReluScores) {
  // Two heads of dim 1 with weights (1, 0.5); keys 1, -2, 3: scores
  // relu(q0·k)·1 + relu(q1·k)·0.5 with q = (1, -1): 1, 1, 3.
  const std::vector<float> q{1, -1}, w{1, 0.5f}, keys{1, -2, 3};
  const std::vector<const float*> rows{&keys[0], &keys[1], &keys[2]};
  EXPECT_EQ(indexer_select(q, w, 2, 1, rows, 2), (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(indexer_select(q, w, 2, 1, std::span(rows).first(2), 5), (std::vector<int64_t>{0, 1}));  // only 2 visible
}

TEST(Compressor, PoolIsPerChannelSoftmax) {
  const std::vector<float> values{1, 10, 3, 20}, gates{0, 5, std::log(3.0f), 5};  // 2 slots x 2 channels
  std::vector<float> out(2);
  pool_slots(values, gates, 2, 2, out);
  EXPECT_NEAR(out[0], (1 * 1 + 3 * 3) / 4.0, 1e-6);  // weights 1/4, 3/4
  EXPECT_NEAR(out[1], 15.0, 1e-5);                    // equal gates
}

TEST(Moe, RoutesOnBiasedScoresAndWeighsUnbiased) {
  std::vector<float> scores{0.1f, 0.4f, 0.3f, 0.2f};
  const std::vector<float> bias{1.0f, 0, 0, 0};
  const Routing r = route(scores, bias, {}, 2, 2.0f);
  EXPECT_EQ(r.experts, (std::vector<int32_t>{0, 1}));
  EXPECT_NEAR(r.weights[0], 0.1 / 0.5 * 2, 1e-6);
  EXPECT_NEAR(r.weights[1], 0.4 / 0.5 * 2, 1e-6);
  const std::vector<int32_t> hashed{3, 2};
  EXPECT_EQ(route(scores, {}, hashed, 2, 1.0f).experts, hashed);
}

TEST(Moe, ScoringFunctions) {
  std::vector<float> s{0.0f, 30.0f};
  score_router(s, ScoringFunc::sqrtsoftplus);
  EXPECT_NEAR(s[0], std::sqrt(std::log(2.0)), 1e-6);
  EXPECT_NEAR(s[1], std::sqrt(30.0), 1e-5);  // softplus(x) = x past 20
  std::vector<float> g{0.0f};
  score_router(g, ScoringFunc::sigmoid);
  EXPECT_EQ(g[0], 0.5f);
}

TEST(Moe, SwigluClampsGateAboveAndUpBothSides) {
  std::vector<float> gate{5.0f, -1.0f};
  const std::vector<float> up{-9.0f, 0.5f};
  clamped_swiglu(gate, up, 1.0f);
  EXPECT_NEAR(gate[0], 1.0 / (1 + std::exp(-1.0)) * -1.0, 1e-6);  // gate 5 -> 1, up -9 -> -1
  EXPECT_NEAR(gate[1], -1.0 / (1 + std::exp(1.0)) * 0.5, 1e-6);   // gate below: unclamped
}

}  // namespace
}  // namespace keel

namespace keel {
namespace {

TEST(Sampling, GreedyIsArgmaxWithTiesToTheLowerId) {
  Sampler s({});
  const std::vector<float> logits{0.5f, 2.0f, 2.0f, -1.0f};
  EXPECT_EQ(s.next(logits), 1);
}

TEST(Sampling, FollowsTheDistributionAtTemperatureOne) {
  Sampler s({.temperature = 1.0f, .seed = 3});
  const std::vector<float> logits{std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  std::vector<int> counts(3);
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++counts[s.next(logits)];
  EXPECT_NEAR(counts[0] / double(n), 0.5, 0.02);
  EXPECT_NEAR(counts[1] / double(n), 0.3, 0.02);
  EXPECT_NEAR(counts[2] / double(n), 0.2, 0.02);
}

TEST(Sampling, FiltersKeepOnlyWhatTheyShould) {
  const std::vector<float> logits{std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  const auto seen = [&](SamplingParams p) {
    Sampler s(p);
    std::vector<bool> hit(4);
    for (int i = 0; i < 4000; ++i) hit[s.next(logits)] = true;
    return hit;
  };
  EXPECT_EQ(seen({.temperature = 1, .top_k = 2, .seed = 1}), (std::vector<bool>{true, true, false, false}));
  // top_p 0.7: 0.5 < 0.7, 0.5 + 0.3 >= 0.7 -> two tokens
  EXPECT_EQ(seen({.temperature = 1, .top_p = 0.7f, .seed = 1}), (std::vector<bool>{true, true, false, false}));
  // min_p 0.25: keeps p >= 0.125 -> three tokens
  EXPECT_EQ(seen({.temperature = 1, .min_p = 0.25f, .seed = 1}), (std::vector<bool>{true, true, true, false}));
  EXPECT_EQ(seen({.temperature = 1, .seed = 1}), (std::vector<bool>{true, true, true, true}));
}

TEST(Sampling, SameSeedSameTokens) {
  const std::vector<float> logits = random_normal(50, 9);
  Sampler a({.temperature = 0.9f, .top_p = 0.95f, .seed = 42}), b({.temperature = 0.9f, .top_p = 0.95f, .seed = 42});
  for (int i = 0; i < 100; ++i) ASSERT_EQ(a.next(logits), b.next(logits));
}

// The noise's logarithm is built from exactly rounded operations so the host and the
// GPU agree bit for bit; it must still be a logarithm.
TEST(Sampling, ExactLogIsALogarithm) {
  float worst = 0;
  for (float x = 1e-7f; x < 1e7f; x *= 1.0137f) {
    const double want = std::log(static_cast<double>(x));
    worst = std::max(worst, static_cast<float>(std::fabs(exact_log(x) - want) / std::max(1.0, std::fabs(want))));
  }
  EXPECT_LT(worst, 4e-7f);
  EXPECT_EQ(exact_log(1.0f), 0.0f);
}

// Gumbel noise has mean γ (Euler–Mascheroni) and variance π²/6; draws and tokens are
// independent streams.
TEST(Sampling, NoiseIsStandardGumbel) {
  double sum = 0, squares = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double g = gumbel_noise(7, static_cast<uint64_t>(i / 1000), i % 1000);
    sum += g;
    squares += g * g;
  }
  const double mean = sum / n, variance = squares / n - mean * mean;
  EXPECT_NEAR(mean, 0.5772157, 0.01);
  EXPECT_NEAR(variance, 1.6449341, 0.02);
  EXPECT_NE(gumbel_noise(7, 0, 1), gumbel_noise(7, 1, 0));
  EXPECT_NE(gumbel_noise(7, 0, 1), gumbel_noise(8, 0, 1));
}

// A summary with only the candidates a choice needs gives the token the whole sorted
// row gives, for every filter; and sampling over the whole row (no top-k or top-p)
// gives the token top_k = vocab gives, whose keys are the same noise over the same set.
TEST(Sampling, ChoosingFromCandidatesEqualsChoosingFromTheWholeRow) {
  const int64_t vocab = 3000;
  int compared = 0;
  for (uint32_t trial = 0; trial < 40; ++trial) {
    std::vector<float> logits = random_normal(vocab, 100 + trial, 2.0f + static_cast<float>(trial % 4));
    if (trial % 5 == 0) {
      for (float& v : logits) v = std::round(v * 2) / 2;  // many ties
    }
    const std::vector<SamplingParams> cases{
        {.temperature = 0.0f},
        {.temperature = 0.7f, .seed = trial},
        {.temperature = 1.0f, .top_k = 40, .seed = trial},
        {.temperature = 1.3f, .top_p = 0.9f, .seed = trial},
        {.temperature = 0.8f, .top_k = 100, .top_p = 0.8f, .min_p = 0.05f, .seed = trial},
        {.temperature = 1.0f, .min_p = 0.1f, .seed = trial},
        {.temperature = 2.0f, .top_p = 0.5f, .min_p = 0.02f, .seed = trial},
    };
    for (const SamplingParams& p : cases) {
      for (uint64_t draw = 0; draw < 3; ++draw) {
        const RowSummary all = summarize(logits, summary_task(p, draw, static_cast<int>(vocab)));
        const RowSummary few = summarize_for(logits, {p, draw, 1});
        ASSERT_TRUE(summary_suffices(p, few));
        ASSERT_EQ(choose(p, draw, few), choose(p, draw, all)) << "trial " << trial << " draw " << draw;
        if (p.temperature > 0 && p.top_k == 0 && p.top_p == 1.0f) {
          SamplingParams every = p;
          every.top_k = static_cast<int>(vocab);
          ASSERT_EQ(choose(p, draw, few), choose(every, draw, all)) << "trial " << trial;
        }
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 40 * 7 * 3);
}

// A top-p whose mass the listed candidates do not reach asks for the whole row.
TEST(Sampling, TopPBeyondTheCandidatesNeedsTheWholeRow) {
  const std::vector<float> flat(5000, 0.0f);
  const SamplingParams p{.temperature = 1.0f, .top_p = 0.9f};
  const RowSummary some = summarize(flat, summary_task(p, 0, candidates_needed(p)));
  EXPECT_EQ(some.ids.size(), static_cast<size_t>(kMaxCandidates));
  EXPECT_FALSE(summary_suffices(p, some));
  const RowSummary all = summarize_for(flat, {p, 0, 1});
  EXPECT_EQ(all.ids.size(), flat.size());
  EXPECT_TRUE(summary_suffices(p, all));
}

// Logprobs from a summary are ln softmax, for candidates and for the whole-row pick.
TEST(Sampling, SummaryLogprobsAreLogSoftmax) {
  const std::vector<float> logits = random_normal(500, 21, 3.0f);
  double z = 0;
  for (float v : logits) z += std::exp(static_cast<double>(v));
  const SamplingParams p{.temperature = 1.0f, .seed = 5};
  const RowSummary s = summarize_for(logits, {p, 0, 5});
  ASSERT_EQ(s.ids.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_NEAR(logprob_of(s, s.ids[i]), logits[s.ids[i]] - std::log(z), 1e-5);
    if (i) EXPECT_GE(s.logits[i - 1], s.logits[i]);
  }
  ASSERT_GE(s.whole_pick, 0);
  EXPECT_NEAR(logprob_of(s, s.whole_pick), logits[s.whole_pick] - std::log(z), 1e-5);
}

TEST(Sampling, RejectsBadParameters) {
  KEEL_EXPECT_ERROR(Sampler({.temperature = -1}), ErrorCode::bad_input);
  KEEL_EXPECT_ERROR(Sampler({.top_k = -2}), ErrorCode::bad_input);
  KEEL_EXPECT_ERROR(Sampler({.top_p = 0}), ErrorCode::bad_input);
  KEEL_EXPECT_ERROR(Sampler({.min_p = 1.5f}), ErrorCode::bad_input);
}

}  // namespace
}  // namespace keel
